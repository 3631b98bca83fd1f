"""Tables in state_dict(), torch.save and torch.distributed.checkpoint:
real LMDB stores, real DCP files, real gloo ranks for the sharded collection."""
from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import RowInit, TableSpec, TieredEmbeddingBag, TieredEmbeddingBagCollection, optim
from tierstore.training import checkpointing
from tierstore.training.checkpointing import TableTooLargeError, TableView

import test_distributed
from test_distributed import launch

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.1),
    "adagrad": lambda: optim.Adagrad(lr=0.1),
    "rowwise": lambda: optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: optim.Adam(lr=0.05),
}


def train(module, steps: int, seed: int, n: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, n, (40,), generator=g)
        module(ids, torch.arange(0, 40, 4)).square().sum().backward()


def rows_of(module) -> torch.Tensor:
    return module.store.read(module.table, torch.arange(module.num_embeddings), with_state=True)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, and no table may be read whole: DCP must go chunk by chunk."""
    monkeypatch.setattr(checkpointing, "CHUNK_BYTES", 96)
    monkeypatch.setattr(checkpointing, "MAX_MATERIALIZE_BYTES", 64)


def test_state_dict_has_embedding_bags_key_and_torch_save_round_trips(tmp_path):
    m = TieredEmbeddingBag(30, 4, mode="sum", path=tmp_path / "s", optimizer=optim.Adagrad(lr=0.1), ddr_rows=5, device="cpu")
    train(m, 3, 0, 30)
    sd = m.state_dict()
    assert list(sd) == list(torch.nn.EmbeddingBag(30, 4).state_dict()) == ["weight"]
    assert sd["weight"].shape == (30, 4) and isinstance(sd["weight"], TableView)
    saved, buf = rows_of(m), io.BytesIO()
    torch.save(sd, buf)  # the habit: plain torch.save of the state dict
    train(m, 3, 1, 30)
    assert not torch.equal(rows_of(m)[:, :4], saved[:, :4])
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only: plain tensors
    assert type(loaded["weight"]) is torch.Tensor
    m.load_state_dict(loaded)
    assert torch.equal(bits(rows_of(m)[:, :4]), bits(saved[:, :4]))
    # nn.EmbeddingBag takes the same checkpoint, and gives one back
    ref = torch.nn.EmbeddingBag(30, 4, mode="sum")
    ref.load_state_dict(m.state_dict())
    assert torch.equal(ref.weight.detach(), saved[:, :4])
    with torch.no_grad():
        ref.weight.mul_(2)
    m.load_state_dict(ref.state_dict())
    assert torch.equal(m.store.read("t0", torch.arange(30)), ref.weight.detach())
    m.close()


def test_too_large_for_torch_save_names_dcp_and_writes_nothing(tmp_path, monkeypatch):
    m = TieredEmbeddingBag(300, 8, path=tmp_path / "s", device="cpu")
    monkeypatch.setattr(checkpointing, "MAX_MATERIALIZE_BYTES", 1000)
    buf = io.BytesIO()
    with pytest.raises(TableTooLargeError, match=r"torch\.distributed\.checkpoint\.save\(model\.state_dict\(\)"):
        torch.save(m.state_dict(), buf)
    with pytest.raises(TableTooLargeError, match="MAX_MATERIALIZE_BYTES"):
        m.state_dict()["weight"].clone()
    m.close()


def test_module_pickle_and_deepcopy_say_what_to_do(tmp_path):
    m = TieredEmbeddingBag(10, 4, path=tmp_path / "s", device="cpu")
    model = torch.nn.Sequential(m)
    for attempt in (lambda: copy.deepcopy(model), lambda: torch.save(model, io.BytesIO())):
        with pytest.raises(TypeError, match=r"cannot be pickled or deep-copied.*state_dict\(\)"):
            attempt()
    m.close()


def test_load_with_a_wrong_shape_changes_no_row(tmp_path):
    ebc = TieredEmbeddingBagCollection([TableSpec("a", 10, 4), TableSpec("b", 12, 4)], path=tmp_path / "s",
                                       optimizer=optim.SGD(lr=0.1), device="cpu")
    sd = {k: v.clone() + 1 for k, v in ebc.state_dict().items()}
    assert sorted(sd) == ["embedding_bags.a.weight", "embedding_bags.b.weight"]
    before = {t: ebc.store.read(t, torch.arange(n)) for t, n in (("a", 10), ("b", 12))}
    bad = dict(sd, **{"embedding_bags.b.weight": torch.zeros(11, 4)})
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags\.b\.weight"):
        ebc.load_state_dict(bad)
    assert torch.equal(ebc.store.read("b", torch.arange(12)), before["b"])
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*embedding_bags\.c\.weight"):
        ebc.load_state_dict(dict(sd, **{"embedding_bags.c.weight": torch.zeros(3, 4)}))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*embedding_bags\.a\.weight"):
        ebc.load_state_dict({"embedding_bags.b.weight": sd["embedding_bags.b.weight"]})
    ebc.load_state_dict(sd)
    assert torch.equal(ebc.store.read("a", torch.arange(10)), before["a"] + 1)
    ebc.close()


def test_unbounded_table_is_refused_naming_store_checkpoint(tmp_path):
    m = TieredEmbeddingBag(None, 4, path=tmp_path / "s", device="cpu")
    with pytest.raises(ValueError, match=r"unbounded id space.*store\.checkpoint\(path\)"):
        m.state_dict()
    m.close()


@settings(max_examples=12, deadline=None)
@given(opt=st.sampled_from(sorted(OPTIMIZERS)), dtype=st.sampled_from(["float32", "float16"]),
       ddr=st.integers(0, 12), seed=st.integers(0, 2**16), first=st.integers(1, 4), more=st.integers(1, 4))
def test_dcp_round_trip_restores_rows_and_state_bit_for_bit(tmp_path_factory, opt, dtype, ddr, seed, first, more):
    """Train, DCP save (model and fused optimizer), train more, DCP load: every row and its
    state as the store held them at the save. Then into a fresh store: the same rows, and
    LMDB holds only the rows that differ from their initial value."""
    tmp = tmp_path_factory.mktemp("dcp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpointing, "CHUNK_BYTES", 96)  # several chunks per table
        mp.setattr(checkpointing, "MAX_MATERIALIZE_BYTES", 64)  # no table read whole
        n = 25
        make = lambda path: TieredEmbeddingBag(n, 6, mode="sum", path=path, optimizer=OPTIMIZERS[opt](), ddr_rows=ddr,  # noqa: E731
                                               dtype=dtype, device="cpu", init=RowInit.normal(0, 0.3, seed=seed))
        m = make(tmp / "a")
        train(m, first, seed, n)
        saved = rows_of(m)
        dcp.save({"model": m.state_dict(), "optim": m.fused_optimizer.state_dict()}, checkpoint_id=tmp / "ckpt")
        train(m, more, seed + 1, n)
        assert not torch.equal(rows_of(m), saved)
        for target in (m, make(tmp / "b")):
            sd = {"model": target.state_dict(), "optim": target.fused_optimizer.state_dict()}
            dcp.load(sd, checkpoint_id=tmp / "ckpt")
            target.load_state_dict(sd["model"])
            target.fused_optimizer.load_state_dict(sd["optim"])
            assert torch.equal(bits(rows_of(target)), bits(saved))
        target.store.flush()
        trained = torch.nonzero((bits(saved) != bits(make_initial(target, n))).any(1)).squeeze(1)
        assert torch.equal(target.store.stored_ids("t0"), trained)
        m.close()
        target.close()


def make_initial(module, n: int) -> torch.Tensor:
    from tierstore.spec import initial_rows

    return torch.from_numpy(initial_rows(module.store.tables[module.table], torch.arange(n).numpy()))


def test_optimizer_state_keys_are_torchrecs(tmp_path):
    m = TieredEmbeddingBag(10, 4, path=tmp_path / "s", optimizer=optim.RowWiseAdagrad(lr=0.1), device="cpu")
    state = m.fused_optimizer.state_dict()["state"]
    assert list(state) == ["weight"] and list(state["weight"]) == ["t0.momentum1"]
    assert state["weight"]["t0.momentum1"].shape == (10,)  # row-wise: one value a row, as FBGEMM's
    m.close()
    a = TieredEmbeddingBag(10, 4, path=tmp_path / "a", optimizer=optim.Adam(), device="cpu")
    assert {k: tuple(v.shape) for k, v in a.fused_optimizer.state_dict()["state"]["weight"].items()} == \
        {"t0.momentum1": (10, 4), "t0.exp_avg_sq": (10, 4), "t0.step": (10,)}
    a.close()


# -- sharded: every rank saves its own rows, a load under another plan reshards -----------------
TABLES = [TableSpec("user", 40, 8, init=RowInit.normal(0.0, 0.5, seed=1)),
          TableSpec("item", 30, 4, init=RowInit.uniform(-1.0, 1.0, seed=2)),
          TableSpec("wide", 20, 6, init=RowInit.normal(0.0, 0.5, seed=3))]


def _plan(world: int, holders: int | None = None):
    """test_distributed's plan of ``holders`` ranks (default all) over a group of ``world``."""
    from test_distributed import make_plan
    from tierstore.training.sharding import ShardingPlan

    plan = make_plan(holders or world)
    return ShardingPlan(world, {t.name: plan.tables[t.name] for t in TABLES})


def _sharded(plan, path, opt):
    from tierstore.distributed import ShardedEmbeddingBagCollection

    return ShardedEmbeddingBagCollection(TABLES, plan, path, optimizer=OPTIMIZERS[opt](), hbm_rows=3, ddr_rows=4)


def _all_rows(module, rank):
    return {t.name: module.read(t.name, torch.arange(t.num_rows) if rank == 0 else torch.arange(0), with_state=True)
            for t in TABLES}


def _local_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {t.name: (torch.randint(0, t.num_rows, (12,), generator=g), torch.arange(0, 12, 3)) for t in TABLES}


def _step(module, batch):
    sum(v.square().sum() for v in module(batch).values()).backward()


def _load(module, checkpoint) -> None:
    sd = {"model": module.state_dict(), "optim": module.fused_optimizer.state_dict()}
    dcp.load(sd, checkpoint_id=checkpoint)
    module.load_state_dict(sd["model"])
    module.fused_optimizer.load_state_dict(sd["optim"])


def scenario_dcp(rank, world, out):
    """Shards on ranks 0 and 1 of 3 train, save, train on and load back; then a collection
    sharded over all 3 ranks (another plan) loads the same checkpoint."""
    import test_state_dict as me

    checkpointing.CHUNK_BYTES = 200  # several chunks a shard
    out = Path(out)
    res = {}
    for opt in ("adam",):  # per-column segments and a per-row value: every kind of state view
        module = me._sharded(me._plan(world, 2), out / opt, opt)
        for s in range(3):
            me._step(module, me._local_batch(s, rank))
        res[opt] = me._all_rows(module, rank)
        dcp.save({"model": module.state_dict(), "optim": module.fused_optimizer.state_dict()}, checkpoint_id=out / f"dcp-{opt}")
        for s in range(3, 5):  # trained on: the load below must undo this
            me._step(module, me._local_batch(s, rank))
        me._load(module, out / f"dcp-{opt}")
        res[opt + "-reloaded"] = me._all_rows(module, rank)
        module.close()
        resharded = me._sharded(me._plan(world), out / f"{opt}-3", opt)
        me._load(resharded, out / f"dcp-{opt}")
        res[opt + "-resharded"] = me._all_rows(resharded, rank)
        resharded.close()
    return res


test_distributed.SCENARIOS.update(dcp=scenario_dcp)
_run_rank = test_distributed._rank_main


def _rank_main(*args):
    """test_distributed's rank process, started from this module so that it knows the scenario above."""
    _run_rank(*args)


def test_sharded_dcp_saves_each_ranks_rows_and_reshards_on_load(tmp_path, monkeypatch):
    monkeypatch.setattr(test_distributed, "_rank_main", _rank_main)
    ranks = launch(tmp_path, "dcp", 3)
    for opt in ("adam",):
        for name, rows in ranks[0][opt].items():
            assert torch.equal(bits(ranks[0][opt + "-reloaded"][name]), bits(rows)), (opt, name)
            assert torch.equal(bits(ranks[0][opt + "-resharded"][name]), bits(rows)), (opt, name)
    # the single-process collection loads the sharded checkpoint too
    one = TieredEmbeddingBagCollection(TABLES, path=tmp_path / "one", optimizer=OPTIMIZERS["adam"](), device="cpu")
    _load(one, tmp_path / "dcp-adam")
    for t in TABLES:
        assert torch.equal(bits(one.store.read(t.name, torch.arange(t.num_rows), with_state=True)), bits(ranks[0]["adam"][t.name]))
    one.close()
