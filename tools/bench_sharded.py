"""``tierstore bench sharded``: ShardedEmbeddingBagCollection on 1, 2 and 4 local
ranks (gloo over 127.0.0.1) against TieredEmbeddingBagCollection in one process
on the same global batches, measured in the same run.

Every rank trains the same small model (the tables, pooled and summed into a
fixed linear head, Adagrad) on its part of each global batch. Per world size it
prints the step time against the one-process baseline, the bytes each rank sent
to the others per step (counted at torch.distributed's all_gather and
all_to_all_single, i.e. what the module hands to the network, its own part left
out) against the plan's prediction, and each rank's lookups and SSD reads per step
(its store's counters) against the plan's.

Then the bytes each rank receives a step, by kind (the module's ``received_bytes``:
headers, sizes, ids, rows, gradients), with a fixed local batch per rank, so the
global batch grows with the ranks, and every table row-sharded over all ranks (a whole
table's or a column shard's owner receives all of the table's ids whatever the world
size): what a rank receives should stay flat. Their sum
over the ranks is checked against what torch.distributed was handed (every byte sent
is received once) and against the plan's predicted bytes sent.

The plan comes from ``plan()`` on the trace of the very batches the bench trains
on, so the comparison checks the planner's model of each rank's work and of the
module's protocol, not how well a trace forecasts the future.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierstore.capacity.planner import READS_PER_STEP
from tierstore.tools.bench import shared
from tierstore.validate import check_int
from tierstore.errors import SettingError, StateError

WORLD_SIZES = (1, 2, 4)
KINDS = ("headers", "sizes", "ids", "rows", "grads")  # ShardedEmbeddingBagCollection.received_bytes
WARMUP = 3


@dataclass(frozen=True)
class ShardedBenchConfig:
    """The bench's model and data (validated)."""

    tables: tuple[tuple[str, int, float], ...] = (("cold", 400_000, 0.6), ("hot", 2_000, 1.3), ("mid0", 20_000, 1.0),
                                                  ("mid1", 30_000, 1.0))
    dim: int = 32
    batch: int = 256  # global samples per step, split evenly among the ranks
    local_batch: int = 2048  # samples per rank and step where the global batch grows with the ranks
    pooling: int = 8  # ids per sample and table (fixed: the ranks' parts are equal in ids too)
    steps: int = 15
    hbm_bytes: int = 256 << 10  # per rank
    ddr_bytes: int = 1 << 20  # per rank
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self):
        for name in ("dim", "batch", "local_batch", "pooling", "steps", "hbm_bytes", "ddr_bytes"):
            check_int(getattr(self, name), name, at_least=1)
        if self.batch % max(WORLD_SIZES):
            raise SettingError(f"batch must be a multiple of {max(WORLD_SIZES)} (every rank gets an equal part), got {self.batch}")


# -- ranks in local processes ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in a gloo
    process group on 127.0.0.1; their return values, by rank. A rank that fails raises
    StateError here with its traceback (the others are stopped)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, results, args, timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    done = False
    try:
        while len(got) < world_size:
            if not results.empty():
                rank, ok, value = results.get()
                if not ok:
                    raise StateError(f"rank {rank} of {world_size} failed:\n{value}")
                got[rank] = value
                continue
            dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if dead or time.monotonic() > deadline:
                time.sleep(0.5)  # a failing rank's report may still be on its way
                if results.empty():
                    raise StateError(f"ranks {sorted(dead) or 'some'} of {world_size} ended without a result "
                                       f"(exit codes {dead}) or did not answer within {timeout_s:.0f} s")
            time.sleep(0.02)
        done = True
    finally:
        for p in procs:
            if not done and p.is_alive():
                p.kill()  # the others may be waiting in a collective for the rank that failed
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world_size)]


def _rank_main(fn, rank, world_size, port, results, args, timeout_s) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # every rank's side of gloo's mesh is up before any rank may finish and close its side
        dist.barrier()
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


class SentBytes:
    """Bytes this process sends to other ranks through torch.distributed's all_gather and
    all_to_all_single (the collectives the sharded module moves data with), while active."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self) -> "SentBytes":
        import torch.distributed as dist

        self._saved = dist.all_gather, dist.all_to_all_single
        gather, to_all = self._saved

        def all_gather(out, t, group=None, **kw):
            self.bytes += t.numel() * t.element_size() * (dist.get_world_size(group) - 1)
            return gather(out, t, group=group, **kw)

        def all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            row = inp.element_size() * (inp[0].numel() if inp.dim() > 1 and len(inp) else 1)
            me = dist.get_rank(group)
            splits = input_split_sizes or [len(inp) // dist.get_world_size(group)] * dist.get_world_size(group)
            self.bytes += row * (sum(splits) - splits[me])
            return to_all(out, inp, output_split_sizes, input_split_sizes, group=group, **kw)

        dist.all_gather, dist.all_to_all_single = all_gather, all_to_all_single
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_gather, dist.all_to_all_single = self._saved


# -- the model and its data ---------------------------------------------------------------------------------
def make_trace(cfg: ShardedBenchConfig):
    from tierstore.tools.synth import SynthConfig, SynthTable, synth

    steps = WARMUP + cfg.steps
    return synth(SynthConfig(tuple(SynthTable(n, rows, alpha) for n, rows, alpha in cfg.tables), batch_size=cfg.batch,
                             pooling=float(cfg.pooling), steps=steps, dim=cfg.dim, seed=cfg.seed))


def specs_of(cfg: ShardedBenchConfig):
    import tierstore

    init = tierstore.RowInit.uniform(-0.05, 0.05, seed=cfg.seed)
    return [tierstore.TableSpec(n, rows, cfg.dim, init=init) for n, rows, _ in cfg.tables]


def local_batches(trace, cfg: ShardedBenchConfig, rank: int, world_size: int) -> list[dict]:
    """Each step's features of rank ``rank``: its contiguous part of the global batch's samples."""
    part = cfg.batch // world_size
    offsets = torch.arange(part) * cfg.pooling
    out = []
    for step in range(trace.n_steps):  # a loop per step and table
        calls = np.flatnonzero(trace.call_step == step)
        feats = {}
        for c in calls:
            ids = torch.from_numpy(np.array(trace.ids[trace.offsets[c]: trace.offsets[c + 1]]))
            lo = rank * part * cfg.pooling
            feats[trace.tables[trace.call_table[c]].name] = (ids[lo: lo + part * cfg.pooling], offsets)
        out.append(feats)
    return out


def head(cfg: ShardedBenchConfig) -> torch.Tensor:
    return torch.randn(cfg.dim, generator=torch.Generator().manual_seed(cfg.seed + 1))


def _train(module, batches, w: torch.Tensor, rank_stats: Callable[[], dict], barrier: Callable[[], None]) -> dict:
    """Steps through ``batches``: counts over all of them (as the plan, from the first step's empty
    tiers), step time over all but the first WARMUP."""
    times, before = [], rank_stats()
    for i, feats in enumerate(batches):
        barrier()
        t0 = time.perf_counter()
        outs = module(feats)
        # the global loss is the sum of the ranks' (sum over samples): each sample's gradient is as in one process
        loss = sum((o @ w).pow(2).sum() for o in outs.values())
        loss.backward()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    after = rank_stats()
    return {"step_s": statistics.median(times), "counts": {k: after[k] - before[k] for k in after}}


def store_counts(store) -> dict:
    """A store's uses (counted at each table's top tier, as capacity does), their hits in
    HBM and DDR, unique rows a step's reads (half the uses: the sharded module reads a
    step's rows twice) and rows read from LMDB."""
    out = {"uses": 0, "hbm_hits": 0, "ddr_hits": 0, "ssd_reads": 0}
    if store is not None:
        for t in store.stats(per_table=True).values():  # a loop per table
            h, d = t["hbm"], t["ddr"]
            out["uses"] += (h["hits"] + h["misses"]) or (d["hits"] + d["misses"]) or t["ssd"]["reads"]
            out["hbm_hits"] += h["hits"]
            out["ddr_hits"] += d["hits"]
            out["ssd_reads"] += t["ssd"]["reads"]
    return {**out, "lookups": out["uses"] / READS_PER_STEP}


def _sharded_rank(rank: int, world_size: int, cfg: ShardedBenchConfig, trace, plan_json: str, workdir: str) -> dict:
    import torch.distributed as dist

    import tierstore
    from tierstore.distributed import ShardedEmbeddingBagCollection
    from tierstore.training.sharding import ShardingPlan

    p = ShardingPlan.from_json(plan_json)
    tiers = p.predicted[rank]["tiers"]
    module = ShardedEmbeddingBagCollection(specs_of(cfg), p, workdir, hbm_rows={t: h for t, (h, _) in tiers.items()},
                                           ddr_rows={t: d for t, (_, d) in tiers.items()}, policy="lru",
                                           optimizer=tierstore.optim.Adagrad(lr=cfg.lr), device="cpu")
    try:
        with SentBytes() as sent:
            result = _train(module, local_batches(trace, cfg, rank, world_size), head(cfg),
                            lambda: {**store_counts(module.local_store), "sent": sent.bytes, **module.received_bytes},
                            dist.barrier)
    finally:
        module.close()
    return result


def _baseline(cfg: ShardedBenchConfig, trace, workdir: str) -> dict:
    """TieredEmbeddingBagCollection in this process on the global batches, the tiers a one-rank plan gives."""
    import tierstore
    from tierstore.capacity.planner import plan

    p = plan(specs_of(cfg), 1, trace=trace, hbm_bytes=cfg.hbm_bytes, ddr_bytes=cfg.ddr_bytes, optimizer=tierstore.optim.Adagrad(1.0))
    tiers = p.predicted[0]["tiers"]
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        ebc = tierstore.TieredEmbeddingBagCollection(tables=specs_of(cfg), path=d, hbm_rows={t: h for t, (h, _) in tiers.items()},
                                                     ddr_rows={t: dd for t, (_, dd) in tiers.items()}, policy="lru",
                                                     optimizer=tierstore.optim.Adagrad(lr=cfg.lr), device="cpu")
        try:
            return _train(ebc, local_batches(trace, cfg, 0, 1), head(cfg), lambda: store_counts(ebc.store), lambda: None)
        finally:
            ebc.close()


def _run(cfg: ShardedBenchConfig, trace, w: int, workdir: str, sharding: dict | None = None) -> dict:
    """The plan for ``w`` ranks (``sharding`` forced per table) and each rank's _train result."""
    import tierstore
    from tierstore.capacity.planner import plan

    p = plan(specs_of(cfg), w, trace=trace, hbm_bytes=cfg.hbm_bytes, ddr_bytes=cfg.ddr_bytes,
             optimizer=tierstore.optim.Adagrad(1.0), sharding=sharding)
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        ranks = run_ranks(_sharded_rank, w, cfg, trace, p.to_json(), d)  # built once a run: each rank unpickles it
    return {"plan": p, "ranks": ranks}


def measure(cfg: ShardedBenchConfig, workdir: str, world_sizes=WORLD_SIZES) -> dict:
    """Per world size: the plan, and each rank's measured step time, bytes sent, lookups and SSD reads per step."""
    torch.set_num_threads(1)
    trace = make_trace(cfg)
    out = {"baseline": _baseline(cfg, trace, workdir), "runs": {}}
    for w in world_sizes:  # a loop per world size
        out["runs"][w] = _run(cfg, trace, w, workdir)
    return out


def measure_received(cfg: ShardedBenchConfig, workdir: str, world_sizes=WORLD_SIZES, steps: int = 1) -> dict:
    """Per world size, ranks each given ``cfg.local_batch`` samples a step (``steps`` after WARMUP),
    every table row-sharded over all ranks (a whole table's or a column shard's owner receives
    all of its ids, however many ranks there are): the plan and each rank's counts (received
    bytes by kind, sent bytes) over all the steps."""
    torch.set_num_threads(1)
    out = {}
    for w in world_sizes:  # a loop per world size
        c = dataclasses.replace(cfg, batch=cfg.local_batch * w, steps=steps)
        out[w] = _run(c, make_trace(c), w, workdir, sharding={t: "row" for t, _, _ in cfg.tables} if w > 1 else None)
    return out


def format_report(cfg: ShardedBenchConfig, m: dict) -> str:
    base = m["baseline"]["step_s"]
    n = WARMUP + cfg.steps  # counts are per step over all steps
    lines = [f"\n== bench sharded: ShardedEmbeddingBagCollection on gloo (127.0.0.1), 1 thread per rank, {os.cpu_count()} cores",
             f"   tables {', '.join(f'{t}:{r:,}' for t, r, _ in cfg.tables)} x dim {cfg.dim}; global batch {cfg.batch} x pooling "
             f"{cfg.pooling} per table; Adagrad; per rank HBM {cfg.hbm_bytes:,} B + DDR {cfg.ddr_bytes:,} B; "
             f"{cfg.steps} timed steps after {WARMUP} (median step; counts per step over all {n})",
             f"   baseline: TieredEmbeddingBagCollection, one process, global batch: {1e3 * base:.1f} ms a step",
             "",
             f"   {'ranks':>5} {'step ms':>8} {'x baseline':>10} {'rank':>4} {'sent B/step':>12} {'predicted':>10} "
             f"{'lookups/step':>12} {'predicted':>10} {'SSD rd/step':>11} {'predicted':>10}"]
    for w, run in m["runs"].items():
        lines.append(f"   plan for {w}: " + "; ".join(f"{t} {tp.sharding} on {list(tp.ranks)}" for t, tp in run["plan"].tables.items()))
    for w, run in m["runs"].items():
        step = max(r["step_s"] for r in run["ranks"])
        for r, (got, pred) in enumerate(zip(run["ranks"], run["plan"].predicted)):
            c = got["counts"]
            lead = f"   {w:>5} {1e3 * step:>8.1f} {step / base:>9.2f}x" if r == 0 else " " * 28
            lines.append(f"{lead} {r:>4} {c.get('sent', 0) / n:>12,.0f} {pred.get('exchange_bytes_per_step', 0):>10,.0f} "
                         f"{c['lookups'] / n:>12,.1f} {pred['lookups_per_step']:>10,.1f} "
                         f"{c['ssd_reads'] / n:>11,.1f} {pred['ssd_reads_per_step']:>10,.1f}")
    lines += [
        "",
        "   What this can show on this machine: the bytes each rank sends (exact counts, independent of the cores), each",
        "   rank's share of lookups and SSD reads, and whether the plan predicts them. What it cannot: speed-up. The ranks",
        f"   share {os.cpu_count()} cores (4 ranks oversubscribe them) and talk over loopback, so step time here is CPU",
        "   contention plus gloo's per-message cost, not what ranks on their own hosts with a real network would see.",
        "   Lookups are unique rows a step: a rank's store reads them twice (forward fetch, backward update) and counts",
        "   both, so its count is halved here; SSD reads count both reads, and the plan predicts both. Measured SSD reads",
        "   are below the plan's by the re-reads the store's write-back queue serves (rows written, not yet committed);",
        "   a store with writeback_rows=0 reads exactly the plan's rows (tests/test_planner.py).",
    ]
    return "\n".join(lines)


def format_received(cfg: ShardedBenchConfig, runs: dict, steps: int = 1) -> str:
    n = WARMUP + steps
    lines = [f"\n   Bytes each rank receives a step, by kind: {cfg.local_batch} samples x {cfg.pooling} ids a table on every rank "
             f"(the global batch grows with the ranks),\n   every table row-sharded over all ranks; counts over {n} steps",
             f"   {'ranks':>5} {'rank':>4} " + " ".join(f"{k:>9}" for k in KINDS) + f" {'total':>10}  ids if all-gathered"]
    for w, run in runs.items():
        lines.append(f"   plan for {w}: " + "; ".join(f"{t} {tp.sharding} on {list(tp.ranks)}" for t, tp in run["plan"].tables.items()))
        # what every rank would receive of the ids alone if each got the global batch's (8 bytes an id)
        gathered = 8 * (w - 1) * cfg.local_batch * cfg.pooling * len(cfg.tables)
        for r, got in enumerate(run["ranks"]):
            c = got["counts"]
            lines.append(f"   {w if r == 0 else '':>5} {r:>4} " + " ".join(f"{c[k] / n:>9,.0f}" for k in KINDS) +
                         f" {sum(c[k] for k in KINDS) / n:>10,.0f}  {gathered:>10,}")
        got = sum(sum(r["counts"][k] for k in KINDS) for r in run["ranks"]) / n
        sent = sum(r["counts"]["sent"] for r in run["ranks"]) / n
        pred = sum(p.get("exchange_bytes_per_step", 0) for p in run["plan"].predicted)
        lines.append(f"   {'':>5} {'all':>4} received {got:,.0f} B a step ({got / w:,.0f} a rank) = sent {sent:,.0f} "
                     f"(plan: {pred:,.0f})")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "dir", "seed")
    p.add_argument("--ranks", type=_ranks, default=None,
                   help="world sizes to run, comma-separated, each 1 to 8 (default 1,2,4; 1,2,4,8 adds 8 ranks; with --dmp "
                        "2,4,8)")
    p.add_argument("--dmp", action="store_true",
                   help="instead: TorchRec's DistributedModelParallel with tierstore shards against TorchRec's own, on 2, 4 "
                        "and 8 ranks, same batches (needs TorchRec)")


def _ranks(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or not all(1 <= w <= 8 for w in sizes):
        raise argparse.ArgumentTypeError(f"expected world sizes from 1 to 8, comma-separated (e.g. 1,2,4,8), got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> None:
    cfg = ShardedBenchConfig(seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-sharded-", dir=args.dir) as d:
        if args.dmp:
            from tierstore.tools import bench_sharded_dmp

            print(bench_sharded_dmp.format_report(cfg, bench_sharded_dmp.measure(cfg, d, args.ranks or bench_sharded_dmp.WORLD_SIZES)))
        else:
            ranks = args.ranks or WORLD_SIZES
            print(format_report(cfg, measure(cfg, d, ranks)))
            print(format_received(cfg, measure_received(cfg, d, ranks)))
