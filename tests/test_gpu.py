"""The HBM tier on CUDA: same rows and counts as the CPU store. Skipped without CUDA."""
import numpy as np
import pytest
import torch

from tierstore import RowInit, TableSpec, TieredStore

pytestmark = pytest.mark.gpu


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
        assert g.stats() == c.stats()


def test_cuda_all_hit_read_stays_on_device(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 10_000, 32)], hbm_rows=10_000, device="cuda") as s:
        ids = torch.arange(10_000, device="cuda")
        s.read("t", ids)
        out = torch.empty((10_000, 32), device="cuda")
        assert s.read("t", ids.flip(0), out=out) is out
        assert s.stats()["hbm"]["hits"] == 10_000
