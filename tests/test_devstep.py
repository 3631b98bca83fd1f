"""The device step (tierstore.training.devstep): a table held in its top tier trains with
static-shape ops and no host sync, to the same bits as the host step and torch's own."""
from __future__ import annotations

import pytest
import torch

import tierstore
from tierstore import TableSpec, TieredEmbeddingBag, TieredEmbeddingBagCollection, TieredStore
from tierstore.errors import UnsupportedError
from tierstore.training import bags, devstep

from tierstore.tools.dispatch_count import OpCounter

N, DIM = 300, 8
OPTIMIZERS = [lambda: tierstore.optim.SGD(lr=0.1), lambda: tierstore.optim.Adagrad(lr=0.1),
              lambda: tierstore.optim.RowWiseAdagrad(lr=0.1)]


def batches(steps: int, seed: int = 0, hot: int = 60):
    """Bags of Zipf-like ids (many repeats: duplicates combine) with empty bags among them."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        sizes = torch.randint(0, 12, (16,), generator=g)
        ids = (torch.rand(int(sizes.sum()), generator=g) ** 3 * hot).long()
        offsets = torch.cumsum(sizes, 0) - sizes
        yield ids, offsets, torch.randn(16, DIM, generator=g)


def module(path, optimizer, mode="sum", **kw):
    kw.setdefault("hbm_rows", N)
    return TieredEmbeddingBag(N, DIM, mode=mode, path=path, device="cpu", optimizer=optimizer(), **kw)


def rows(m) -> torch.Tensor:
    return m.store.read(m.table, torch.arange(N), with_state=True)


def train(m, steps=5, seed=0):
    for ids, offsets, grad in batches(steps, seed):
        m(ids, offsets).backward(grad)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_device_step_trains_the_host_steps_bits(tmp_path, optimizer, mode):
    """Held rows (every one in HBM) against the host step through small tiers: the same rows."""
    held = module(tmp_path / "held", optimizer, mode).hold_resident()
    tiered = module(tmp_path / "tiered", optimizer, mode, hbm_rows=20, ddr_rows=40)
    for m in (held, tiered):
        train(m)
    assert held._on_device(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), None)
    assert torch.equal(rows(held), rows(tiered))


def test_device_step_trains_as_torch_sparse_sgd(tmp_path):
    """nn.EmbeddingBag(sparse=True) with torch.optim.SGD, given the same output gradients: the
    same rows but for the rounding of the step (torch's add_(g, alpha=-lr) rounds once, as
    tierstore.optim.SGD documents), and the same pooled outputs but for torch's two kernels'."""
    held = module(tmp_path / "held", OPTIMIZERS[0]).hold_resident()
    ref = torch.nn.EmbeddingBag.from_pretrained(rows(held).clone(), freeze=False, mode="sum", sparse=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids, offsets, grad in batches(6):
        torch.testing.assert_close(held(ids, offsets), ref(ids, offsets))
        held(ids, offsets).backward(grad)
        opt.zero_grad()
        ref(ids, offsets).backward(grad)
        opt.step()
    torch.testing.assert_close(rows(held), ref.weight.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resident_step_dispatches_no_wait_and_few_ops(tmp_path, optimizer):
    """Forward and backward of a held table: no .item(), no op whose output size depends on
    the data, no copy to the host; at most 12 ops that each run as one piece (aten ops and the
    update's compiled kernels), whatever the optimizer."""
    held = module(tmp_path / "held", optimizer).hold_resident()
    train(held, steps=1)
    (ids, offsets, grad), = batches(1, seed=3)
    with OpCounter(inside=("tierstore",)) as ops:
        held(ids, offsets).backward(grad)
    counts = ops.summary()
    assert (counts["host_syncs"], counts["data_dependent"], counts["device_to_host"]) == (0, 0, 0), counts
    assert not any(tag in op.tags for op in ops.dispatched
                   for tag in (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)), counts
    # the update's element-wise ops, gathers and scatters are compiled kernels (tierstore.training.kernels),
    # each counted once: SGD 8 aten ops and a kernel, Adagrad 9 and two, RowWiseAdagrad 10 (its norm) and two
    kernels = sum(n for op, n in counts["ops"].items() if op.startswith("tierstore_kernels."))
    assert counts["leaf_ops"] == counts["aten_ops"] + kernels <= 12, counts
    assert kernels == (1 if isinstance(held.optimizer, tierstore.optim.SGD) else 2), counts
    assert counts["ops"]["aten.sort"] == 1 and counts["ops"]["tierstore.bag_update_"] == 1


def test_an_update_inductor_cannot_compile_runs_as_aten_ops_to_the_same_rows(tmp_path, monkeypatch):
    """A machine where inductor fails (no C++ compiler, say; injected here): the update's
    kernels run as the aten ops they were compiled from, with a warning, to the same bits."""
    from torch._dynamo.exc import BackendCompilerFailed
    from tierstore.training import kernels

    def refuse(fn, **kw):
        def compiled(*args):
            raise BackendCompilerFailed(refuse, RuntimeError("no C++ compiler"), None)
        return compiled

    compiled = module(tmp_path / "compiled", OPTIMIZERS[2]).hold_resident()
    train(compiled)
    monkeypatch.setattr(torch, "compile", refuse)
    for name in ("_state_kernel", "_weights_kernel"):
        monkeypatch.setattr(kernels, name, kernels._Compiled(getattr(kernels, name).fn))
    with pytest.warns(RuntimeWarning, match="inductor could not compile it .*no C\\+\\+ compiler"):
        held = module(tmp_path / "held", OPTIMIZERS[2]).hold_resident()  # compiled here, as the table opts in
    train(held)
    assert kernels._state_kernel.failed and kernels._weights_kernel.failed
    assert torch.equal(rows(held), rows(compiled))


def test_host_step_waits_where_the_device_step_does_not(tmp_path):
    """The counter sees what it is for: the host step of the same table syncs."""
    m = module(tmp_path / "host", OPTIMIZERS[0])
    train(m, steps=1)
    (ids, offsets, grad), = batches(1, seed=3)
    with OpCounter(inside=("tierstore",)) as ops:
        m(ids, offsets).backward(grad)
    assert ops.summary()["host_syncs"] > 0 and ops.summary()["data_dependent"] > 0


def test_collection_steps_on_the_device_per_table(tmp_path):
    ebc = TieredEmbeddingBagCollection([TableSpec("a", N, DIM), TableSpec("b", 50, DIM)], path=tmp_path / "ebc",
                                       hbm_rows=N, device="cpu", optimizer=tierstore.optim.SGD(lr=0.1)).hold_resident()
    twin = TieredEmbeddingBagCollection([TableSpec("a", N, DIM), TableSpec("b", 50, DIM)], path=tmp_path / "twin",
                                        hbm_rows=10, ddr_rows=20, device="cpu", optimizer=tierstore.optim.SGD(lr=0.1))
    for step, (ids, offsets, grad) in enumerate(batches(4)):
        features = {"a": (ids, offsets), "b": (ids % 50, offsets)}
        for m in (ebc, twin):
            with OpCounter(inside=("tierstore",)) as ops:
                out = m(features)
                (out["a"] * grad + out["b"] * grad.flip(0)).sum().backward()
            if m is ebc:
                counts = ops.summary()
                assert (counts["host_syncs"], counts["data_dependent"], counts["device_to_host"]) == (0, 0, 0)
    for t, n in (("a", N), ("b", 50)):
        assert torch.equal(ebc.store.read(t, torch.arange(n)), twin.store.read(t, torch.arange(n)))
    ebc.store.close(), twin.store.close()  # now, not when the op counts that hold their tensors go


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_held_steps_count_their_ids_as_hits(tmp_path, backend):
    """Each id a held step looks up is a hit in stats(), counted on the host from its shape,
    eager or compiled whole (the count adds no op, no wait and no recompilation)."""
    held = module(tmp_path / "held", OPTIMIZERS[1]).hold_resident()
    before = held.store.stats()["hbm"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(held, backend=backend, fullgraph=True, dynamic=True) if backend else held
    data = list(batches(4))
    graphs = []
    for ids, offsets, grad in data:
        if backend:
            step(ids, offsets).backward(grad)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            continue
        with OpCounter(inside=("tierstore",)) as ops:
            step(ids, offsets).backward(grad)
        assert ops.summary()["host_syncs"] == 0 and ops.summary()["leaf_ops"] == 11
    after = held.store.stats()["hbm"]
    assert after["hits"] - before["hits"] == sum(len(ids) for ids, _, _ in data) > 0
    assert (after["misses"], after["evictions"]) == (before["misses"], before["evictions"])
    if backend:
        # the step's graph and the update's kernels, compiled by the first step and never again
        assert graphs == [graphs[0]] * len(data) and graphs[0] <= 3


def test_device_steps_reach_lmdb(tmp_path):
    """Rows the device step updated are dirty: flush writes them, a reopened store reads them."""
    held = module(tmp_path / "s", OPTIMIZERS[1]).hold_resident()
    train(held)
    want = rows(held)
    held.close()
    with TieredStore(tmp_path / "s", device="cpu", hbm_rows=0, ddr_rows=0) as store:
        assert torch.equal(store.read("t0", torch.arange(N), with_state=True), want)


def test_rows_leaving_the_tier_send_steps_to_the_host(tmp_path):
    """store.evict after hold_resident: the held view is stale, the host step takes over."""
    held = module(tmp_path / "held", OPTIMIZERS[0]).hold_resident()
    twin = module(tmp_path / "twin", OPTIMIZERS[0])
    for m in (held, twin):
        train(m, steps=2)
        m.store.evict(m.table, torch.arange(0, N, 3))
    ids, offsets = torch.tensor([0, 3, 3, 4]), torch.tensor([0, 2])
    assert not held._on_device(ids, offsets, None)
    for m in (held, twin):
        train(m, steps=2, seed=1)
    assert torch.equal(rows(held), rows(twin))


@pytest.mark.parametrize("kw, problem", [
    (dict(mode="max"), "mode='max'"),
    (dict(optimizer=lambda: tierstore.optim.Adam()), "Adam"),
    (dict(hbm_rows=N - 1), f"cannot hold its {N} rows"),
])
def test_hold_resident_refuses_what_it_cannot_hold(tmp_path, kw, problem):
    m = module(tmp_path / "m", kw.pop("optimizer", OPTIMIZERS[0]), **kw)
    with pytest.raises(UnsupportedError, match=problem):
        m.hold_resident()
    assert m._rows is None


def test_run_sums_in_pieces_are_the_host_steps(tmp_path):
    """The static levels of RUN-entry pieces sum each row as bags.sum_rows does on a GPU
    (here forced on the CPU), hot rows of thousands of entries included."""
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.zeros(2500, dtype=torch.long), torch.randint(0, 40, (3000,), generator=g)])
    ids = ids[torch.randperm(len(ids), generator=g)]
    grad, bag = torch.randn(len(ids) // 10 + 1, DIM, generator=g), torch.arange(len(ids)) // 10
    grouped = bags.Rows.group(ids)
    by_id, perm = torch.sort(ids)
    starts = torch.searchsorted(by_id, by_id)
    last = torch.cat([starts[1:] != starts[:-1], torch.tensor([True])])
    for pieces in (True, False):
        host = bags.sum_rows(grad, bag.index_select(0, grouped.perm), grouped.counts, None, pieces=pieces)
        assert torch.equal(devstep.run_sums(grad, bag.index_select(0, perm), starts, pieces=pieces)[last], host)
    assert not torch.equal(bags.sum_rows(grad, bag.index_select(0, grouped.perm), grouped.counts, None, pieces=True),
                           bags.sum_rows(grad, bag.index_select(0, grouped.perm), grouped.counts, None, pieces=False))


@pytest.mark.gpu
def test_device_step_on_cuda_never_syncs_and_matches_the_host_step(tmp_path):
    held = TieredEmbeddingBag(N, DIM, mode="sum", path=tmp_path / "held", hbm_rows=N, device="cuda",
                              optimizer=tierstore.optim.Adagrad(lr=0.1)).hold_resident()
    tiered = TieredEmbeddingBag(N, DIM, mode="sum", path=tmp_path / "tiered", hbm_rows=20, ddr_rows=40, device="cuda",
                                optimizer=tierstore.optim.Adagrad(lr=0.1))
    data = [(ids.cuda(), offsets.cuda(), grad.cuda()) for ids, offsets, grad in batches(6, hot=20)]
    held(*data[0][:2]).backward(data[0][2])  # warm: the first step may allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids, offsets, grad in data[1:]:
            held(ids, offsets).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for ids, offsets, grad in data:
        tiered(ids, offsets).backward(grad)
    assert torch.equal(held.store.read("t0", torch.arange(N), with_state=True),
                       tiered.store.read("t0", torch.arange(N), with_state=True))


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_device_step_on_cuda_runs_compiled_kernels_in_12_ops_to_the_host_steps_bits(tmp_path, optimizer):
    """On CUDA the update's kernels compile to Triton (no fallback to aten ops), a held step
    is at most 12 ops, and its rows are the host step's bits for each optimizer."""
    from tierstore.training import kernels

    kw = dict(mode="sum", device="cuda")
    held = TieredEmbeddingBag(N, DIM, path=tmp_path / "held", hbm_rows=N, optimizer=optimizer(), **kw).hold_resident()
    tiered = TieredEmbeddingBag(N, DIM, path=tmp_path / "tiered", hbm_rows=20, ddr_rows=40, optimizer=optimizer(), **kw)
    data = [(ids.cuda(), offsets.cuda(), grad.cuda()) for ids, offsets, grad in batches(6, hot=20)]
    for i, (ids, offsets, grad) in enumerate(data):
        with OpCounter(inside=("tierstore",)) as ops:
            held(ids, offsets).backward(grad)
        if i == len(data) - 1:
            counts = ops.summary()
            assert counts["leaf_ops"] <= 12 and counts["host_syncs"] == counts["device_to_host"] == 0, counts
        tiered(ids, offsets).backward(grad)
    assert kernels._state_kernel.failed is None and kernels._weights_kernel.failed is None
    assert torch.equal(held.store.read("t0", torch.arange(N), with_state=True),
                       tiered.store.read("t0", torch.arange(N), with_state=True))


def test_device_step_takes_int32_ids_and_offsets(tmp_path):
    held = module(tmp_path / "held", OPTIMIZERS[1]).hold_resident()
    twin = module(tmp_path / "twin", OPTIMIZERS[1]).hold_resident()
    for ids, offsets, grad in batches(3):
        held(ids.int(), offsets.int()).backward(grad)
        twin(ids, offsets).backward(grad)
    assert torch.equal(rows(held), rows(twin))


def test_torchrec_collection_steps_its_held_tables_on_the_device(tmp_path):
    pytest.importorskip("torchrec", reason="TorchRec (optional peer) is not installed: see docs")
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from tierstore.torchrec import TieredEmbeddingBagCollection as Ours

    configs = [EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=N, feature_names=["u"])]
    held = Ours(configs, path=tmp_path / "held", hbm_rows=N, device="cpu", optimizer=OPTIMIZERS[1]()).hold_resident()
    host = Ours(configs, path=tmp_path / "host", hbm_rows=40, device="cpu", optimizer=OPTIMIZERS[1]())
    for ids, offsets, grad in batches(4):
        lengths = torch.diff(offsets, append=torch.tensor([len(ids)]))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["u"], values=ids, lengths=lengths)
        for m in (held, host):
            with OpCounter(inside=("tierstore",)) as ops:
                m(kjt).values().backward(grad)
            if m is held:
                assert ops.summary()["ops"].get("tierstore.bag_update_") == 1
    assert torch.equal(held.store.read("user", torch.arange(N), with_state=True),
                       host.store.read("user", torch.arange(N), with_state=True))
