"""``tierstore bench sharded --dmp``: TorchRec's DistributedModelParallel with tierstore shards
(tierstore.torchrec.TieredEmbeddingBagCollectionSharder) against DMP with TorchRec's own shards
(EmbeddingBagCollectionSharder, FBGEMM's fused CPU kernel, rows in memory), on 2, 4 and 8 local
ranks, the same plan (every table row-wise) and the same batches, measured in the same run.

Per world size and sharder: the median step (input dist, lookup, output dist, backward with the
fused row-wise Adagrad) of the slowest rank, and the bytes of ids and lengths each rank receives
from TorchRec's input dist per step (its KeyedJaggedTensors after the all-to-all, its own part
included): with the global batch fixed, a rank receives the ids of its rows, about
batch x pooling x tables / ranks. tierstore's tiers hold every row (ddr_rows = the table's rows):
what is compared is the sharder, not the disk.
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch

from tierstore.tools.bench_sharded import WARMUP, ShardedBenchConfig, local_batches, make_trace, run_ranks

WORLD_SIZES = (2, 4, 8)
KINDS = ("tierstore", "torchrec")


def _dmp_rank(rank: int, world_size: int, cfg: ShardedBenchConfig, trace, kind: str, workdir: str) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # FBGEMM and TorchRec warn about CPU-only builds
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
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
        sharder = TieredEmbeddingBagCollectionSharder(workdir, hbm_rows=0, ddr_rows={t: rows for t, rows, _ in cfg.tables},
                                                      optimizer=tierstore.optim.RowWiseAdagrad(lr=cfg.lr))
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                              "learning_rate": cfg.lr})
    ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
    plan = construct_module_sharding_plan(ebc, {t: row_wise(compute_kernel="fused") for t in names}, sharder=sharder,
                                          local_size=world_size, world_size=world_size, device_type="cpu")
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                   sharders=[sharder], plan=ShardingPlan({"": plan}))
    sharded = dmp.module
    w = torch.randn(len(names) * cfg.dim, generator=torch.Generator().manual_seed(cfg.seed + 1))
    steps, received = [], 0
    for i, feats in enumerate(local_batches(trace, cfg, rank, world_size)):
        kjt = KeyedJaggedTensor.from_offsets_sync(
            keys=names, values=torch.cat([feats[t][0] for t in names]),
            offsets=torch.arange(0, len(names) * (cfg.batch // world_size) + 1) * cfg.pooling)
        dist.barrier()
        start = time.perf_counter()
        ctx = sharded.create_context()
        dist_input = sharded.input_dist(ctx, kjt).wait().wait()
        pooled = sharded.compute_and_output_dist(ctx, dist_input).wait()
        (pooled.values() @ w).sum().backward()
        if i >= WARMUP:
            steps.append(time.perf_counter() - start)
            received += sum(f.values().numel() * f.values().element_size() + f.lengths().numel() * f.lengths().element_size()
                            for f in dist_input)
    if kind == "tierstore":
        sharded.close()
    return {"step_s": statistics.median(steps), "ids_bytes": received / len(steps)}


def measure(cfg: ShardedBenchConfig, workdir: str, world_sizes=WORLD_SIZES) -> dict:
    """Per world size and sharder: each rank's median step and id bytes received per step."""
    trace = make_trace(cfg)
    out = {}
    for w in world_sizes:  # a loop per world size and sharder
        for kind in KINDS:
            with tempfile.TemporaryDirectory(dir=workdir) as d:
                out[w, kind] = run_ranks(_dmp_rank, w, cfg, trace, kind, d)
    return out


def format_report(cfg: ShardedBenchConfig, m: dict) -> str:
    lines = [f"\n== bench sharded --dmp: DistributedModelParallel on gloo (127.0.0.1), 1 thread per rank",
             f"   tables {', '.join(f'{t}:{r:,}' for t, r, _ in cfg.tables)} x dim {cfg.dim}, every one row-wise; global batch "
             f"{cfg.batch} x pooling {cfg.pooling} per table; row-wise Adagrad; {cfg.steps} timed steps after {WARMUP}",
             f"   {'ranks':>5} {'tierstore ms':>12} {'TorchRec ms':>11} {'ratio':>6}   ids B received per rank per step "
             "(tierstore / TorchRec)"]
    for w in sorted({w for w, _ in m}):
        ours, theirs = m[w, "tierstore"], m[w, "torchrec"]
        a, b = max(r["step_s"] for r in ours), max(r["step_s"] for r in theirs)
        got = " ".join(f"{x['ids_bytes']:,.0f}/{y['ids_bytes']:,.0f}" for x, y in zip(ours, theirs))
        lines.append(f"   {w:>5} {1e3 * a:>12.1f} {1e3 * b:>11.1f} {a / b:>5.2f}x   {got}")
    lines += ["",
              "   The ranks share this machine's cores and talk over loopback: step times are CPU contention plus gloo's",
              "   per-message cost; their ratio compares the two sharders' lookups on the same dists. The id bytes are exact."]
    return "\n".join(lines)
