"""``tierstore bench sharded --dmp``: TorchRec's DistributedModelParallel with tierstore shards
(tierstore.torchrec.TieredEmbeddingBagCollectionSharder) against DMP with TorchRec's own shards
(EmbeddingBagCollectionSharder, FBGEMM's fused CPU kernel, rows in memory), on 2, 4 and 8 local
ranks, the same plan (every table row-wise) and the same batches, measured in the same run: each
rank holds both models and steps them in turn, so both see the same load of the machine.

Per world size and sharder: the median step (input dist, lookup, output dist, backward with the
fused row-wise Adagrad) of the slowest rank, and the bytes of ids and lengths each rank receives
from TorchRec's input dist per step (its KeyedJaggedTensors after the all-to-all, its own part
included): with the global batch fixed, a rank receives the ids of its rows, about
batch x pooling x tables / ranks. tierstore's shards are DDR-resident (ddr_rows = the table's
rows, every row read into the tier before the timed steps, as TorchRec's are in memory) and run
FBGEMM's fused backward (kernels="fbgemm"), as TorchRec's: what is compared is the sharder's
lookup, not the disk.
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch

from tierstore.tools.bench_sharded import WARMUP, ShardedBenchConfig, local_batches, make_trace, run_ranks

WORLD_SIZES = (2, 4, 8)
KINDS = ("tierstore", "torchrec")


ROUNDS = 6  # passes over the trace's batches: the timed steps of both sharders, alternating


def _sharded(kind: str, rank: int, world_size: int, cfg: ShardedBenchConfig, workdir: str):
    """DMP's sharded EmbeddingBagCollection of ``kind`` (every table row-wise), its rows ready:
    tierstore's shards read once whole into their DDR tiers, as TorchRec's are in memory."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    import tierstore
    from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

    names = [t for t, _, _ in cfg.tables]
    configs = [EmbeddingBagConfig(name=t, num_embeddings=rows, embedding_dim=cfg.dim, feature_names=[t])
               for t, rows, _ in cfg.tables]
    if kind == "tierstore":
        # FBGEMM's fused backward, as TorchRec's shards run it
        sharder = TieredEmbeddingBagCollectionSharder(workdir, hbm_rows=0, ddr_rows={t: rows for t, rows, _ in cfg.tables},
                                                      optimizer=tierstore.optim.RowWiseAdagrad(lr=cfg.lr), kernels="fbgemm")
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                              "learning_rate": cfg.lr})
    ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
    plan = construct_module_sharding_plan(ebc, {t: row_wise(compute_kernel="fused") for t in names}, sharder=sharder,
                                          local_size=world_size, world_size=world_size, device_type="cpu")
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   sharders=[sharder], plan=ShardingPlan({"": plan}))
    sharded = dmp.module
    if kind == "tierstore":
        for lookup in sharded._lookups:
            for shard in lookup.shards:
                end = shard.row_offset + shard.rows
                for lo in range(shard.row_offset, end, 1 << 16):
                    shard.bag.store.read(shard.key.table, torch.arange(lo, min(lo + (1 << 16), end)))
    return sharded


def _dmp_rank(rank: int, world_size: int, cfg: ShardedBenchConfig, trace, workdir: str) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # FBGEMM and TorchRec warn about CPU-only builds
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor

    names = [t for t, _, _ in cfg.tables]
    modules = {kind: _sharded(kind, rank, world_size, cfg, workdir) for kind in KINDS}
    w = torch.randn(len(names) * cfg.dim, generator=torch.Generator().manual_seed(cfg.seed + 1))
    steps = {kind: [] for kind in KINDS}
    received = {kind: 0 for kind in KINDS}
    batches = [KeyedJaggedTensor.from_offsets_sync(
        keys=names, values=torch.cat([feats[t][0] for t in names]),
        offsets=torch.arange(0, len(names) * (cfg.batch // world_size) + 1) * cfg.pooling)
        for feats in local_batches(trace, cfg, rank, world_size)]
    for i in range(ROUNDS * len(batches)):  # a loop per step: each batch through both sharders, in turn
        kinds = KINDS if i % 2 else KINDS[::-1]
        for kind in kinds:
            sharded = modules[kind]
            dist.barrier()
            start = time.perf_counter()
            ctx = sharded.create_context()
            dist_input = sharded.input_dist(ctx, batches[i % len(batches)]).wait().wait()
            pooled = sharded.compute_and_output_dist(ctx, dist_input).wait()
            (pooled.values() @ w).sum().backward()
            if i >= WARMUP:
                steps[kind].append(time.perf_counter() - start)
                received[kind] += sum(f.values().numel() * f.values().element_size()
                                      + f.lengths().numel() * f.lengths().element_size() for f in dist_input)
    modules["tierstore"].close()
    return {kind: {"steps_s": steps[kind], "ids_bytes": received[kind] / len(steps[kind])} for kind in KINDS}


def measure(cfg: ShardedBenchConfig, workdir: str, world_sizes=WORLD_SIZES) -> dict:
    """Per world size and sharder: each rank's median step and id bytes received per step."""
    trace = make_trace(cfg)
    out = {}
    for w in world_sizes:  # a loop per world size
        with tempfile.TemporaryDirectory(dir=workdir) as d:
            ranks = run_ranks(_dmp_rank, w, cfg, trace, d)
        for kind in KINDS:
            out[w, kind] = [r[kind] for r in ranks]
    return out


def format_report(cfg: ShardedBenchConfig, m: dict) -> str:
    lines = [f"\n== bench sharded --dmp: DistributedModelParallel on gloo (127.0.0.1), 1 thread per rank",
             f"   tables {', '.join(f'{t}:{r:,}' for t, r, _ in cfg.tables)} x dim {cfg.dim}, every one row-wise; global batch "
             f"{cfg.batch} x pooling {cfg.pooling} per table; row-wise Adagrad; each sharder's steps alternate with the "
             f"other's, {ROUNDS} passes over {cfg.steps + WARMUP} batches, the first {WARMUP} steps untimed",
             f"   {'ranks':>5} {'tierstore ms':>12} {'TorchRec ms':>11} {'ratio':>6}   ids B received per rank per step "
             "(tierstore / TorchRec)"]
    for w in sorted({w for w, _ in m}):
        ours, theirs = m[w, "tierstore"], m[w, "torchrec"]
        # a step lasts as long as its slowest rank (the ranks meet in its collectives)
        a, b = ([max(r["steps_s"][i] for r in ranks) for i in range(len(ranks[0]["steps_s"]))] for ranks in (ours, theirs))
        ratio = statistics.median(x / y for x, y in zip(a, b))
        got = " ".join(f"{x['ids_bytes']:,.0f}/{y['ids_bytes']:,.0f}" for x, y in zip(ours, theirs))
        lines.append(f"   {w:>5} {1e3 * statistics.median(a):>12.1f} {1e3 * statistics.median(b):>11.1f} {ratio:>5.2f}x   {got}")
    lines += ["",
              "   Steps: the median of the slowest rank's; ratio: the median of each step's against the other sharder's step",
              "   of the same batch, taken next to it (load from elsewhere on the machine hits both alike). The ranks share",
              "   this machine's cores and talk over loopback: step times are CPU contention plus gloo's per-message cost;",
              "   their ratio compares the two sharders' lookups on the same dists. The id bytes are exact."]
    return "\n".join(lines)
