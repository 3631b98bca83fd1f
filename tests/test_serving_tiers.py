"""The serving store's tiers: a call whose rows one tier holds is pooled there in place, the
DDR tier keeps the rows it sends up, and the tiers evict as their eviction policy
(tierstore.eviction) ranks. Real LMDB; the policies checked against a plain model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tierstore import ServingStore, TableSpec, TieredStore, export
from tierstore.errors import SettingError
from tierstore.eviction import make_policy

N, DIM = 400, 8


@pytest.fixture
def served(tmp_path):
    with TieredStore(tmp_path / "train", tables=[TableSpec("t", N, DIM)], device="cpu") as store:
        store.write("t", np.arange(N), np.random.default_rng(0).normal(0, 1, (N, DIM)).astype(np.float32))
    return export(tmp_path / "train", tmp_path / "serve", dtype="int8")


def _bags(rows: np.ndarray, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.from_numpy(rows)[torch.randint(0, len(rows), (300,), generator=g)]
    return ids, torch.arange(0, 301, 10)


@pytest.mark.parametrize("ddr_rows", [N, 250])  # direct (row id in slot id), and a cache of part of the table
def test_a_call_whose_rows_the_ddr_tier_holds_is_pooled_there(served, ddr_rows):
    """HBM holds some of the rows, DDR every one read: each later call over those rows is
    served whole from DDR (every id a DDR hit, no LMDB read, no row moved), pooled as a
    store without tiers pools them."""
    used = np.random.default_rng(1).choice(N, 200, replace=False)
    with ServingStore(served, hbm_rows=20, ddr_rows=ddr_rows, device="cpu") as s, ServingStore(served) as plain:
        s.rows("t", used)  # 20 go up to HBM; DDR keeps all 200
        before = s.stats()["t"]
        assert before["hbm_resident"] == 20 and before["ddr_resident"] == 200
        for seed in range(4):
            ids, offsets = _bags(used, seed)
            assert torch.equal(s.lookup("t", ids, offsets), plain.lookup("t", ids, offsets))
        after = s.stats()["t"]
        assert after["ddr_hits"] - before["ddr_hits"] == 4 * 300
        assert after["lmdb_reads"] == before["lmdb_reads"] and after["hbm_hits"] == before["hbm_hits"]
        assert (after["hbm_resident"], after["ddr_resident"]) == (20, 200)


class _Model:
    """A tier of ``capacity`` rows as a dict {id: (last, freq)}: the misses of a call come in,
    over the resident rows of smallest policy.order, except the call's own."""

    def __init__(self, capacity: int, policy: str):
        self.capacity, self.policy, self.rows = capacity, make_policy(policy), {}

    def call(self, ids: set[int], clock: int) -> int:
        """Rows read from LMDB."""
        misses = sorted(ids - self.rows.keys())
        for i in ids & self.rows.keys():
            last, freq = self.rows[i]
            self.rows[i] = (clock, freq + 1)
        over = len(self.rows) + len(misses) - self.capacity
        if over > 0:
            ranked = sorted((self.policy.order(*self.rows[i]), i) for i in self.rows.keys() - ids)
            for _, i in ranked[:over]:
                del self.rows[i]
        self.rows.update({i: (clock, 1) for i in misses[: self.capacity]})
        return len(misses)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("tiers", [dict(hbm_rows=12), dict(ddr_rows=12)])
def test_tiers_evict_as_their_policy_ranks(served, policy, tiers):
    """Calls of one skewed id (a call's rows share its use clock: the order between them is
    the policy's to break) through a tier of 12 rows: each reads a row from LMDB exactly when
    a dict model that evicts by the policy's order lacks it."""
    rng = np.random.default_rng(2)
    model = _Model(12, policy)
    with ServingStore(served, device="cpu", policy=policy, **tiers) as s:
        for clock in range(1, 400):
            ids = (rng.pareto(1.2, 1) * 4).astype(np.int64) % 40
            before = s.stats()["t"]["lmdb_reads"]
            s.rows("t", ids)
            assert s.stats()["t"]["lmdb_reads"] - before == model.call(set(ids.tolist()), clock), clock


def test_an_unknown_policy_is_refused_naming_the_policies(served):
    with pytest.raises(SettingError, match="unknown eviction policy 'mru'.*lfu.*lru"):
        ServingStore(served, hbm_rows=10, policy="mru")
