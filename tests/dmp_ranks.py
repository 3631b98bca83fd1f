"""The rank side of tests/test_dmp.py: models sharded by DistributedModelParallel (tierstore's
sharder and TorchRec's own), the scenarios each rank runs, and their launch in real processes
(spawn, gloo over a file rendezvous). Each rank saves what it saw; the tests compare."""
from __future__ import annotations

import datetime
import functools
import os
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FBGEMM and TorchRec warn about CPU-only builds on import
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from tierstore import optim
from tierstore.spec import TableSpec, initial_rows

WORLD, B, STEPS = 2, 4, 3
LR, EPS = 0.1, 1e-8
KEYS = ["f1", "f2", "f3"]


def configs() -> list[EmbeddingBagConfig]:
    """t1 pools two features (a row read by both takes one step on the summed gradient, as in
    FBGEMM's table-batched kernel); t2 initializes from its init_fn and pools by mean."""
    return [EmbeddingBagConfig(name="t1", num_embeddings=40, embedding_dim=16, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t2", num_embeddings=30, embedding_dim=4, feature_names=["f3"], pooling=PoolingType.MEAN,
                               init_fn=functools.partial(torch.nn.init.normal_, mean=0.0, std=0.3))]


def initial_weights(tables: list[EmbeddingBagConfig] | None = None) -> dict[str, torch.Tensor]:
    """Each table's rows as tierstore initializes them from its config (the oracles start there)."""
    from tierstore.torchrec import row_init

    return {c.name: torch.from_numpy(initial_rows(TableSpec(c.name, c.num_embeddings, c.embedding_dim, init=row_init(c)),
                                                  torch.arange(c.num_embeddings).numpy()))
            for c in tables or configs()}


def batch(step: int, rank: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * B,), generator=g)
    values = torch.randint(0, 12, (int(lengths.sum()),), generator=g) * 2  # few ids: rows recur across features and ranks
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths)


# plans: per table, a TorchRec sharding_plan generator's name and its arguments
PLANS = {
    "table": {"t1": ("table_wise", {"rank": 0}), "t2": ("table_wise", {"rank": 1})},
    "column": {"t1": ("column_wise", {"ranks": [0, 1]}), "t2": ("column_wise", {"ranks": [1, 0]})},
    # two column shards of t1 on each rank (two stores there), t2 whole on rank 1
    "mixed": {"t1": ("column_wise", {"ranks": [0, 0, 1, 1]}), "t2": ("table_wise", {"rank": 1})},
    "row": {"t1": ("row_wise", {}), "t2": ("row_wise", {})},
    "table_row": {"t1": ("table_row_wise", {"host_index": 0}), "t2": ("table_wise", {"rank": 0})},
    # made by TorchRec's planner (tierstore's: sharder.planner), constrained to these sharding types
    "planned": {"t1": ("planner", {"sharding_types": ["table_column_wise"]}), "t2": ("planner", {"sharding_types": ["table_wise"]})},
}
# a checkpoint of "table" on 2 ranks loads onto 1 rank and onto 4, resharded
RESHARDED = {1: {"t1": ("table_wise", {"rank": 0}), "t2": ("table_wise", {"rank": 0})},
             2: {"t1": ("row_wise", {}), "t2": ("table_wise", {"rank": 0})},
             4: {"t1": ("row_wise", {}), "t2": ("table_wise", {"rank": 3})}}
OPTIMIZERS = {"sgd": (lambda: optim.SGD(lr=LR), "EXACT_SGD", {}),
              "rowwise": (lambda: optim.RowWiseAdagrad(lr=LR, eps=EPS), "EXACT_ROWWISE_ADAGRAD", {"eps": EPS})}
TIERS = {"tiny": {"hbm_rows": 2, "ddr_rows": 3}, "roomy": {"hbm_rows": 64, "ddr_rows": 0},
         "ddr": {"hbm_rows": 0, "ddr_rows": 5}}
# the same training under other tier sizes than "tiny" (every row resident; DDR as the top tier)
OTHER_TIERS = [(plan, "rowwise", "roomy") for plan in ("table", "column", "mixed", "row", "table_row")] + \
              [("row", "rowwise", "ddr"), ("row", "sgd", "roomy")]
# prefetches this many batches ahead of the lookup (after the input dist), by plan
PREFETCHED = {"mixed": 1, "row": 2}
CASES = [(plan, opt, kind, "tiny") for plan in PLANS for opt in OPTIMIZERS for kind in ("tierstore", "torchrec")] + \
        [(plan, opt, "tierstore", tiers) for plan, opt, tiers in OTHER_TIERS]


# -- rank side ------------------------------------------------------------------------------
def _model(with_loss: bool = False, collection=None):
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = (collection or EmbeddingBagCollection)(configs(), device=torch.device("meta"))

        def forward(self, kjt):  # the features in one order (a sharded collection's keys follow its sharding types)
            pooled = self.ebc(kjt).to_dict()
            out = torch.cat([pooled[k] for k in KEYS], dim=1)
            return (out.pow(2).sum(), out.detach()) if with_loss else out  # (loss, output): TorchRec's pipelines

    return Model()


def _dmp(path: Path, plan_name: str, opt: str, kind: str, tiers: str, world: int = WORLD, with_loss: bool = False,
         collection=None, plans: dict = PLANS, device: torch.device = torch.device("cpu")):
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    make, fbgemm_opt, extra = OPTIMIZERS[opt]
    if kind == "tierstore":
        from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

        sharder = TieredEmbeddingBagCollectionSharder(path, optimizer=make(), module_type=collection or EmbeddingBagCollection,
                                                      **TIERS[tiers])
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": getattr(EmbOptimType, fbgemm_opt), "learning_rate": LR,
                                                              **extra})
    model = _model(with_loss, collection)
    tables = plans[plan_name] if plan_name in plans else RESHARDED[world]
    if all(fn == "planner" for fn, _ in tables.values()):
        module_plan = _planned(model, path, {t: args for t, (_, args) in tables.items()})
    else:
        per_param = {t: getattr(sp, fn)(**args) for t, (fn, args) in tables.items()}
        module_plan = sp.construct_module_sharding_plan(model.ebc, per_param, sharder=sharder, local_size=world,
                                                        world_size=world, device_type=device.type)
    if kind == "torchrec":  # its fused kernel (FBGEMM's TBE with the optimizer in the backward), not the dense default
        for p in module_plan.values():
            p.compute_kernel = "fused"
    plan = ShardingPlan({"ebc": module_plan})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                   sharders=[sharder], plan=plan)
    return dmp


def _planned(model, path: Path, constraints: dict):
    """tierstore's planner's plan (TorchRec's own planner plans no row-wise shard on the CPU;
    TorchRec's sharder then runs the same plan with its fused kernel)."""
    from torchrec.distributed.planner import ParameterConstraints, Topology

    from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

    sharder = TieredEmbeddingBagCollectionSharder(path, **TIERS["tiny"])
    constraints = {t: ParameterConstraints(**c) for t, c in constraints.items()}
    planner = sharder.planner(Topology(world_size=WORLD, compute_device="cpu"), constraints=constraints)
    return planner.collective_plan(model, [sharder], dist.group.WORLD).plan["ebc"]


def _local_rows(dmp, kind: str, ebc=None) -> dict[str, list]:
    """This rank's shards (of ``ebc``, the model's sharded collection; default ``ebc``):
    [(row offset, col offset, rows)] by table."""
    out: dict[str, list] = {}
    if kind == "tierstore":
        for lookup in (ebc or dmp.module.ebc)._lookups:
            for shard in lookup.shards:
                k = shard.key
                ids = torch.arange(k.row_offset, k.row_offset + shard.rows)
                out.setdefault(k.table, []).append((k.row_offset, k.col_offset, shard.bag.store.peek(k.table, ids)))
                out.setdefault(k.table + ".state", []).append(
                    (k.row_offset, 0, shard.bag.store.peek(k.table, ids, with_state=True)[:, shard.dim:]))
        return out
    for key, st in dmp.state_dict().items():
        table = key.split(".")[-2]
        for sh in st.local_shards() if "embedding_bags" in key else ():
            r, c = sh.metadata.shard_offsets
            out.setdefault(table, []).append((r, c, sh.tensor.detach().clone()))
    return out


def _set_torchrec_rows(dmp, full: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, st in dmp.state_dict().items():
            for sh in st.local_shards() if "embedding_bags" in key else ():
                (r, c), (nr, nc) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                sh.tensor.copy_(full[key.split(".")[-2]][r:r + nr, c:c + nc])


def trained_case(rank: int, out: Path, case: tuple) -> dict:
    """STEPS steps of a case on this launch's ranks: their outputs, rows, optimizer state shapes, sharding types."""
    plan_name, opt, kind, tiers = case
    dmp = _dmp(out / "-".join(case), plan_name, opt, kind, tiers, world=dist.get_world_size())
    if kind == "torchrec":
        _set_torchrec_rows(dmp, initial_weights())
    outs = []
    for step in range(STEPS):
        o = dmp(batch(step, rank))
        o.pow(2).sum().backward()
        dmp.fused_optimizer.step()
        outs.append(o.detach())
    optim_state = dmp.fused_optimizer.state_dict()["state"]
    result = {"outs": outs, "rows": _local_rows(dmp, kind),
              "optim_shapes": {p: {k: tuple(v.shape) for k, v in st.items()} for p, st in optim_state.items()},
              "types": {t: p.sharding_type for t, p in dmp.plan.plan["ebc"].items()}}
    if kind == "tierstore":
        dmp.module.ebc.close()
    return result


def train_cases(rank: int, out: Path) -> dict:
    results = {"path": out, **{case: trained_case(rank, out, case) for case in CASES}}
    results["tierstore-collection"] = tierstore_collection(rank, out)
    results["pipelines"] = pipelines(rank, out)
    results["dcp"] = save_checkpoint(rank, out)
    results["resumed"] = resumed(rank, out)
    results["dlrm"] = {kind: dlrm_trained(rank, out, kind) for kind in ("tierstore", "torchrec")}
    results["load-2"] = load_checkpoint(rank, out / "load-2", out / "dcp")["dcp"]
    return results


def tierstore_collection(rank: int, out: Path) -> list:
    """The outputs of "table" with SGD for a model holding tierstore's TieredEmbeddingBagCollection
    (built on the meta device), sharded with module_type= that class."""
    from tierstore.torchrec import TieredEmbeddingBagCollection

    dmp = _dmp(out / "tierstore-collection", "table", "sgd", "tierstore", "tiny", collection=TieredEmbeddingBagCollection)
    outs = []
    for step in range(STEPS):
        o = dmp(batch(step, rank))
        o.pow(2).sum().backward()
        outs.append(o.detach())
    dmp.module.ebc.close()
    return outs


def pipelines(rank: int, out: Path) -> dict:
    """The outputs of STEPS steps of "mixed" with row-wise Adagrad run by TorchRec's
    TrainPipelineSparseDist (the input dist of the next batch ahead of this one's forward);
    and, per PREFETCHED plan, the outputs and rows of STEPS steps run as a prefetching pipeline
    runs them: each batch's input dist and the shards' prefetch of the ids this rank received
    ``depth`` batches ahead of its lookup and output dist."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    dmp = _dmp(out / "pipeline", "mixed", "rowwise", "tierstore", "tiny", with_loss=True)
    pipe = TrainPipelineSparseDist(dmp, dmp.fused_optimizer, torch.device("cpu"))
    batches = iter([batch(step, rank) for step in range(STEPS)])
    pipelined = [pipe.progress(batches) for _ in range(STEPS)]  # the output the model gives beside its loss
    dmp.module.ebc.close()
    return {"pipelined": pipelined, **{plan: prefetched(rank, out, plan, depth) for plan, depth in PREFETCHED.items()}}


def prefetched(rank: int, out: Path, plan_name: str, depth: int) -> dict:
    dmp = _dmp(out / f"prefetched-{plan_name}", plan_name, "rowwise", "tierstore", "tiny", world=dist.get_world_size())
    ebc = dmp.module.ebc
    ahead = []  # (context, this rank's ids) of the batches dist'ed and prefetched, in order

    def start(step: int) -> None:
        ctx = ebc.create_context()
        dist_input = ebc.input_dist(ctx, batch(step, rank)).wait().wait()
        ebc.prefetch(dist_input, ctx=ctx)
        ahead.append((ctx, dist_input))

    for step in range(depth):
        start(step)
    outs = []
    for step in range(STEPS):
        ctx, dist_input = ahead.pop(0)
        pooled = ebc.compute_and_output_dist(ctx, dist_input).wait().to_dict()
        o = torch.cat([pooled[k] for k in KEYS], dim=1)
        o.pow(2).sum().backward()
        outs.append(o.detach())
        if step + depth < STEPS:
            start(step + depth)
    rows = _local_rows(dmp, "tierstore")
    ebc.close()
    return {"outs": outs, "rows": rows}


def save_checkpoint(rank: int, out: Path) -> dict:
    """A DCP checkpoint of "table" on the ranks, row-wise Adagrad's state with it, after STEPS steps."""
    import torch.distributed.checkpoint as dcp

    dmp = _dmp(out / "dcp-source", "table", "rowwise", "tierstore", "tiny")
    for step in range(STEPS):
        dmp(batch(step, rank)).pow(2).sum().backward()
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=out / "dcp")
    rows, keys = _local_rows(dmp, "tierstore"), sorted(dmp.state_dict())
    dmp.module.ebc.close()
    return {"rows": rows, "keys": keys}


def _restore(dmp, checkpoint: Path) -> None:
    """Load a DCP checkpoint of the model and its fused optimizer into ``dmp``."""
    import torch.distributed.checkpoint as dcp

    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint)
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["optim"])


def resumed(rank: int, out: Path) -> dict:
    """Column-wise shards with row-wise Adagrad (an accumulator per row in each column shard):
    STEPS steps, a DCP checkpoint, 2 steps more; and those 2 steps by a model restored from the
    checkpoint."""
    import torch.distributed.checkpoint as dcp

    def more(dmp) -> dict:
        outs = []
        for step in range(STEPS, STEPS + 2):
            o = dmp(batch(step, rank))
            o.pow(2).sum().backward()
            outs.append(o.detach())
        rows = _local_rows(dmp, "tierstore")
        dmp.module.ebc.close()
        return {"outs": outs, "rows": rows}

    dmp = _dmp(out / "resumed-source", "column", "rowwise", "tierstore", "tiny")
    for step in range(STEPS):
        dmp(batch(step, rank)).pow(2).sum().backward()
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=out / "dcp-column")
    uninterrupted = more(dmp)
    dmp = _dmp(out / "resumed", "column", "rowwise", "tierstore", "tiny")
    _restore(dmp, out / "dcp-column")
    return {"uninterrupted": uninterrupted, "restored": more(dmp)}


# a DLRM whose big table is 10x each rank's DDR tier (row-wise on 2 ranks: 200 rows a rank, DDR 20)
DLRM_TABLES = [EmbeddingBagConfig(name="big", num_embeddings=400, embedding_dim=4, feature_names=["f1"]),
               EmbeddingBagConfig(name="small", num_embeddings=20, embedding_dim=4, feature_names=["f2"])]
DLRM_TIERS = {"hbm_rows": 4, "ddr_rows": 20}
DLRM_PLANS = {1: {"big": ("table_wise", {"rank": 0}), "small": ("table_wise", {"rank": 0})},
              2: {"big": ("row_wise", {}), "small": ("table_wise", {"rank": 1})},
              4: {"big": ("row_wise", {}), "small": ("table_wise", {"rank": 3})}}
DLRM_FQN = "sparse_arch.embedding_bag_collection"


def _dlrm(path: Path, kind: str):
    """torchrec.models.dlrm.DLRM (its tables on the meta device) under DMP on this launch's
    ranks, DLRM_PLANS' plan; the dense layers the same on every rank and in every run."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM

    from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

    world = dist.get_world_size()
    if kind == "tierstore":
        sharder = TieredEmbeddingBagCollectionSharder(path, optimizer=optim.RowWiseAdagrad(lr=LR, eps=EPS), **DLRM_TIERS)
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                              "learning_rate": LR, "eps": EPS})
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(DLRM_TABLES, device=torch.device("meta")),
                 dense_in_features=3, dense_arch_layer_sizes=[6, 4], over_arch_layer_sizes=[5, 1],
                 dense_device=torch.device("cpu"))
    per_param = {t: getattr(sp, fn)(**args) for t, (fn, args) in DLRM_PLANS[world].items()}
    module_plan = sp.construct_module_sharding_plan(model.sparse_arch.embedding_bag_collection, per_param, sharder=sharder,
                                                    local_size=world, world_size=world, device_type="cpu")
    if kind == "torchrec":
        for p in module_plan.values():
            p.compute_kernel = "fused"
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                    sharders=[sharder], plan=ShardingPlan({DLRM_FQN: module_plan}))


def _dlrm_state(dmp, kind: str) -> dict:
    """The DLRM's rows (this rank's shards, with their state) and dense parameters."""
    dense = {k: v.detach().clone() for k, v in dmp.state_dict().items() if "embedding_bags" not in k}
    return {"rows": _local_rows(dmp, kind, dmp.module.sparse_arch.embedding_bag_collection), "dense": dense}


def dlrm_trained(rank: int, out: Path, kind: str) -> dict:
    """STEPS steps of the DLRM (dense layers by SGD, tables by the fused row-wise Adagrad) on
    2 ranks; tierstore's run then saves a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    dmp = _dlrm(out / "dlrm", kind)
    if kind == "torchrec":
        _set_torchrec_rows(dmp, initial_weights(DLRM_TABLES))
    dense_opt = torch.optim.SGD(dmp.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.cat(
            [torch.randint(0, 400, (8 * B,), generator=g), torch.randint(0, 20, (8 * B,), generator=g)]),
            lengths=torch.full((2 * B,), 8))
        logits = dmp(torch.rand(B, 3, generator=g), kjt).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.randint(0, 2, (B,), generator=g).float())
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        losses.append(loss.detach())
    result = {"losses": losses, **_dlrm_state(dmp, kind)}
    if kind == "tierstore":
        dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=out / "dcp-dlrm")
        dmp.module.sparse_arch.embedding_bag_collection.close()
    return result


def dlrm_restored(checkpoint: Path, out: Path) -> dict:
    dmp = _dlrm(out / "dlrm", "tierstore")
    _restore(dmp, checkpoint)
    result = _dlrm_state(dmp, "tierstore")
    dmp.module.sparse_arch.embedding_bag_collection.close()
    return result


def load_checkpoint(rank: int, out: Path, checkpoint: Path | None = None) -> dict:
    """The checkpoint save_checkpoint made (in the folder above ``out``), loaded onto this launch's
    ranks (RESHARDED's plan for their number)."""
    world = dist.get_world_size()
    dmp = _dmp(out / "stores", f"resharded-{world}", "rowwise", "tierstore", "roomy", world=world)
    _restore(dmp, checkpoint or out.parent / "dcp")
    rows = _local_rows(dmp, "tierstore")
    dmp.module.ebc.close()
    if checkpoint is not None:  # within the launch that saved it
        return {"dcp": {"rows": rows}}
    return {"dcp": {"rows": rows}, "dlrm": dlrm_restored(out.parent / "dcp-dlrm", out)}


def killed(rank: int, out: Path) -> dict:
    """Rank 1 dies after a step; rank 0's next step meets it in TorchRec's input dist."""
    dmp = _dmp(out / "stores", "table", "sgd", "tierstore", "tiny")
    dmp(batch(0, rank)).pow(2).sum().backward()
    dist.barrier()
    if rank == 1:
        os._exit(3)
    try:
        dmp(batch(1, rank)).pow(2).sum().backward()
    except Exception as e:
        return {"error": (type(e).__name__, str(e))}
    return {"error": None}


# on 4 ranks (the slow run): row-wise and column-wise shards against TorchRec's and the unsharded
# model, under other tiers, and prefetched 2 batches ahead
CASES_4 = [(plan, opt, kind, "tiny") for plan in ("row", "column") for opt in OPTIMIZERS for kind in ("tierstore", "torchrec")] + \
    [("row", "rowwise", "tierstore", "roomy")]


def train_4(rank: int, out: Path) -> dict:
    return {**{case: trained_case(rank, out, case) for case in CASES_4}, "pipelines": {"row": prefetched(rank, out, "row", 2)}}


SCENARIOS = {"train": train_cases, "train-4": train_4, "load": load_checkpoint, "killed": killed}


def _rank_main(rank: int, world: int, out: str, scenario: str):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{Path(out).resolve() / 'rendezvous'}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = SCENARIOS[scenario](rank, Path(out))
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    torch.save(result, Path(out) / f"result-{rank}.pt")
    dist.destroy_process_group()


def launch(path: Path, scenario: str, world: int = WORLD) -> list:
    path.mkdir(parents=True, exist_ok=True)
    try:
        mp.spawn(_rank_main, args=(world, str(path), scenario), nprocs=world, join=True)
    except Exception:
        errors = "\n".join(p.read_text() for p in sorted(path.glob("error-*.txt")))
        raise AssertionError(f"a rank failed:\n{errors}") from None
    return [torch.load(path / f"result-{r}.pt", weights_only=False) for r in range(world)]
