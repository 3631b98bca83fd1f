"""Damaged and refused checkpoints of sharded collections, and optimizer state loaded into
another optimizer: real gloo ranks (spawn), real LMDB, real DCP files. One launch of 2 ranks
writes a checkpoint, damages copies of it the ways an edit or a careless copy does, and
restores each; the test process checks what every rank saw."""
from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import test_distributed
from test_distributed import CHECK_IDS, TABLES, TIERS, launch, make_plan, raised, read_all
from tierstore import StoreCorruptError, TieredEmbeddingBag, optim
from tierstore.training.checkpointing import OptimizerMismatchError
from tierstore.training.sharding import Shard, ShardingPlan, TablePlan

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _kw() -> dict:
    """The test's tiers, and a registry of the module's own (a restore that fails leaves none behind in the default one)."""
    from prometheus_client import CollectorRegistry

    return dict(TIERS, registry=CollectorRegistry())


def _values(spec, optimizer, n: int, seed: int) -> torch.Tensor:
    """Rows of a whole table's layout (weights, then state), none its initial value."""
    width = spec.dim + optimizer.state_dim(spec.dim)
    return torch.rand(n, width, generator=torch.Generator().manual_seed(seed)) + 0.5


def _moved(plan: ShardingPlan, table: str, shards: tuple[Shard, ...], world: int | None = None) -> ShardingPlan:
    tp = plan.tables[table]
    sharding = "table" if len(shards) == 1 and shards[0].row_start is None and tp.sharding == "table" else tp.sharding
    return ShardingPlan(world or plan.world_size, {**plan.tables, table: TablePlan(table, sharding, shards)})


def _edit_tables(ckpt: Path, table: str, **fields) -> None:
    specs = json.loads((ckpt / "tables.json").read_text())
    for s in specs:
        if s["name"] == table:
            s.update(fields)
    (ckpt / "tables.json").write_text(json.dumps(specs))


def _swap(ckpt: Path) -> None:
    (ckpt / "rank-0").rename(ckpt / "swap")
    (ckpt / "rank-1").rename(ckpt / "rank-0")
    (ckpt / "swap").rename(ckpt / "rank-1")


def _damages() -> dict:
    """Each way to damage a checkpoint of make_plan(2): a function of its directory."""
    plan = make_plan(2)
    user = plan.tables["user"].shards
    one_rank = ShardingPlan(1, {t.name: TablePlan(t.name, "table", (Shard(0, None, None, 0, t.dim),)) for t in TABLES})
    return {
        # a row boundary moved from 20 to 24: rows 20-23 are on rank 1, the plan says rank 0
        "row boundary": lambda d: (d / "plan.json").write_text(_moved(plan, "user", (
            dataclasses.replace(user[0], row_stop=24), dataclasses.replace(user[1], row_start=24))).to_json()),
        "table moved": lambda d: (d / "plan.json").write_text(_moved(plan, "item", (Shard(0, None, None, 0, 4),)).to_json()),
        "column boundary": lambda d: (d / "plan.json").write_text(_moved(plan, "wide", (
            Shard(0, None, None, 0, 2), Shard(1, None, None, 2, 6))).to_json()),
        "fewer ranks": lambda d: (d / "plan.json").write_text(one_rank.to_json()),
        "num_rows": lambda d: _edit_tables(d, "item", num_rows=35),
        "dim": lambda d: _edit_tables(d, "item", dim=5),
        "num_rows against the plan": lambda d: _edit_tables(d, "user", num_rows=50),
        "dim of a column table": lambda d: _edit_tables(d, "wide", dim=7),
        "table renamed": lambda d: _edit_tables(d, "item", name="items"),
        "swapped ranks": _swap,
        "missing rank": lambda d: shutil.rmtree(d / "rank-1"),
    }


def scenario_faults(rank, world, out):
    import torch.distributed as dist

    from tierstore.distributed import ShardedEmbeddingBagCollection

    res = {}
    adam = lambda: optim.Adam(lr=0.05)  # noqa: E731
    module = ShardedEmbeddingBagCollection(TABLES, make_plan(world), out / "store", optimizer=adam(), **_kw())
    for i, spec in enumerate(TABLES):  # every checked row stored, each on the rank the plan gives it
        ids = CHECK_IDS[spec.name] if rank == 0 else CHECK_IDS[spec.name][:0]
        module.write(spec.name, ids, _values(spec, adam(), len(ids), i), with_state=True)
    res["rows"] = read_all(module, rank)
    module.checkpoint(out / "ckpt")
    module.checkpoint(out / "pristine")  # copied and damaged below
    module.close()

    # a checkpoint of another plan onto this one is refused, and changes nothing
    ckpt = out / "ckpt"
    files = {name: (ckpt / name).read_bytes() for name in ("plan.json", "tables.json")}
    other = ShardedEmbeddingBagCollection(TABLES, _moved(make_plan(world), "item", (Shard(0, None, None, 0, 4),)), out / "other",
                                          optimizer=adam(), **_kw())
    res["overwrite"] = raised(lambda: other.checkpoint(ckpt))
    other.close()
    res["files kept"] = all((ckpt / name).read_bytes() == data for name, data in files.items())
    try:
        restored = ShardedEmbeddingBagCollection.from_checkpoint(ckpt, plan=make_plan(world), path=out / "restored",
                                                                 optimizer=adam(), **_kw())
    except Exception as e:
        res["restored"] = f"{type(e).__name__}: {e}"
    else:
        res["restored"] = read_all(restored, rank)
        restored.close()

    # damaged copies: each rank restores each, and says what it got
    res["damaged"] = {}
    for i, (name, damage) in enumerate(_damages().items()):
        copy = out / f"damaged-{i}"
        if rank == 0:
            shutil.copytree(out / "pristine", copy)
            damage(copy)
        dist.barrier()
        target = out / f"from-damaged-{i}"
        got = {"error": None, "created": False}
        try:
            m = ShardedEmbeddingBagCollection.from_checkpoint(copy, plan=make_plan(world), path=target, optimizer=adam(), **_kw())
        except Exception as e:
            got["error"] = (type(e).__name__, str(e))
        else:
            got["rows"] = read_all(m, rank)
            m.close()
        dist.barrier()
        got["created"] = target.exists()
        res["damaged"][name] = got

    # an Adam DCP checkpoint does not load into an Adagrad collection of the same tables
    bounded = [t for t in TABLES if t.num_rows is not None]
    plan = ShardingPlan(world, {t.name: make_plan(world).tables[t.name] for t in bounded})
    saved = ShardedEmbeddingBagCollection(bounded, plan, out / "adam", optimizer=adam(), **_kw())
    for i, spec in enumerate(bounded):
        ids = CHECK_IDS[spec.name] if rank == 0 else CHECK_IDS[spec.name][:0]
        saved.write(spec.name, ids, _values(spec, adam(), len(ids), 10 + i) - 1.0, with_state=True)  # negative moments
    dcp.save({"model": saved.state_dict(), "optim": saved.fused_optimizer.state_dict()}, checkpoint_id=out / "dcp-adam")
    saved.close()
    adagrad = ShardedEmbeddingBagCollection(bounded, plan, out / "adagrad", optimizer=optim.Adagrad(lr=0.1), **_kw())
    rows = lambda: {t.name: adagrad.read(t.name, CHECK_IDS[t.name] if rank == 0 else CHECK_IDS[t.name][:0], with_state=True)  # noqa: E731
                    for t in bounded}
    before = rows()
    sd = {"model": adagrad.state_dict(), "optim": adagrad.fused_optimizer.state_dict()}
    try:  # DCP's error is a BaseException
        dcp.load(sd, checkpoint_id=out / "dcp-adam")
        res["dcp"] = None
    except CheckpointException as e:
        res["dcp"] = str(e)
    res["dcp unchanged"] = all(torch.equal(before[n], after) for n, after in rows().items())
    adagrad.close()
    return res


test_distributed.SCENARIOS.update(checkpoint_faults=scenario_faults)
_run_rank = test_distributed._rank_main


def _rank_main(*args):
    """test_distributed's rank process, started from this module so that it knows the scenario above."""
    _run_rank(*args)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt-faults")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_distributed, "_rank_main", _rank_main)
        return out, launch(out, "checkpoint_faults", 2)


def test_a_refused_checkpoint_leaves_the_one_it_refused_to_overwrite_as_it_was(ranks):
    out, got = ranks
    for r in range(2):
        assert got[r]["overwrite"] is not None, "a checkpoint of another plan overwrote the existing one"
        kind, message = got[r]["overwrite"]
        assert kind in ("PathExistsError", "RankFailedError"), got[r]["overwrite"]
        assert str(out / "ckpt") in message and "new" in message, message
        assert got[r]["files kept"], "plan.json or tables.json of the refused checkpoint changed"
    assert got[0]["overwrite"][0] == "PathExistsError"  # rank 0 would have written plan.json
    assert isinstance(got[0]["restored"], dict), got[0]["restored"]
    for name, rows in got[0]["rows"].items():
        assert torch.equal(got[0]["restored"][name], rows), name


EXPECTED = {  # (file or directory named, words of what is wrong)
    "row boundary": ("plan.json", "rows [24, 40) of table 'user'"),
    "table moved": ("rank-0", "table 'item'"),
    "column boundary": ("plan.json", "columns [0, 2) of table 'wide'"),
    "fewer ranks": ("rank-1", "plan.json"),
    "num_rows": ("tables.json", "num_rows=35"),
    "dim": ("tables.json", "dim=5"),
    "num_rows against the plan": ("tables.json", "num_rows=50"),
    "dim of a column table": ("tables.json", "must cover [0, 7)"),
    "table renamed": ("tables.json", "name different tables"),
    "swapped ranks": ("rank-0", "plan.json"),
    "missing rank": ("rank-1", "missing"),
}


@pytest.mark.parametrize("damage", list(EXPECTED))
def test_a_damaged_sharded_checkpoint_raises_a_named_error_on_every_rank_and_creates_nothing(ranks, damage):
    out, got = ranks
    names = list(_damages())
    where, what = EXPECTED[damage]
    for r in range(2):
        seen = got[r]["damaged"][damage]
        if seen["error"] is None:
            lost = {n: int((seen["rows"][n] != got[0]["rows"][n]).any(1).sum()) for n in seen["rows"]} if r == 0 else {}
            pytest.fail(f"rank {r} restored the damaged checkpoint without an error (rows that differ: {lost})")
        kind, message = seen["error"]
        assert kind == "StoreCorruptError", seen["error"]
        assert str(out / f"damaged-{names.index(damage)}" / where) in message and what in message, message
        assert not seen["created"], "a refused restore created its path"


# -- optimizer state of another optimizer --------------------------------------------------------------
def test_an_adam_dcp_checkpoint_does_not_load_into_an_adagrad_sharded_collection(ranks):
    _, got = ranks
    for r in range(2):
        assert got[r]["dcp"] is not None, "Adam's state loaded into Adagrad"
        assert "Missing key in checkpoint state_dict: optim.optimizer.Adagrad" in got[r]["dcp"], got[r]["dcp"]
        assert got[r]["dcp unchanged"]


def _train(module, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        ids = torch.randint(0, n, (40,), generator=g)
        (module(ids, torch.arange(0, 40, 4)) - 1.0).square().sum().backward()  # gradients of both signs


def _rows(module) -> torch.Tensor:
    return module.store.read(module.table, torch.arange(module.num_embeddings), with_state=True)


def test_optimizer_state_of_another_optimizer_is_refused_by_dcp_and_load_state_dict(tmp_path):
    adam = TieredEmbeddingBag(30, 4, mode="sum", path=tmp_path / "adam", optimizer=optim.Adam(lr=0.05), device="cpu")
    _train(adam, 30, 0)
    saved = adam.fused_optimizer.state_dict()
    assert saved["optimizer"] == {"Adam": repr(adam.optimizer)}
    dcp.save({"model": adam.state_dict(), "optim": saved}, checkpoint_id=tmp_path / "ckpt")
    adagrad = TieredEmbeddingBag(30, 4, mode="sum", path=tmp_path / "adagrad", optimizer=optim.Adagrad(lr=0.1), device="cpu")
    _train(adagrad, 30, 1)
    before = _rows(adagrad)
    sd = {"model": adagrad.state_dict(), "optim": adagrad.fused_optimizer.state_dict()}
    # DCP's planner matches the keys before it reads a row
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.optimizer\.Adagrad"):
        dcp.load(sd, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(_rows(adagrad), before)
    # the state in memory: Adam's momentum1 alone has the key and shape of Adagrad's sum of squares
    one = {"state": {"weight": {"t0.momentum1": saved["state"]["weight"]["t0.momentum1"]}}, "optimizer": saved["optimizer"]}
    with pytest.raises(OptimizerMismatchError, match=r"saved by Adam\(lr=0.05.*trains with Adagrad\(lr=0.1"):
        adagrad.fused_optimizer.load_state_dict(one)
    assert torch.equal(_rows(adagrad), before)
    # the same optimizer with another learning rate loads: lr is not state
    again = TieredEmbeddingBag(30, 4, mode="sum", path=tmp_path / "again", optimizer=optim.Adam(lr=0.01), device="cpu")
    sd = {"model": again.state_dict(), "optim": again.fused_optimizer.state_dict()}
    dcp.load(sd, checkpoint_id=tmp_path / "ckpt")
    again.fused_optimizer.load_state_dict(sd["optim"])
    assert torch.equal(_rows(again), _rows(adam))
    for m in (adam, adagrad, again):
        m.close()


def test_torchrec_collection_refuses_another_optimizers_state(tmp_path):
    pytest.importorskip("torchrec")
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from tierstore.torchrec import TieredEmbeddingBagCollection

    configs = lambda: [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])]  # noqa: E731
    g = torch.Generator().manual_seed(0)

    def train(ebc):
        for _ in range(2):
            kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.randint(0, 100, (64,), generator=g), torch.full((16,), 4))
            (ebc(kjt).values() - 1.0).square().sum().backward()

    adam = TieredEmbeddingBagCollection(configs(), path=tmp_path / "adam", device="cpu", optimizer=optim.Adam(lr=0.1))
    train(adam)
    saved = adam.fused_optimizer.state_dict()
    dcp.save({"model": adam.state_dict(), "optim": saved}, checkpoint_id=tmp_path / "ckpt")
    adagrad = TieredEmbeddingBagCollection(configs(), path=tmp_path / "adagrad", device="cpu", optimizer=optim.Adagrad(lr=0.1))
    train(adagrad)
    before = adagrad.store.read("t", torch.arange(100), with_state=True)
    sd = {"model": adagrad.state_dict(), "optim": adagrad.fused_optimizer.state_dict()}
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.optimizer\.Adagrad"):
        dcp.load(sd, checkpoint_id=tmp_path / "ckpt")
    one = {"state": {"embedding_bags.t.weight": {"t.momentum1": saved["state"]["embedding_bags.t.weight"]["t.momentum1"]}},
           "optimizer": saved["optimizer"]}
    with pytest.raises(OptimizerMismatchError, match=r"saved by Adam"):
        adagrad.fused_optimizer.load_state_dict(one)
    assert torch.equal(adagrad.store.read("t", torch.arange(100), with_state=True), before)
    adam.close()
    adagrad.close()
