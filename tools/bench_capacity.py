"""``tierstore bench capacity``: how fast the capacity library computes miss-ratio
curves (exact LRU and SHARDS) on a Zipf trace, against a plain-Python LRU of one size."""
from __future__ import annotations

from collections import OrderedDict

from tierstore.capacity.curves import lru_curves
from tierstore.capacity.shards import shards_curves
from tierstore.tools.bench import median_seconds, shared
from tierstore.tools.bench import report as bench_report
from tierstore.tools.synth import SynthConfig, synth


def add_arguments(p) -> None:
    shared(p, "batch", "seed", repeat=3, helps={"batch": "ids per batch of the trace",
                                                "repeat": "timed runs of each side (at most 3: each takes seconds)"})


def run(args) -> None:
    """``tierstore bench capacity``: exact LRU and SHARDS speed on a Zipf trace, against
    a plain-Python LRU simulation of one size on a prefix of the same trace."""
    # the trace: 10M accesses, Zipf 1.05 over 10M rows; --batch sets the ids per call
    accesses, rows = 10_000_000, 10_000_000
    batch = args.batch
    steps = -(-accesses // batch)
    cfg = SynthConfig(tables=(("t0", rows),), alpha=1.05, batch_size=batch, pooling=1, steps=steps, seed=args.seed)
    trace = synth(cfg)
    repeat = min(args.repeat, 3)  # each run is seconds long
    # baseline: an OrderedDict LRU of one size (1% of the rows), per id, on the first 1M accesses
    ids = trace.ids[:1_000_000].tolist()

    def one_size_lru():
        lru, cap = OrderedDict(), rows // 100
        for x in ids:
            if x in lru:
                lru.move_to_end(x)
            else:
                lru[x] = None
                if len(lru) > cap:
                    lru.popitem(last=False)

    base = len(ids) / median_seconds(one_size_lru, repeat, warmup=0)
    exact = trace.n_accesses / median_seconds(lambda: lru_curves(trace), repeat, warmup=0)
    fast = trace.n_accesses / median_seconds(lambda: shards_curves(trace, 0.01, estimate_error=False), repeat, warmup=0)
    bench_report(
        "capacity: miss-ratio curves of a Zipf trace",
        {"accesses": f"{trace.n_accesses:,}", "rows": f"{rows:,}", "alpha": 1.05, "batch": batch, "median of": repeat},
        [("plain-Python LRU, one size", f"{base / 1e6:.2f}M accesses/s"),
         ("exact LRU curve, every size", f"{exact / 1e6:.2f}M accesses/s (goal >= 2M)"),
         ("SHARDS rate 0.01", f"{fast / 1e6:.2f}M accesses/s (goal >= 20M)")],
        "exact curve vs one-size Python LRU", exact / base, ">= 1x, while giving every size at once",
    )
