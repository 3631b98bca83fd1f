"""``tierstore demo --world-size N``: the demo DLRM with its tables sharded over N
local processes (ShardedEmbeddingBagCollection on gloo over 127.0.0.1), checked
against the same model trained in one process.

The plan comes from ``tierstore.capacity.planner.plan`` on a trace of the run's first
batches, with each rank's tier budget the single process's split N ways. Each rank
trains on its 1/N of every batch's samples: the module pools its bags and routes
their gradients to the rows' owners. The dense MLPs run on the whole batch on every
rank (the pooled bags are all-gathered; each rank's backward keeps its own part of
the gradient, which is the same on every rank), so every rank computes the one
process's loss and dense gradients op for op; a job that does not need bit-for-bit
equality would run them data-parallel and all-reduce their gradients instead.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from tierstore.tools.bench_sharded import run_ranks, store_counts
from tierstore.tools.demo import DLRM, ClickData, DemoConfig, _one_process, _specs, _start, _tierstore_opt, _train, seeded
from tierstore.errors import SettingError

PLAN_STEPS = 20  # batches of the trace the plan is made from


class _Gather(torch.autograd.Function):
    """Every rank's pooled bags, in rank order; backward keeps this rank's rows of the
    gradient (every rank computed the same global loss, so the same gradient)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, rank: int, world_size: int):
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(parts, local.contiguous())
        ctx.rank, ctx.n = rank, len(local)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.n: (ctx.rank + 1) * ctx.n], None, None


class RankPart:
    """The embeddings of a DLRM whose batch is global: pools this rank's part of the
    bags through the sharded module and gathers every rank's."""

    def __init__(self, module, rank: int, world_size: int):
        self.module, self.rank, self.world_size = module, rank, world_size

    def __call__(self, sparse):
        local = {}
        for name, (ids, offsets) in sparse.items():  # a loop per table
            bags = len(offsets) // self.world_size
            lo, hi = self.rank * bags, (self.rank + 1) * bags
            start = int(offsets[lo])
            stop = int(offsets[hi]) if hi < len(offsets) else len(ids)
            local[name] = (ids[start:stop], offsets[lo:hi] - start)
        pooled = self.module(local)
        return {name: _Gather.apply(p, self.rank, self.world_size) for name, p in pooled.items()}


def _trace(cfg: DemoConfig, steps: int, row_bytes: int):
    """The first ``steps`` batches of the run as a trace (the same generator, so the same ids)."""
    from tierstore.trace import Trace, TraceTable

    g = seeded(cfg.seed)
    data = ClickData(cfg, g)
    calls = []
    for step in range(steps):  # a loop per step and table
        _, sparse, _ = data.batch(g)
        calls += [(step, name, ids.numpy()) for name, (ids, _) in sparse.items()]
    return Trace.from_calls(calls, [TraceTable(n, cfg.rows, cfg.dim, row_bytes) for n in cfg.table_names])


def _rank(rank: int, world_size: int, cfg: DemoConfig, plan_json: str) -> dict:
    from tierstore.distributed import ShardedEmbeddingBagCollection
    from tierstore.training.sharding import ShardingPlan

    torch.set_num_threads(cfg.threads)
    p = ShardingPlan.from_json(plan_json)
    tiers = p.predicted[rank]["tiers"]
    module = ShardedEmbeddingBagCollection(_specs(cfg), p, cfg.dir / "store", hbm_rows={t: h for t, (h, _) in tiers.items()},
                                           ddr_rows={t: d for t, (_, d) in tiers.items()}, policy=cfg.policy,
                                           optimizer=_tierstore_opt(cfg.optimizer, cfg.lr), device="cpu")
    try:
        g = seeded(cfg.seed)
        data = ClickData(cfg, g)
        model = DLRM(RankPart(module, rank, world_size), cfg.table_names, cfg.dim, seeded(cfg.seed + 1))
        store, at_end = module.local_store, {}

        def stats() -> dict:  # _train's last call is right after the last step, before the held-out batches
            at_end["counts"] = store_counts(store)
            return store.stats()

        result = _train(replace(cfg, progress=cfg.progress and rank == 0), model, None, data, g, time.perf_counter,
                        f"rank 0 of {world_size}", stats if store is not None else None)
        counts = at_end.get("counts", store_counts(None))
        ids = torch.arange(rank * cfg.rows // world_size, (rank + 1) * cfg.rows // world_size)
        # collective; numpy: torch's tensors would travel as shared memory that ends with this process
        rows = {name: module.read(name, ids, with_state=True).numpy() for name in cfg.table_names}
        ckpt = module.checkpoint(cfg.dir / "checkpoint")
    finally:
        module.close()
    return {"losses": result.losses, "seconds": result.seconds, "eval": (result.eval_loss, result.eval_accuracy),
            "counts": counts, "rows": rows, "checkpoint": str(ckpt)}


def run_sharded_demo(cfg: DemoConfig, seed_generator: Callable[[int], torch.Generator] = seeded,
                     clock: Callable[[], float] = time.perf_counter, out=sys.stdout) -> int:
    """Train sharded over cfg.world_size local processes and in one process; print per-rank
    load against the plan and whether the runs are bit-identical. 0 = identical."""
    from tierstore.capacity.planner import plan

    if seed_generator is not seeded:
        raise SettingError("the sharded demo's ranks seed their own generators; pass no seed_generator")
    _start(cfg)
    n = cfg.world_size
    specs = _specs(cfg)
    opt = _tierstore_opt(cfg.optimizer, cfg.lr)
    row_bytes = replace(specs[0], state_dim=opt.state_dim(cfg.dim)).row_bytes  # every table's: one dim and dtype
    per_rank = cfg.tables * row_bytes // n  # the single process's tiers, split n ways
    trace = _trace(cfg, min(cfg.steps, PLAN_STEPS), row_bytes)
    p = plan(specs, n, trace=trace, hbm_bytes=cfg.hbm_rows * per_rank, ddr_bytes=cfg.ddr_rows * per_rank,
             batch_size=cfg.batch // n, optimizer=opt)
    start = clock()
    ranks = run_ranks(_rank, n, cfg, p.to_json(), timeout_s=3600)
    seconds = clock() - start

    # the same model and batches in this process
    ebc, model, data, g = _one_process(cfg, cfg.dir / "one-process", seed_generator)
    one = _train(cfg, model, None, data, g, clock, "one process", ebc.store.stats)
    ids = torch.arange(cfg.rows)
    one_rows = {name: ebc.store.read(name, ids, with_state=True) for name in cfg.table_names}
    ebc.close()

    same_loss = all(r["losses"] == one.losses for r in ranks)
    differ = [name for name in cfg.table_names
              if not torch.equal(torch.from_numpy(np.concatenate([r["rows"][name] for r in ranks])), one_rows[name])]
    w = min(50, len(one.losses))
    lines = [
        f"tierstore demo --world-size {n}: {cfg.steps} steps of {cfg.batch} examples ({cfg.batch // n} per rank) on {n} local "
        f"processes (gloo, 127.0.0.1) in {seconds:.1f} s with start-up; one process: {one.seconds:.1f} s of training",
        f"  plan       tierstore.capacity.planner.plan on the first {min(cfg.steps, PLAN_STEPS)} batches; per rank HBM "
        f"{cfg.hbm_rows * per_rank:,} B, DDR {cfg.ddr_rows * per_rank:,} B ({row_bytes} B a row with {cfg.optimizer} state): "
        + "; ".join(f"{name} {tp.sharding} on ranks {list(tp.ranks)}" for name, tp in p.tables.items()),
        f"  {'rank':>4} {'lookups/step':>12} {'planned':>8} {'SSD reads/step':>14} {'planned':>8} {'served from':>30}",
    ]
    for r, (got, pred) in enumerate(zip(ranks, p.predicted)):
        c = got["counts"]
        served = [c["hbm_hits"], c["ddr_hits"], c["uses"] - c["hbm_hits"] - c["ddr_hits"]]
        share = " ".join(f"{t} {100 * v / max(c['uses'], 1):.0f}%" for t, v in zip(("hbm", "ddr", "lmdb"), served))
        lines.append(f"  {r:>4} {got['counts']['lookups'] / cfg.steps:>12,.1f} {pred.get('lookups_per_step', 0):>8,.1f} "
                     f"{got['counts']['ssd_reads'] / cfg.steps:>14,.1f} {pred.get('ssd_reads_per_step', 0):>8,.1f} {share:>30}")
    lines += [
        f"  loss       first {w} steps {np.mean(one.losses[:w]):.4f} -> last {w} steps {np.mean(one.losses[-w:]):.4f} "
        f"(one process); held-out {ranks[0]['eval'][0]:.4f} sharded vs {one.eval_loss:.4f}",
        "  check      against one process on the same batches: loss at every step "
        + ("bit-identical on every rank" if same_loss else "DIFFERS")
        + "; trained rows (weights and optimizer state) of every table "
        + ("bit-identical" if not differ else f"DIFFER in {differ}")
        + (" -> AGREE" if same_loss and not differ else " -> DISAGREE"),
        f"  stores     {cfg.dir / 'store'}/rank-<r>; checkpoint {ranks[0]['checkpoint']} "
        f"(ShardedEmbeddingBagCollection.from_checkpoint); one process {cfg.dir / 'one-process'}",
        "  note       lookups are unique rows a step (each rank's store reads them twice: forward and update); "
        "SSD reads count both reads; plans are from the first batches, the measured figures from all",
    ]
    print("\n".join(lines), file=out)
    return 0 if same_loss and not differ else 1
