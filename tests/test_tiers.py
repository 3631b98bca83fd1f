"""A tier's eviction plan (CacheTier.make_room), which ranks its per-slot arrays with the
call's slots and the free ones marked UNUSED, against a full sort of the other
occupied slots' keys: unpinned rows first, then (lookahead) farthest next use, then
the base policy."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.eviction import make_policy
from tierstore.eviction.lookahead import NOT_IN_WINDOW
from tierstore.tiers import CacheTier


def expected_victims(tier: CacheTier, hits: np.ndarray, k: int, next_use: np.ndarray | None) -> set[int]:
    cand = np.setdiff1d(np.flatnonzero(tier.ids.numpy() >= 0), hits)
    last, freq = tier.last.numpy()[cand], tier.freq.numpy()[cand]
    nu = np.full(len(cand), NOT_IN_WINDOW) if next_use is None else next_use[cand]
    pinned = nu != NOT_IN_WINDOW
    farthest_first = -np.where(pinned, nu, 0) if tier.lookahead else np.zeros(len(cand), dtype=np.int64)
    by_frequency = freq if tier.policy.uses_frequency else np.zeros(len(cand), dtype=np.int64)
    return set(cand[np.lexsort((last, by_frequency, farthest_first, pinned))[:k]].tolist())


@settings(max_examples=300, deadline=None)
@given(data=st.data(), capacity=st.integers(4, 48), policy=st.sampled_from(["lru", "lfu"]), lookahead=st.booleans(),
       window=st.booleans())
def test_victims_are_the_lowest_ranked_other_occupied_rows(data, capacity, policy, lookahead, window):
    tier = CacheTier("ddr", capacity, 2, 0, torch.device("cpu"), make_policy(policy), num_rows=10_000)
    tier.lookahead = lookahead
    clock = iter(np.random.default_rng(data.draw(st.integers(0, 99))).permutation(100_000))
    ids = data.draw(st.lists(st.integers(0, 9_999), min_size=capacity, max_size=capacity, unique=True))
    tier.add(torch.tensor(ids), torch.zeros(capacity, 2), torch.tensor([next(clock) for _ in ids]),
             torch.tensor(data.draw(st.lists(st.integers(1, 4), min_size=capacity, max_size=capacity))),
             torch.zeros(capacity, dtype=torch.bool))
    freed = data.draw(st.lists(st.integers(0, capacity - 1), unique=True, max_size=capacity - 2))
    tier.remove(torch.tensor(freed, dtype=torch.int64))  # free slots: they keep no row to evict
    occupied = np.flatnonzero(tier.ids.numpy() >= 0)
    hits = np.array(data.draw(st.lists(st.sampled_from(occupied.tolist()), unique=True, max_size=len(occupied) - 1)), dtype=np.int64)
    need = data.draw(st.integers(1, len(occupied) - len(hits)))
    next_use = None
    if window:  # per slot, as the prefetcher gives it: free slots are in no batch
        next_use = np.array([data.draw(st.sampled_from([NOT_IN_WINDOW, 1, 2, 3])) for _ in range(capacity)], dtype=np.int64)
        next_use[tier.ids.numpy() < 0] = NOT_IN_WINDOW
    n = len(hits) + tier.free + need
    keep, victims = tier.make_room(torch.from_numpy(hits), tier.free + need, torch.arange(n), torch.ones(n, dtype=torch.int64),
                                   (lambda: next_use) if window else None)
    assert bool(keep.all())
    assert len(victims) == need and set(victims.tolist()) == expected_victims(tier, hits, need, next_use)
