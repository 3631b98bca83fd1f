"""Rows resident in the DDR tier (hbm_rows=0, FBGEMM's EmbeddingLocation.HOST) train as
rows resident in the HBM tier do: the same bits, through the same in-place step, and
`tierstore bench peers --tier ddr` times the two side by side against FBGEMM."""
import re
import warnings

import pytest
import torch

import tierstore
from tierstore.training import fbgemm

ROWS, DIM, BAGS = 400, 8, 24
OPTIMIZERS = {
    "sgd": lambda: tierstore.optim.SGD(lr=0.3),
    "adagrad": lambda: tierstore.optim.Adagrad(lr=0.3, eps=1e-8),
    "rowwise": lambda: tierstore.optim.RowWiseAdagrad(lr=0.3, eps=1e-8),
}
KERNELS = ["torch", pytest.param("fbgemm", marks=pytest.mark.skipif(
    not fbgemm.installed(), reason="FBGEMM (optional peer) is not installed: pip install 'tierstore[fbgemm]'"))]


def _batches(n):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        sizes = torch.randint(0, 9, (BAGS,), generator=g)
        ids = (torch.rand(int(sizes.sum()), generator=g) ** 3 * ROWS).long()  # skewed: repeats within a batch
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
        out.append((ids, offsets, torch.randn(BAGS, DIM, generator=g)))
    return out


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_ddr_resident_rows_train_as_hbm_resident_rows(tmp_path, kernels, optimizer, policy):
    """Every row in the DDR tier, none in HBM: the rows, their state and the use counts
    equal those of the same training with every row in the HBM tier, bit for bit, and
    no row moves between the tiers and LMDB while it trains."""
    tiers = {"hbm": dict(hbm_rows=ROWS), "ddr": dict(hbm_rows=0, ddr_rows=ROWS)}
    embs = {name: tierstore.TieredEmbeddingBag(ROWS, DIM, mode="sum", path=tmp_path / name, optimizer=OPTIMIZERS[optimizer](),
                                               policy=policy, init=tierstore.RowInit.normal(0, 0.1, seed=5), device="cpu",
                                               kernels=kernels, **sizes)
            for name, sizes in tiers.items()}
    for emb in embs.values():
        emb.store.read(emb.table, torch.arange(ROWS))  # every row resident
    before = {name: emb.store.stats() for name, emb in embs.items()}
    for ids, offsets, grad in _batches(10):
        for emb in embs.values():
            emb(ids, offsets).backward(grad)
    rows = {name: emb.store.read(emb.table, torch.arange(ROWS), with_state=True) for name, emb in embs.items()}
    assert torch.equal(rows["hbm"], rows["ddr"])
    stats = {name: emb.store.stats() for name, emb in embs.items()}
    for name, level in (("hbm", "hbm"), ("ddr", "ddr")):
        assert stats[name][level]["misses"] == before[name][level]["misses"]  # every step's rows were resident
        assert stats[name][level]["evictions"] == 0
        assert stats[name]["ssd"]["reads"] == before[name]["ssd"]["reads"]
    assert stats["ddr"]["ddr"]["hits"] - before["ddr"]["ddr"]["hits"] == stats["hbm"]["hbm"]["hits"] - before["hbm"]["hbm"]["hits"]
    for emb in embs.values():
        emb.close()


@pytest.mark.skipif(not fbgemm.installed(), reason="FBGEMM (optional peer) is not installed: pip install 'tierstore[fbgemm]'")
def test_bench_peers_times_the_ddr_resident_step_beside_the_hbm_resident_one(capsys, tmp_path):
    """`tierstore bench peers --tier ddr`: each optimizer's step with the rows in the HBM tier and
    with every row in the DDR tier, both against FBGEMM's step timed in the same rounds, and
    the DDR-resident rows trained to FBGEMM's bits. Tiny sizes: only what it prints."""
    from tierstore.tools import cli

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["bench", "peers", "--tier", "ddr", "--rows", "2000", "--batch", "256", "--repeat", "1",
                         "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "resident in=HBM tier (hbm_rows=working set) and DDR tier (hbm_rows=0, ddr_rows=rows)" in out
    for name in ("SGD", "RowWiseAdagrad", "Adagrad"):
        for tier in ("", ", DDR-resident"):
            line = re.search(rf"\[1 thread\] {name} step{tier} +(.*)", out).group(1)
            assert re.fullmatch(r"tierstore \(torch\) +[\d.]+ ms [\d.]+x   tierstore \(fbgemm\) +[\d.]+ ms [\d.]+x   FBGEMM +[\d.]+ ms", line)
        assert re.search(rf"{name} check \(fbgemm\), DDR-resident +max \|tierstore - FBGEMM\| over trained rows 0.0e\+00", out)
    assert re.search(r"worst training step, tierstore \(fbgemm\), DDR-resident / FBGEMM time: [\d.]+x", out)
