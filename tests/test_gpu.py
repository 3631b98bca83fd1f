"""The HBM tier on CUDA: the same rows, counts and training as on the CPU.

Tests parametrized over ``DEVICES`` also run on the CPU, so what they check holds
there too; the CUDA cases (and the tests marked ``gpu``) skip without CUDA."""
import numpy as np
import pytest
import torch

from tierstore import LookaheadLoader, RowInit, TableSpec, TieredEmbeddingBag, TieredStore, optim
from tierstore.trace import Trace

gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


@gpu
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cuda_hbm_matches_cpu(tmp_path, policy):
    spec = [TableSpec("t", 5000, 16, init=RowInit.normal(0, 1, seed=2), state_dim=2)]
    rng = np.random.default_rng(0)
    with TieredStore(tmp_path / "gpu", spec, hbm_rows=300, ddr_rows=700, policy=policy, device="cuda") as g, \
         TieredStore(tmp_path / "cpu", spec, hbm_rows=300, ddr_rows=700, policy=policy, device="cpu") as c:
        assert g._tables["t"].hbm.weights.is_cuda and not g._tables["t"].ddr.weights.is_cuda
        for step in range(60):
            ids = rng.zipf(1.2, 500) % 5000
            a = g.read("t", torch.from_numpy(ids).cuda(), with_state=True)
            b = c.read("t", ids, with_state=True)
            assert a.is_cuda and torch.equal(a.cpu(), b)
            w = torch.from_numpy(rng.standard_normal((len(ids), 16)).astype(np.float32))
            g.write("t", torch.from_numpy(ids).cuda(), w.cuda())
            c.write("t", ids, w)
        g.flush()  # the rows each writer thread has committed so far depend on its timing
        c.flush()
        # the same counts; their memory differs only in where the HBM tier lives (stats()["memory"])
        assert {k: v for k, v in g.stats().items() if k != "memory"} == {k: v for k, v in c.stats().items() if k != "memory"}


@gpu
def test_cuda_all_hit_read_stays_on_device(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 10_000, 32)], hbm_rows=10_000, device="cuda") as s:
        ids = torch.arange(10_000, device="cuda")
        s.read("t", ids)
        out = torch.empty((10_000, 32), device="cuda")
        assert s.read("t", ids.flip(0), out=out) is out
        assert s.stats()["hbm"]["hits"] == 10_000


@gpu
def test_cuda_means_the_current_gpu(tmp_path):
    """"cuda" names the current device with its index, so a tensor made on the GPU
    (always cuda:N) is a valid ``out=``. No device is torch's default, the CPU, as for
    nn.EmbeddingBag: a model built beside the store on a GPU machine is on one device."""
    here = torch.device("cuda", torch.cuda.current_device())
    with TieredStore(tmp_path / "named", [TableSpec("t", 100, 4)], hbm_rows=10, device="cuda") as s:
        assert s.device == here and s._tables["t"].hbm.weights.device == here
        out = torch.empty((3, 4), device="cuda")
        assert s.read("t", torch.tensor([1, 2, 3], device="cuda"), out=out) is out
    with TieredStore(tmp_path / "default", [TableSpec("t", 100, 4)], hbm_rows=10) as s:
        assert s.device == torch.device("cpu") == torch.nn.EmbeddingBag(4, 2).weight.device


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_store_on_the_second_gpu_plans_and_prefetches_there(tmp_path):
    """Helper threads start on cuda:0; a store made while cuda:1 is current keeps every
    tensor on cuda:1 (a read of 5,000 ids, most of them misses, is planned on a thread)."""
    spec = [TableSpec("t", 20_000, 8, init=RowInit.normal(0, 1, seed=3))]
    with torch.cuda.device(1):
        with TieredStore(tmp_path / "gpu", spec, hbm_rows=256, ddr_rows=1024, device="cuda") as g, \
             TieredStore(tmp_path / "cpu", spec, hbm_rows=256, ddr_rows=1024, device="cpu") as c:
            assert g.device == torch.device("cuda", 1)
            rng = np.random.default_rng(1)
            for n in (200, 5000, 300):
                ids = rng.integers(0, 20_000, n)
                g.prefetch("t", ids).wait()
                a = g.read("t", torch.from_numpy(ids).to(g.device))
                assert a.device == g.device and torch.equal(a.cpu(), c.read("t", ids))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hbm_rows, ddr_rows", [(64, 128), (0, 128)])
def test_hashed_ids_read_and_write_as_on_a_store_with_no_tiers(tmp_path, device, hbm_rows, ddr_rows):
    """An unbounded table (a hash index on the tier's device), ids given on that device,
    calls larger than the tiers, and a call of 5,000 ids that mostly miss with some hits
    (its plan is made on a helper thread): the rows of a store that keeps none cached."""
    spec = [TableSpec("t", None, 8, init=RowInit.normal(0, 1, seed=4))]
    pool = np.random.default_rng(2).choice(1 << 62, 6_000, replace=False).astype(np.int64)
    rng = np.random.default_rng(3)
    with TieredStore(tmp_path / "s", spec, hbm_rows=hbm_rows, ddr_rows=ddr_rows, device=device) as s, \
         TieredStore(tmp_path / "ref", spec, device="cpu") as ref:
        for n in (50, 300, 40, 5_000, 100):
            ids = pool[rng.integers(0, 6_000 if n == 5_000 else 400, n)]
            got = s.read("t", torch.from_numpy(ids).to(device))
            assert got.device == s.device and torch.equal(got.cpu(), ref.read("t", ids))
            values = torch.from_numpy(rng.standard_normal((n, 8)).astype(np.float32))
            s.write("t", torch.from_numpy(ids).to(device), values.to(device))
            ref.write("t", ids, values)
        every = np.unique(pool)
        assert torch.equal(s.read("t", every).cpu(), ref.read("t", every))


def _train(path, device, opt, mode, dtype, hbm_rows, ddr_rows, depth, steps=12):
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(steps):
        ids = (torch.rand(96, generator=g) ** 3 * 600).long()  # skewed: hot rows recur, cold ones come and go
        batches.append((ids.to(device), torch.arange(0, 96, 8, device=device)))
    emb = TieredEmbeddingBag(600, 8, mode=mode, path=path, hbm_rows=hbm_rows, ddr_rows=ddr_rows, device=device,
                             optimizer=opt(), dtype=dtype, init=RowInit.normal(0, 0.5, seed=6))
    loader = LookaheadLoader(batches, emb, depth=depth) if depth else batches
    for ids, offsets in loader:
        out = emb(ids, offsets)
        assert out.device == emb.store.device  # whichever tier held the rows
        (out * torch.linspace(-1, 1, 8, device=out.device)).pow(2).sum().backward()
    rows = emb.store.read(emb.table, torch.arange(600), with_state=True).cpu()
    emb.close()
    return rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt, mode, dtype", [
    (lambda: optim.SGD(lr=0.1), "sum", "float32"),
    (lambda: optim.Adagrad(lr=0.1), "mean", "float32"),
    (lambda: optim.RowWiseAdagrad(lr=0.1), "sum", "float32"),
    (lambda: optim.Adam(lr=0.05), "max", "float32"),
    (lambda: optim.SGD(lr=0.1), "max", "float32"),
    (lambda: optim.RowWiseAdagrad(lr=0.1), "mean", "float16"),
], ids=["sgd-sum", "adagrad-mean", "rowwise-sum", "adam-max", "sgd-max", "rowwise-mean-fp16"])
def test_training_gives_the_same_bits_whatever_the_tiers(tmp_path, device, opt, mode, dtype):
    """Rows all in the top tier (updated in place), rows through LMDB, a table with no
    HBM tier (on a GPU store: read up to the GPU, not pooled on the host), prefetch:
    the same bits. On a GPU, close to the CPU's (its kernels may round differently)."""
    runs = [_train(tmp_path / f"r{i}", device, opt, mode, dtype, hbm, ddr, depth)
            for i, (hbm, ddr, depth) in enumerate([(1000, 0, 0), (16, 32, 0), (0, 32, 0), (16, 32, 2)])]
    for rows in runs[1:]:
        assert torch.equal(rows, runs[0])
    if device == "cuda":
        # float16 rows: a sum rounded differently lands one float16 step away (seen on an H100)
        rtol = torch.finfo(torch.float16).eps if dtype == "float16" else 1e-5
        torch.testing.assert_close(runs[0], _train(tmp_path / "cpu", "cpu", opt, mode, dtype, 16, 32, 0), rtol=rtol, atol=1e-6)


@gpu
def test_a_gather_queued_on_a_side_stream_sees_the_rows_before_a_later_write(tmp_path):
    """A read on another CUDA stream is only queued when it returns; the write that
    follows (on the default stream) waits for it on the GPU, not only on the host."""
    with TieredStore(tmp_path, [TableSpec("t", 1000, 16)], hbm_rows=1000, device="cuda") as s:
        ids = torch.arange(1000, device="cuda")
        before = torch.randn(1000, 16, device="cuda")
        s.write("t", ids, before)
        s.read("t", ids)  # all in the HBM tier now: the next read gathers outside the lock
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the gather waits on the GPU behind this
            got = s.read("t", ids)
        s.write("t", ids, torch.zeros(1000, 16, device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(got, before)


@gpu
def test_a_trace_records_ids_given_on_the_gpu(tmp_path):
    with TieredStore(tmp_path / "s", [TableSpec("t", 100, 4)], hbm_rows=10, device="cuda", record_trace=tmp_path / "trace") as s:
        s.read("t", torch.tensor([5, 3, 5], device="cuda"))
        s.read("t", torch.tensor([7], device="cuda"))
    assert [ids.tolist() for _, _, ids in Trace.load(tmp_path / "trace").calls()] == [[5, 3, 5], [7]]


@gpu
def test_a_hot_row_trains_on_cuda_as_torch_sparse_sgd(tmp_path):
    """Half of a batch's entries on one row (its gradient is summed in pieces on a GPU,
    tierstore.training.bags.RUN): the same bits run to run, and torch's sparse SGD's rows to rounding."""
    g = torch.Generator().manual_seed(0)
    ids = torch.where(torch.rand(4096, generator=g) < 0.5, 0, torch.randint(0, 1000, (4096,), generator=g)).cuda()
    offsets = torch.arange(0, 4096, 16, device="cuda")
    grad = torch.randn(256, 8, generator=g).cuda()

    def train(path):
        emb = TieredEmbeddingBag(1000, 8, mode="sum", path=path, hbm_rows=1000, device="cuda",
                                 optimizer=optim.SGD(lr=0.1), init=RowInit.normal(0, 1, seed=1))
        start = emb.store.read(emb.table, torch.arange(1000, device="cuda"))
        for _ in range(3):
            emb(ids, offsets).backward(grad)
        rows = emb.store.read(emb.table, torch.arange(1000, device="cuda"))
        emb.close()
        return start, rows

    start, rows = train(tmp_path / "a")
    assert torch.equal(rows, train(tmp_path / "b")[1])
    ref = torch.nn.EmbeddingBag(1000, 8, mode="sum", sparse=True, device="cuda")
    with torch.no_grad():
        ref.weight.copy_(start)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ref(ids, offsets).backward(grad)
        opt.step()
    assert not torch.equal(start, rows)
    torch.testing.assert_close(rows, ref.weight.detach(), rtol=1e-5, atol=1e-5)


def _zipf_batches(rows: int, steps: int, bags: int, pooling: int, device, seed: int = 7):
    rng = np.random.default_rng(seed)
    offsets = torch.arange(0, bags * pooling, pooling, device=device)
    return [(torch.from_numpy(rng.zipf(1.1, bags * pooling) % rows).to(device), offsets) for _ in range(steps)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_small_cache_at_every_depth_trains_the_resident_bits(tmp_path, device):
    """A table whose HBM tier holds 5% of it, fed by LookaheadLoader at depths 0 to 3 (at
    depth 3 the batches ahead need more rows than the tier holds, so rows of steps in
    flight compete for its slots), and a table with no HBM tier: every row and its
    Adagrad state end bit-identical to the same table trained with every row resident."""
    rows = 4000
    batches = _zipf_batches(rows, 16, 24, 8, device)
    touched = torch.unique(torch.cat([ids.cpu() for ids, _ in batches]))

    def train(name, hbm_rows, ddr_rows, depth):
        emb = TieredEmbeddingBag(rows, 8, mode="sum", path=tmp_path / name, hbm_rows=hbm_rows, ddr_rows=ddr_rows,
                                 device=device, optimizer=optim.Adagrad(lr=0.1), init=RowInit.normal(0, 0.5, seed=8))
        for ids, offsets in (LookaheadLoader(batches, emb, depth=depth) if depth else batches):
            (emb(ids, offsets) * torch.linspace(-1, 1, 8, device=ids.device)).pow(2).sum().backward()
        got = emb.store.read(emb.table, torch.arange(rows), with_state=True).cpu()
        emb.close()
        return got

    resident = train("resident", rows, 0, 0)
    assert resident[touched, 8:].gt(0).any(1).all()  # every row the batches touched was trained (its Adagrad sum)
    assert len(touched) > 3 * rows // 20  # the batches' rows outgrow the HBM tier
    for depth in (0, 1, 2, 3):
        assert torch.equal(train(f"cache{depth}", rows // 20, rows // 10, depth), resident), depth
    assert torch.equal(train("ddr", 0, rows // 10, 2), resident)


@gpu
@pytest.mark.parametrize("hbm_rows, depth", [(2000, 0), (600, 2)], ids=["resident", "cached-depth2"])
def test_a_training_step_never_waits_on_the_gpu(tmp_path, hbm_rows, depth):
    """Every row in the HBM tier, or the rows of each batch brought there ahead by a
    LookaheadLoader: the step (lookup, pooling, backward, fused update) runs under
    ``torch.cuda.set_sync_debug_mode("error")``, so nothing in it makes the host wait for
    the GPU (no ``.item()``, no ``nonzero``, no copy to the host); and it trains the bits
    of a store with every row resident, trained without the check."""
    rows = 2000
    batches = _zipf_batches(rows, 8, 32, 8, "cuda")

    def train(name, hbm, checked):
        emb = TieredEmbeddingBag(rows, 16, mode="sum", path=tmp_path / name, hbm_rows=hbm, ddr_rows=rows, device="cuda",
                                 optimizer=optim.SGD(lr=0.1), init=RowInit.normal(0, 0.5, seed=9))
        if hbm == rows:
            emb.store.read(emb.table, torch.arange(rows, device="cuda"))  # every row resident before the first step
        for i, (ids, offsets) in enumerate(LookaheadLoader(batches, emb, depth=depth) if depth else batches):
            if checked and i > 0:  # the first step may set up what it keeps (buffers, compiled code)
                torch.cuda.set_sync_debug_mode("error")
            try:
                emb(ids, offsets).pow(2).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        got = emb.store.read(emb.table, torch.arange(rows), with_state=True).cpu()
        emb.close()
        return got

    assert torch.equal(train("checked", hbm_rows, checked=True), train("resident", rows, checked=False))
