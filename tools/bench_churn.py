"""``tierstore bench churn`` (or ``python -m tierstore.tools.bench_churn``): what
admission (admit_after) and TTL eviction (ttl_steps) do to an unbounded table's
disk, and to a model's loss.

Disk: a synthetic stream (tierstore.tools.synth: Zipf over 10**12 ids, so most
ids are seen once) trains a TieredEmbeddingBag (SGD) with each setting in turn;
the figures are data.mdb's size and the rows on disk at the end, against the
same stream with neither knob (the baseline, in the same run).

Loss: the demo's DLRM (tierstore.tools.demo: synthetic clicks from a hidden
logistic model) trained with each setting on the same batches; the figures
are the mean loss over the last steps and on held-out batches.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tierstore.tools.bench import shared
from tierstore.tools.cli import nonneg_int, positive_int

DIM = 16
DEMO_WIDTH = 1 << 18  # sketch counters per row for the demo's tables of 200k rows (1 MiB a table)
ID_SPACE = 10**12  # Zipf ranks over this many ids: a long tail of ids seen once
ALPHA = 1.05


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    admit_after: int = 1
    ttl_steps: int | None = None


def settings(admit_after: int, ttl_steps: int) -> list[Setting]:
    return [Setting("baseline"), Setting(f"admit_after={admit_after}", admit_after),
            Setting(f"ttl_steps={ttl_steps}", ttl_steps=ttl_steps), Setting("both", admit_after, ttl_steps)]


def _spec(name: str, num_rows, setting: Setting, width: int, **kw):
    import tierstore
    return tierstore.TableSpec(name, num_rows, DIM, init=tierstore.RowInit.uniform(-0.05, 0.05, seed=1),
                               admit_after=setting.admit_after, ttl_steps=setting.ttl_steps, admit_width=width, **kw)


def stream(total_ids: int, per_step: int, seed: int) -> list[np.ndarray]:
    from tierstore.tools.synth import SynthConfig, SynthTable, synth

    steps = max(1, total_ids // per_step)
    trace = synth(SynthConfig(tables=(SynthTable("t", ID_SPACE),), alpha=ALPHA, batch_size=per_step, pooling=1.0,
                              steps=steps, dim=DIM, seed=seed))
    return [trace.ids[trace.offsets[i]: trace.offsets[i + 1]] for i in range(steps)]


def disk_run(path: Path, setting: Setting, steps: list[np.ndarray], width: int, cache_rows: int) -> dict:
    import tierstore

    store = tierstore.TieredStore(path, tables=[_spec("t", None, setting, width, state_dim=0)], hbm_rows=cache_rows,
                                  device="cpu")
    emb = tierstore.TieredEmbeddingBag(None, DIM, mode="sum", store=store, table="t", optimizer=tierstore.optim.SGD(lr=0.1))
    start = time.perf_counter()
    for ids in steps:
        ids = torch.from_numpy(ids)
        offsets = torch.arange(0, len(ids), 8)
        emb(ids, offsets).pow(2).mean().backward()  # any loss: every admitted row it uses is updated
    store.flush()
    seconds = time.perf_counter() - start
    rows = store.stats(per_table=True)["t"]["rows"]
    distinct = len(np.unique(np.concatenate(steps)))
    store.close()
    disk, compacted = tierstore.TieredStore.compact(path)  # LMDB reuses freed pages; compaction gives them back
    return {"seconds": seconds, "disk_bytes": disk, "compacted_bytes": compacted, "distinct": distinct, **rows}


def loss_run(path: Path, setting: Setting, steps: int, width: int) -> tuple[float, float, float]:
    """(mean loss over the last steps, held-out loss, data.mdb bytes) of the demo's DLRM."""
    import tierstore
    from tierstore.tools import demo

    cfg = demo.DemoConfig(dir=path, steps=steps, progress=False)
    torch.set_num_threads(cfg.threads)
    g = torch.Generator().manual_seed(cfg.seed)
    data = demo.ClickData(cfg, g)
    specs = [_spec(n, None, setting, width) for n in cfg.table_names]
    ebc = tierstore.TieredEmbeddingBagCollection(tables=specs, path=path / "store", hbm_rows=cfg.hbm_rows, ddr_rows=cfg.ddr_rows,
                                                 device="cpu", optimizer=demo._tierstore_opt(cfg.optimizer, cfg.lr))
    model = demo.DLRM(ebc, cfg.table_names, cfg.dim, torch.Generator().manual_seed(cfg.seed + 1))
    result = demo._train(cfg, model, None, data, g, time.perf_counter, setting.name, None)
    ebc.close()
    w = min(demo.LOSS_WINDOW, len(result.losses))
    return float(np.mean(result.losses[-w:])), result.eval_loss, (path / "store" / "data.mdb").stat().st_size


def main(total_ids: int, per_step: int, admit_after: int, ttl_steps: int, demo_steps: int, width: int, cache_rows: int,
         workdir: str | None, seed: int, out=sys.stdout) -> None:
    with tempfile.TemporaryDirectory(prefix="tierstore-churn-", dir=workdir) as d:
        steps = stream(total_ids, per_step, seed)
        print(f"\n== churn: disk over {sum(map(len, steps)):,} ids ({len(steps)} steps of {per_step:,}; Zipf {ALPHA} over "
              f"{ID_SPACE:.0e} ids), dim {DIM}, SGD, hbm_rows {cache_rows:,}, sketch {width:,} x 4", file=out)
        base = None
        for s in settings(admit_after, ttl_steps):
            r = disk_run(Path(d) / f"disk-{s.name}", s, steps, width, cache_rows)
            base = base or r
            print(f"   {s.name:<16} data.mdb {r['disk_bytes'] / 2**20:8.1f} MiB ({r['disk_bytes'] / base['disk_bytes']:.2f}x baseline), "
                  f"compacted {r['compacted_bytes'] / 2**20:.1f} MiB"
                  f"  rows on disk {r['stored']:>10,} of {r['distinct']:,} distinct  evicted {r['evicted']:>10,}"
                  f"  rejected uses {r['rejected']:>10,}  {r['seconds']:.1f} s", file=out)
        if demo_steps:
            print(f"\n== churn: demo DLRM loss, {demo_steps} steps (tierstore demo's defaults, unbounded tables, "
                  f"sketch {DEMO_WIDTH:,} x 4 a table)", file=out)
            for s in settings(admit_after, ttl_steps):
                last, held_out, disk = loss_run(Path(d) / f"demo-{s.name}", s, demo_steps, DEMO_WIDTH)
                print(f"   {s.name:<16} loss last steps {last:.4f}  held-out {held_out:.4f}  data.mdb {disk / 2**20:.1f} MiB", file=out)


# 3M ids: the four disk runs and four demo runs take about 2 minutes on a 2-core machine (10M: about 3x that)
DEFAULT_IDS = 3_000_000
DEFAULT_TTL = 50  # steps of 16k ids: the 3M-id stream is 183 steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "dir", "seed", batch=16_384, helps={"batch": "ids per step"})
    p.add_argument("--ids", type=positive_int, default=DEFAULT_IDS, help="ids in the stream")
    p.add_argument("--admit-after", type=positive_int, default=2,
                   help="the admission setting's admit_after: a row's updates are kept from its Nth step on")
    p.add_argument("--ttl-steps", type=positive_int, default=DEFAULT_TTL,
                   help="the TTL setting's ttl_steps: a row unused this many steps reads as initial again")
    p.add_argument("--demo-steps", type=nonneg_int, default=300, help="steps of the demo model per setting (0: skip)")
    p.add_argument("--width", type=positive_int, default=1 << 22, help="sketch counters per row (a power of two)")
    p.add_argument("--hbm-rows", type=nonneg_int, default=8192, help="the HBM tier's rows in the disk runs")


def run(args: argparse.Namespace) -> None:
    main(args.ids, args.batch, args.admit_after, args.ttl_steps, args.demo_steps, args.width, args.hbm_rows, args.dir,
         args.seed)


def _cli(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tierstore.tools.bench_churn", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    _cli()
