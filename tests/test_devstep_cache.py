"""The device step over a cache (resolve_ahead): each batch's rows brought into the top
tier by the host ahead of its step and pinned there until the step is done; the step
itself dispatches no wait, and rows end the same bits as every row resident."""
from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tierstore
from tierstore import LookaheadLoader, TieredEmbeddingBag, TieredEmbeddingBagCollection, TableSpec
from tierstore.errors import UnsupportedError
from tierstore.tools.dispatch_count import OpCounter

N, DIM = 200, 4


def bag(path, **kw):
    return TieredEmbeddingBag(N, DIM, mode="sum", path=path, device="cpu", optimizer=tierstore.optim.Adagrad(lr=0.1), **kw)


def rows(m) -> torch.Tensor:
    return m.store.read(m.table, torch.arange(N), with_state=True)


def data(steps, seed=0, size=24, skew=3.0):
    g = torch.Generator().manual_seed(seed)
    return [((torch.rand(size, generator=g) ** skew * N).long(), torch.arange(0, size, 4), torch.randn(size // 4, DIM, generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_cached_steps_train_the_resident_bits_and_wait_for_nothing_ahead(tmp_path, depth):
    cached = bag(tmp_path / "c", hbm_rows=70, ddr_rows=30).resolve_ahead()
    held = bag(tmp_path / "h", hbm_rows=N).hold_resident()
    batches = data(10)
    waits = []
    for ids, offsets in LookaheadLoader([b[:2] for b in batches], cached, depth=depth):
        with OpCounter(inside=("tierstore",)) as ops:
            cached(ids, offsets).backward(batches[len(waits)][2])
        counts = ops.summary()
        waits.append(counts["host_syncs"] + counts["data_dependent"] + counts["device_to_host"])
    for ids, offsets, grad in batches:
        held(ids, offsets).backward(grad)
    assert torch.equal(rows(cached), rows(held))
    assert cached.store.stats()["hbm"]["evictions"] > 0  # a cache indeed
    if depth:
        assert waits == [0] * len(batches)  # resolved ahead: the step sees slots only
    else:
        assert min(waits) > 0  # depth 0: the forward resolves its batch itself, on the host
    cached.store.close(), held.store.close()  # now, not when the loader's references go, after tmp_path has


def test_a_batch_that_cannot_fit_beside_the_steps_in_flight_is_refused_as_it_was(tmp_path):
    cached = bag(tmp_path / "c", hbm_rows=30).resolve_ahead()
    first, second = torch.arange(0, 20), torch.arange(20, 40)
    cached.resolve_batch((first, torch.tensor([0])))
    before = rows(cached)
    with pytest.raises(UnsupportedError, match="rows that steps in flight use"):
        cached.resolve_batch((second, torch.tensor([0])))
    assert torch.equal(rows(cached), before)
    cached(first, torch.tensor([0])).sum().backward()  # the first batch's rows are where it was told
    cached.release_steps()
    cached.resolve_batch((second, torch.tensor([0])))  # room again once the step is done


def test_resolve_batch_checks_the_batch_first(tmp_path):
    cached = bag(tmp_path / "c", hbm_rows=30).resolve_ahead()
    with pytest.raises(IndexError, match="not in the valid range"):
        cached.resolve_batch((torch.tensor([1, N]), torch.tensor([0])))
    with pytest.raises(tierstore.errors.SettingError, match="resolve_ahead"):
        bag(tmp_path / "d", hbm_rows=30).resolve_batch((torch.tensor([1]), torch.tensor([0])))


def test_collection_resolves_each_table_ahead(tmp_path):
    specs = [TableSpec("a", N, DIM), TableSpec("b", 50, DIM)]
    opt = tierstore.optim.SGD(lr=0.1)
    cached = TieredEmbeddingBagCollection(specs, path=tmp_path / "c", hbm_rows=40, device="cpu", optimizer=opt).resolve_ahead()
    held = TieredEmbeddingBagCollection(specs, path=tmp_path / "h", hbm_rows=N, device="cpu", optimizer=opt).hold_resident()
    batches = [{"a": (ids, offsets), "b": (ids % 50, offsets)} for ids, offsets, _ in data(6, size=16)]
    for features in LookaheadLoader(batches, cached, depth=1):
        with OpCounter(inside=("tierstore",)) as ops:
            out = cached(features)
            (out["a"] - out["b"]).square().sum().backward()
        assert ops.summary()["host_syncs"] == 0
    for features in batches:
        out = held(features)
        (out["a"] - out["b"]).square().sum().backward()
    for t, n in (("a", N), ("b", 50)):
        assert torch.equal(cached.store.read(t, torch.arange(n)), held.store.read(t, torch.arange(n)))
    cached.store.close(), held.store.close()  # now, not when the loader's references go, after tmp_path has


def test_cached_step_compiles_whole_and_trains_as_eager(tmp_path):
    """The loader resolves each batch and hands its slots over as it yields it (begin_step):
    the forward left to compile is the step on slots, one graph, no break (fullgraph)."""
    class Tower(torch.nn.Module):
        def __init__(self, bag):
            super().__init__()
            self.bag, self.dense = bag, torch.nn.Linear(DIM, 1)
            torch.nn.init.constant_(self.dense.weight, 0.5), torch.nn.init.constant_(self.dense.bias, 0.1)

        def forward(self, ids, offsets):
            return self.dense(self.bag(ids, offsets)).square()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    batches = data(5)
    eager, compiled = (Tower(bag(tmp_path / name, hbm_rows=60, ddr_rows=30).resolve_ahead()) for name in ("e", "c"))
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    graphs = []  # compiled before each run: the eager run's are the update's kernels (tierstore.training.kernels)
    for model, fwd in ((eager, eager), (compiled, step)):
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        for ids, offsets in LookaheadLoader([b[:2] for b in batches], model.bag, depth=1):
            fwd(ids, offsets).sum().backward()
    assert torch.equal(rows(compiled.bag), rows(eager.bag))
    assert compiled.bag.store.stats()["hbm"]["evictions"] > 0  # a cache indeed
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs[1] == 1


class InFlightMachine(RuleBasedStateMachine):
    """Batches resolved up to ``depth`` ahead of their steps, as LookaheadLoader does, over
    tiers of any size: a row of a step in flight never leaves its slot, a batch is refused
    exactly when its rows and the pinned ones exceed the top tier, and the rows trained
    are those of every row resident, bit for bit."""

    @initialize(depth=st.integers(0, 3), hbm=st.integers(8, 40), ddr=st.integers(0, 40))
    def open(self, depth, hbm, ddr):
        self.tmp = tempfile.TemporaryDirectory()
        self.depth = depth
        self.cached = bag(f"{self.tmp.name}/c", hbm_rows=hbm, ddr_rows=ddr).resolve_ahead()
        self.held = bag(f"{self.tmp.name}/h", hbm_rows=N).hold_resident()
        self.table = self.cached.store._tables["t0"]
        self.top = self.table.hbm or self.table.ddr
        self.queued = []  # (ids, grad) resolved, not yet stepped

    @rule(size=st.integers(1, 16), seed=st.integers(0, 2**16))
    def announce(self, size, seed):
        if len(self.queued) > self.depth:
            return
        g = torch.Generator().manual_seed(seed)
        ids = (torch.rand(size, generator=g) * N).long()
        resident = self.top.lookup(torch.unique(ids)) >= 0
        pinned = set() if self.table.in_flight is None else set(torch.nonzero(torch.from_numpy(self.table.in_flight.pins)).flatten().tolist())
        slots_of_batch = set(self.top.lookup(torch.unique(ids))[resident].tolist())
        need = len(pinned | slots_of_batch) + int((~resident).sum())
        try:
            self.cached.resolve_batch((ids, torch.tensor([0])))
        except UnsupportedError:
            assert need > self.top.capacity
            return
        assert need <= self.top.capacity
        self.queued.append((ids, torch.randn(1, DIM, generator=g)))

    @rule()
    def step(self):
        if not self.queued:
            return
        ids, grad = self.queued.pop(0)
        self.cached(ids, torch.tensor([0])).backward(grad)
        self.held(ids, torch.tensor([0])).backward(grad)
        self.cached.release_steps()

    @invariant()
    def in_flight_rows_stay(self):
        for ids, hit, _ in list(self.cached._ahead or ()) + list(self.cached._done or ()):
            assert torch.equal(hit.tier.ids.index_select(0, hit.slots), ids)

    def teardown(self):
        if hasattr(self, "cached"):
            assert torch.equal(rows(self.cached), rows(self.held))
            self.cached.close()
            self.held.close()
            self.tmp.cleanup()


InFlightMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)
TestInFlight = InFlightMachine.TestCase


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
def test_cached_steps_on_cuda_never_sync_and_train_the_resident_bits(tmp_path, depth):
    kw = dict(mode="sum", device="cuda", optimizer=tierstore.optim.Adagrad(lr=0.1))
    cached = TieredEmbeddingBag(N, DIM, path=tmp_path / "c", hbm_rows=70, ddr_rows=30, **kw).resolve_ahead()
    held = TieredEmbeddingBag(N, DIM, path=tmp_path / "h", hbm_rows=N, **kw).hold_resident()
    batches = data(10)
    for i, (ids, offsets) in enumerate(LookaheadLoader([b[:2] for b in batches], cached, depth=depth)):
        grad = batches[i][2].cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # the step only: the loader's resolution is the host's
        try:
            cached(ids, offsets).backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for ids, offsets, grad in batches:
        held(ids, offsets).backward(grad.cuda())
    assert torch.equal(rows(cached), rows(held))
