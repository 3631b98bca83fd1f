"""TorchRec's DistributedModelParallel over tierstore shards, against TorchRec's own sharder
and the unsharded model: real rank processes (spawn), gloo over a file rendezvous, real LMDB
under tiny tiers. One launch of 2 ranks trains every case (the process group and TorchRec's
import are paid once); each rank saves what it saw and the tests compare."""
from __future__ import annotations

import datetime
import functools
import os
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FBGEMM and TorchRec warn about CPU-only builds on import
    torchrec = pytest.importorskip("torchrec", reason="TorchRec (optional peer) is not installed: see the README's TorchRec section")
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
         collection=None):
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
    tables = PLANS[plan_name] if plan_name in PLANS else RESHARDED[world]
    if all(fn == "planner" for fn, _ in tables.values()):
        module_plan = _planned(model, path, {t: args for t, (_, args) in tables.items()})
    else:
        per_param = {t: getattr(sp, fn)(**args) for t, (fn, args) in tables.items()}
        module_plan = sp.construct_module_sharding_plan(model.ebc, per_param, sharder=sharder, local_size=world,
                                                        world_size=world, device_type="cpu")
    if kind == "torchrec":  # its fused kernel (FBGEMM's TBE with the optimizer in the backward), not the dense default
        for p in module_plan.values():
            p.compute_kernel = "fused"
    plan = ShardingPlan({"ebc": module_plan})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
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


@pytest.fixture(scope="module")
def trained_at(tmp_path_factory):
    return tmp_path_factory.mktemp("dmp-train")


@pytest.fixture(scope="module")
def trained(trained_at):
    return launch(trained_at, "train")


# -- the oracles ----------------------------------------------------------------------------
def assembled(results: list, case, tables: list[EmbeddingBagConfig] | None = None) -> dict[str, torch.Tensor]:
    """Each table's rows (and "<table>.state": its optimizer state), assembled from every rank's shards."""
    full = {}
    for res in results:
        for table, shards in res[case]["rows"].items():
            for r, c, rows in shards:
                config = next(t for t in tables or configs() if table.split(".")[0] == t.name)
                width = config.embedding_dim if table == config.name else rows.shape[1]
                part = full.setdefault(table, torch.full((config.num_embeddings, width), float("nan")))
                part[r:r + rows.shape[0], c:c + rows.shape[1]] = rows
    return full


def column_blocks(results: list, case) -> dict[str, list[tuple[int, int]]]:
    """Each table's column ranges, one per column shard the plan made."""
    return {table: sorted({(c, c + rows.shape[1]) for res in results for r, c, rows in res[case]["rows"].get(table, [])})
            for table in (c.name for c in configs())}


def unsharded(blocks: dict, opt: str, world: int = WORLD) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """The model on one process, its loss the mean of the ranks' (TorchRec divides the
    embeddings' gradients by the world size), updated by the optimizer's formula on the dense
    gradient (row-wise Adagrad: one accumulator per row of each column shard, ``blocks``, as TorchRec's)."""
    ebc = EmbeddingBagCollection(configs())
    weights = initial_weights()
    with torch.no_grad():
        for name, w in weights.items():
            ebc.embedding_bags[name].weight.copy_(w)
    state = {name: torch.zeros(w.shape[0], len(blocks[name])) for name, w in weights.items()}
    outs = [[] for _ in range(world)]
    for step in range(STEPS):
        ebc.zero_grad()
        total = 0
        for r in range(world):
            o = ebc(batch(step, r)).values()  # keys in KEYS' order
            outs[r].append(o.detach())
            total = total + o.pow(2).sum() / world
        total.backward()
        with torch.no_grad():
            for name in weights:
                w = ebc.embedding_bags[name].weight
                g = w.grad
                if opt == "sgd":
                    w.sub_(LR * g)
                    continue
                for k, (c0, c1) in enumerate(blocks[name]):
                    gb = g[:, c0:c1]
                    state[name][:, k] += gb.pow(2).mean(dim=1)
                    w[:, c0:c1] -= LR * gb / (state[name][:, k:k + 1].sqrt() + EPS)
    return outs, {name: ebc.embedding_bags[name].weight.detach() for name in weights}


@pytest.fixture(scope="module")
def trained_4(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("dmp-train-4"), "train-4", world=4)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_dmp_trains_as_torchrecs_sharder_and_the_unsharded_model(trained, plan_name, opt):
    check_trains_as_torchrec_and_unsharded(trained, plan_name, opt)


@pytest.mark.slow  # 4 processes: a minute on 2 cores
@pytest.mark.parametrize("plan_name", ["row", "column"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_dmp_on_4_ranks_trains_as_torchrecs_sharder_and_the_unsharded_model(trained_4, plan_name, opt):
    check_trains_as_torchrec_and_unsharded(trained_4, plan_name, opt)


@pytest.mark.slow
def test_dmp_on_4_ranks_tier_sizes_and_prefetch_change_no_bit(trained_4):
    check_same_bits(trained_4, ("row", "rowwise", "tierstore", "tiny"), ("row", "rowwise", "tierstore", "roomy"))
    check_same_bits(trained_4, ("row", "rowwise", "tierstore", "tiny"), ("pipelines", "row"))


def check_trains_as_torchrec_and_unsharded(trained: list, plan_name: str, opt: str) -> None:
    ours, theirs = (plan_name, opt, "tierstore", "tiny"), (plan_name, opt, "torchrec", "tiny")
    assert column_blocks(trained, ours) == column_blocks(trained, theirs)
    outs, rows = unsharded(column_blocks(trained, theirs), opt, len(trained))
    for r, res in enumerate(trained):
        for step in range(STEPS):
            torch.testing.assert_close(res[ours]["outs"][step], outs[r][step], rtol=0, atol=1e-5)
            torch.testing.assert_close(res[ours]["outs"][step], res[theirs]["outs"][step], rtol=0, atol=1e-5)
    got, want = assembled(trained, ours), assembled(trained, theirs)
    for name in rows:
        assert not got[name].isnan().any()
        torch.testing.assert_close(got[name], rows[name], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_the_fused_optimizers_state_has_torchrecs_keys_and_shapes(trained, plan_name):
    """Row-wise Adagrad's momentum1 of a column-sharded table holds each column shard's
    accumulators, [rows x column shards], as TorchRec's."""
    ours, theirs = (plan_name, "rowwise", "tierstore", "tiny"), (plan_name, "rowwise", "torchrec", "tiny")
    for res in trained:  # TorchRec's names a rank's own tables; tierstore's every table (no rows where none)
        got, want = res[ours]["optim_shapes"], res[theirs]["optim_shapes"]
        assert want and {p: got[p] for p in want} == want
    assert trained[0][("column", "rowwise", "torchrec", "tiny")]["optim_shapes"]["ebc.embedding_bags.t1.weight"] == \
        {"t1.momentum1": (80,)}


def test_every_sharding_type_on_the_cpu_was_run(trained):
    types = {t for res in trained for case in CASES for t in res[case]["types"].values()}
    assert types == {"table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"}


def test_the_planner_counts_a_shards_tiers_not_its_table(tmp_path):
    """A table 10x a rank's memory is planned onto ranks whose memory holds its tiers; TorchRec's
    own planner finds no plan for it. A memory_budget per rank plans it too."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import PlannerError

    from tierstore.torchrec import TieredEmbeddingBagCollectionSharder

    tables = [EmbeddingBagConfig(name="big", num_embeddings=10_000_000, embedding_dim=64, feature_names=["f1"]),
              EmbeddingBagConfig(name="small", num_embeddings=100, embedding_dim=8, feature_names=["f2"])]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=256 << 20)  # the table: 2.56 GB
    with pytest.raises(PlannerError, match="insufficient storage"):
        EmbeddingShardingPlanner(topology=topology).plan(ebc, [EmbeddingBagCollectionSharder()])
    for tiers in ({"ddr_rows": 100_000}, {"memory_budget": "64MiB"}):
        sharder = TieredEmbeddingBagCollectionSharder(tmp_path, optimizer=optim.RowWiseAdagrad(0.1), **tiers)
        plan = sharder.planner(topology).plan(ebc, [sharder]).plan[""]
        assert {p.compute_kernel for p in plan.values()} == {"customized_kernel"}
        assert set(plan) == {"big", "small"}
    for tiers in ({"ddr_rows": 10_000_000}, {"memory_budget": "300MiB"}):  # the whole table in DDR; a budget over a rank's
        sharder = TieredEmbeddingBagCollectionSharder(tmp_path, optimizer=optim.RowWiseAdagrad(0.1), **tiers)
        with pytest.raises(PlannerError, match="Unable to find a plan"):
            sharder.planner(topology).plan(ebc, [sharder])


def check_same_bits(trained: list, case, other) -> None:
    """The outputs and trained rows of ``other`` are ``case``'s, bit for bit (each a case, or
    ("pipelines", plan) for a prefetched run)."""
    def at(res: dict, key) -> dict:
        return res["pipelines"][key[1]] if key[0] == "pipelines" else res[key]

    results = [{"a": at(res, case), "b": at(res, other)} for res in trained]
    for res in results:
        assert all(torch.equal(x, y) for x, y in zip(res["a"]["outs"], res["b"]["outs"], strict=True))
    a, b = assembled(results, "a"), assembled(results, "b")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("plan_name,opt,tiers", OTHER_TIERS)
def test_tier_sizes_change_no_bit(trained, plan_name, opt, tiers):
    check_same_bits(trained, (plan_name, opt, "tierstore", "tiny"), (plan_name, opt, "tierstore", tiers))


def test_torchrecs_pipeline_changes_no_bit(trained):
    for res in trained:
        plain = res[("mixed", "rowwise", "tierstore", "tiny")]["outs"]
        assert all(torch.equal(a, b) for a, b in zip(plain, res["pipelines"]["pipelined"], strict=True))


@pytest.mark.parametrize("plan_name", list(PREFETCHED))
def test_prefetching_batches_ahead_after_the_input_dist_changes_no_bit(trained, plan_name):
    """Rows prefetched PREFETCHED[plan] batches ahead of their lookup, so some are read before the
    previous step's update, train to the same bits as without prefetch."""
    check_same_bits(trained, (plan_name, "rowwise", "tierstore", "tiny"), ("pipelines", plan_name))


def test_a_model_holding_tierstores_collection_shards_as_torchrecs(trained):
    for res in trained:
        plain = res[("table", "sgd", "tierstore", "tiny")]["outs"]
        assert all(torch.equal(a, b) for a, b in zip(plain, res["tierstore-collection"]))


def test_two_shards_of_a_table_on_a_rank_live_in_two_stores(trained):
    case = ("mixed", "sgd", "tierstore", "tiny")
    assert len(column_blocks(trained, case)["t1"]) == 4
    assert sorted(p.name for p in (trained[0]["path"] / "-".join(case)).iterdir()) == ["rank-0", "rank-0.1", "rank-1", "rank-1.1"]


def test_init_fn_gives_the_rows_their_first_values(trained):
    """t2's init_fn (normal, std 0.3) and t1's default (uniform +-1/sqrt(40)) are what the
    first forward pools: the unsharded model from those rows gives the same outputs."""
    w = initial_weights()
    assert w["t1"].abs().max() <= 40 ** -0.5 and w["t2"].std() > 0.2
    outs, _ = unsharded(column_blocks(trained, ("table", "sgd", "torchrec", "tiny")), "sgd")
    for r, res in enumerate(trained):
        torch.testing.assert_close(res[("table", "sgd", "tierstore", "tiny")]["outs"][0], outs[r][0], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def loaded(trained, trained_at):
    """The checkpoints of the 2-rank launch restored by a launch of ``world`` ranks (each once)."""
    runs = {}

    def at(world: int) -> list:
        if world not in runs:
            runs[world] = launch(trained_at / f"load-{world}", "load", world=world)
        return runs[world]

    return at


@pytest.mark.parametrize("world", [2, 1, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: 45 s on 2 cores
def test_a_dcp_checkpoint_of_2_ranks_loads_onto_another_plan_and_world_size(trained, loaded, world):
    """DCP saves each rank's shards in chunks under TorchRec's names (t1 on rank 0, t2 on rank 1);
    loaded onto 2 ranks (t1 split by rows, t2 on rank 0), 1 rank (every table there) and 4 (t1
    split by rows, t2 on rank 3), the rows and row-wise Adagrad's state are the saved ones, bit
    for bit."""
    assert "ebc.embedding_bags.t1.weight" in trained[0]["dcp"]["keys"]
    saved = assembled(trained, "dcp")
    results = [{"dcp": res["load-2"]} for res in trained] if world == 2 else loaded(world)
    loaded = assembled(results, "dcp")
    assert sorted(saved) == sorted(loaded) == ["t1", "t1.state", "t2", "t2.state"]
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: 45 s on 2 cores
def test_a_dlrm_with_a_table_10x_its_ranks_ddr_tier_trains_checkpoints_and_restores_bit_for_bit(trained, loaded, world):
    """torchrec's DLRM, its big table row-wise on 2 ranks (200 rows a rank under DDR tiers of 20
    and HBM tiers of 4, the rest in LMDB), trains as with TorchRec's own sharder (same rows and
    dense layers at the start); its DCP checkpoint restores onto 1 rank (every table there) and
    4 (big row-wise, small on rank 3): rows, row-wise Adagrad's state and the dense layers bit
    for bit."""
    ours, theirs = ([res["dlrm"][kind] for res in trained] for kind in ("tierstore", "torchrec"))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.stack(a["losses"]), torch.stack(b["losses"]), rtol=0, atol=1e-5)
        assert sorted(a["dense"]) == sorted(b["dense"]) and a["dense"]
        for key in a["dense"]:
            torch.testing.assert_close(a["dense"][key], b["dense"][key], rtol=0, atol=1e-5)
    saved = assembled([{"x": r} for r in ours], "x", DLRM_TABLES)
    want = assembled([{"x": r} for r in theirs], "x", DLRM_TABLES)
    for table in ("big", "small"):
        torch.testing.assert_close(saved[table], want[table], rtol=0, atol=1e-5)
    trained_rows = (saved["big"] != initial_weights(DLRM_TABLES)["big"]).any(1)
    assert int(trained_rows[:200].sum()) > 24 and int(trained_rows[200:].sum()) > 24  # more than a rank's tiers hold
    restored = [res["dlrm"] for res in loaded(world)]
    got = assembled([{"x": r} for r in restored], "x", DLRM_TABLES)
    assert sorted(got) == sorted(saved) == ["big", "big.state", "small", "small.state"]
    for name in saved:
        assert torch.equal(got[name], saved[name]), name
    for res in restored:
        assert sorted(res["dense"]) == sorted(ours[0]["dense"])
        assert all(torch.equal(res["dense"][k], ours[0]["dense"][k]) for k in res["dense"])


def test_column_shards_resume_from_a_dcp_checkpoint_as_if_uninterrupted(trained):
    """Each column shard's row-wise Adagrad accumulators are saved (TorchRec's momentum1 holds one
    per row of each column shard): the restored model's next steps are the uninterrupted ones."""
    for res in trained:
        a, b = res["resumed"]["uninterrupted"], res["resumed"]["restored"]
        assert all(torch.equal(x, y) for x, y in zip(a["outs"], b["outs"]))
        assert sorted(a["rows"]) == sorted(b["rows"]) and "t1.state" in a["rows"]
        for table in a["rows"]:
            for (r, c, x), (r2, c2, y) in zip(a["rows"][table], b["rows"][table], strict=True):
                assert (r, c) == (r2, c2) and torch.equal(x, y), (table, r, c)


def test_a_rank_killed_between_steps_ends_the_other_with_rank_failed_error(tmp_path):
    spawn = mp.get_context("spawn")
    ranks = [spawn.Process(target=_rank_main, args=(r, WORLD, str(tmp_path), "killed")) for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 3]
    error = torch.load(tmp_path / "result-0.pt", weights_only=False)["error"]
    assert error is not None and error[0] == "RankFailedError", error
    assert "rank 0: TorchRec's dists with the other ranks failed" in error[1] and "a rank died" in error[1]
