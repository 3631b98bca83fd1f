"""kernels="fbgemm": FBGEMM's fused backward on tierstore's rows, against FBGEMM's
own SplitTableBatchedEmbeddingBagsCodegen as the oracle, bit for bit, whatever
rows the tiers hold and however far ahead prefetch runs."""
import warnings

import pytest
import torch

import tierstore
from tierstore.engine.prefetch import LookaheadLoader

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # FBGEMM warns about its CPU-only build on import
    fbgemm_gpu = pytest.importorskip("fbgemm_gpu", reason="FBGEMM (optional peer) is not installed: pip install 'tierstore[fbgemm]'")
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)

ROWS, DIM, BAGS = 300, 8, 16
OPTIMIZERS = {
    "sgd": (lambda: tierstore.optim.SGD(lr=0.3), OptimType.EXACT_SGD),
    "adagrad": (lambda: tierstore.optim.Adagrad(lr=0.3, eps=1e-8), OptimType.EXACT_ADAGRAD),
    "rowwise": (lambda: tierstore.optim.RowWiseAdagrad(lr=0.3, eps=1e-8), OptimType.EXACT_ROWWISE_ADAGRAD),
}


def batches(n, weighted):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        sizes = torch.randint(0, 7, (BAGS,), generator=g)  # empty bags too
        ids = (torch.rand(int(sizes.sum()), generator=g) ** 3 * ROWS).long()  # skewed: repeats within a batch
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
        psw = torch.rand(len(ids), generator=g) + 0.5 if weighted else None
        out.append((ids, offsets, psw, torch.randn(BAGS, DIM, generator=g)))
    return out


def fbgemm_oracle(optim_type, mode, opt, weights):
    m = SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=optim_type,
        pooling_mode=PoolingMode.SUM if mode == "sum" else PoolingMode.MEAN, learning_rate=opt.lr,
        eps=getattr(opt, "eps", 1e-8))
    with torch.no_grad():
        m.split_embedding_weights()[0].copy_(weights)
    return m


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("tiers", [dict(hbm_rows=ROWS), dict(ddr_rows=20, depth=0), dict(hbm_rows=8, ddr_rows=24, depth=3)],
                         ids=["resident", "through-lmdb", "two-tiers-prefetch"])
def test_rows_and_state_equal_fbgemms_own_module(tmp_path, optimizer, mode, weighted, tiers):
    make, optim_type = OPTIMIZERS[optimizer]
    tiers = dict(tiers)
    depth = tiers.pop("depth", 0)
    emb = tierstore.TieredEmbeddingBag(ROWS, DIM, mode=mode, path=tmp_path, optimizer=make(), device="cpu",
                                       init=tierstore.RowInit.normal(0, 0.1, seed=5), kernels="fbgemm", **tiers)
    data = batches(12, weighted)
    oracle = fbgemm_oracle(optim_type, mode, emb.optimizer, emb.store.read(emb.table, torch.arange(ROWS)))
    loader = LookaheadLoader(data, emb, depth=depth, ids=lambda b: {emb.table: b[0]})
    for ids, offsets, psw, grad in loader:
        emb(ids, offsets, per_sample_weights=psw).backward(grad)
        fb_offsets = torch.cat([offsets, torch.tensor([len(ids)])])
        oracle(ids, fb_offsets, per_sample_weights=psw).backward(grad)
    rows = emb.store.read(emb.table, torch.arange(ROWS), with_state=True)
    assert torch.equal(rows[:, :DIM], oracle.split_embedding_weights()[0])
    if optimizer != "sgd":
        assert torch.equal(rows[:, DIM:].reshape(-1), oracle.momentum1_host)
    if tiers.get("hbm_rows") != ROWS:
        assert emb.store.stats()["ssd"]["writes"] > 0  # rows did go through LMDB
    emb.close()


def test_fbgemm_and_torch_kernels_agree_to_rounding(tmp_path):
    out = {}
    for kernels in ("torch", "fbgemm"):
        emb = tierstore.TieredEmbeddingBag(ROWS, DIM, mode="sum", path=tmp_path / kernels, ddr_rows=50, device="cpu",
                                           optimizer=tierstore.optim.RowWiseAdagrad(lr=0.3), kernels=kernels)
        for ids, offsets, psw, grad in batches(8, True):
            emb(ids, offsets, per_sample_weights=psw).backward(grad)
        out[kernels] = emb.store.read(emb.table, torch.arange(ROWS), with_state=True)
        emb.close()
    assert not torch.equal(out["torch"], torch.zeros_like(out["torch"]))
    torch.testing.assert_close(out["fbgemm"], out["torch"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer=tierstore.optim.Adam()), "supports the optimizers SGD, Adagrad, RowWiseAdagrad, not Adam"),
    (dict(mode="max"), "mode \"sum\" and \"mean\", not 'max'"),
    (dict(dtype="bfloat16"), "float32 rows, not bfloat16"),
    (dict(kernels="triton"), 'kernels must be "torch" or "fbgemm"'),
])
def test_what_the_kernels_cannot_do_is_refused_before_anything_changes(tmp_path, kwargs, match):
    kwargs = {"optimizer": tierstore.optim.SGD(), "kernels": "fbgemm", **kwargs}
    with pytest.raises(ValueError, match=match):
        tierstore.TieredEmbeddingBag(ROWS, DIM, path=tmp_path, device="cpu", **kwargs)
    with tierstore.TieredStore(tmp_path, [tierstore.TableSpec("other", 10, 2)], device="cpu") as s:  # not left locked
        assert "t0" not in s.tables or s.tables["t0"].dim == DIM


@pytest.mark.parametrize("weighted", [False, True])
def test_float16_sums_pooled_by_fbgemm_equal_the_upcast_rows_pooled(tmp_path, monkeypatch, weighted):
    """With FBGEMM installed, a resident forward of float16 rows with sum pooling pools
    the tier's half rows in place (whatever the kernels): the outputs and the trained
    rows equal, bit for bit, those of upcasting the batch's rows and pooling them
    (FBGEMM not used) and those of the read path (rows through LMDB)."""
    from tierstore.training import fbgemm

    pooled_by_fbgemm = []
    real = fbgemm.pool_half_sum
    monkeypatch.setattr(fbgemm, "pool_half_sum", lambda *a: pooled_by_fbgemm.append(1) or real(*a))
    runs = {}
    for name, tiers, use_fbgemm in (("fbgemm", dict(hbm_rows=ROWS), True), ("upcast", dict(hbm_rows=ROWS), False),
                                    ("read", dict(hbm_rows=4, ddr_rows=8), True)):
        monkeypatch.setattr(fbgemm, "installed", lambda: use_fbgemm)
        emb = tierstore.TieredEmbeddingBag(ROWS, DIM, mode="sum", path=tmp_path / name, dtype="float16", **tiers,
                                           optimizer=tierstore.optim.RowWiseAdagrad(lr=0.3), device="cpu",
                                           init=tierstore.RowInit.normal(0, 1, seed=3))
        outs, before = [], len(pooled_by_fbgemm)
        for ids, offsets, psw, target in batches(12, weighted):
            out = emb(ids, offsets, per_sample_weights=psw)
            outs.append(out.detach().clone())
            (out * target).sum().backward()
        with torch.no_grad():  # forward only: the lookup
            outs += [emb(ids, offsets, per_sample_weights=psw) for ids, offsets, psw, _ in batches(4, weighted)]
        runs[name] = (outs, emb.store.read(emb.table, torch.arange(ROWS), with_state=True), len(pooled_by_fbgemm) - before)
        emb.close()
    assert runs["fbgemm"][2] > 0 and runs["upcast"][2] == 0  # which way each run pooled
    for name in ("upcast", "read"):
        assert all(torch.equal(a, b) for a, b in zip(runs["fbgemm"][0], runs[name][0])), name
        assert torch.equal(runs["fbgemm"][1], runs[name][1]), name
