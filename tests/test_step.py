"""The cache step's planner (tierstore.engine.step), once, against independent oracles: cachetools'
LRUCache/LFUCache for one tier, the plain-Python model of the two tiers (cache_model.py),
and a full sort of the candidates' keys for the victims a tier picks. The planner runs
here without rows, through the capacity simulator's slot arrays (CacheSim) or over a
CacheTier's metadata; the stores running it are checked against the same oracles in
test_oracle.py, test_store_model.py and test_capacity.py."""
import numpy as np
import pytest
import torch
from cache_model import CacheModel
from cachetools import LFUCache, LRUCache
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.capacity.cachesim import CacheSim
from tierstore.eviction import make_policy
from tierstore.eviction.lookahead import NOT_IN_WINDOW
from tierstore.engine.step import StepPlanner
from tierstore.engine.tiers import CacheTier

SPACE = 64


def run_call(sim: CacheSim, call: list[int], clock: int) -> None:
    """One read call as the store steps it: unique ids, each used at its first position."""
    first = dict.fromkeys(call)
    pos = {x: call.index(x) for x in first}
    u = np.array(sorted(first), dtype=np.int64)
    sim.call(u, np.array([clock + pos[x] for x in u.tolist()], dtype=np.int64), 0)


@settings(max_examples=40, deadline=None)
@given(stream=st.lists(st.integers(0, SPACE - 1), min_size=1, max_size=200), size=st.integers(1, 10),
       policy=st.sampled_from(["lru", "lfu"]), top=st.booleans())
def test_one_id_calls_through_one_tier_are_cachetools(stream, size, policy, top):
    sim = CacheSim(SPACE, size if top else 0, 0 if top else size, make_policy(policy))
    cache, hits = (LRUCache if policy == "lru" else LFUCache)(size), 0
    for clock, x in enumerate(stream):
        run_call(sim, [x], clock)
        if x in cache:
            hits += 1
            cache[x]  # a use
        else:
            cache[x] = True
    counts = sim.counts
    assert (counts.hbm_hits if top else counts.ddr_hits) == hits


def placement(sim: CacheSim) -> tuple[set, set]:
    return set(np.flatnonzero(sim.where == 1).tolist()), set(np.flatnonzero(sim.where == 2).tolist())


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.lists(st.integers(0, SPACE - 1), min_size=1, max_size=24), min_size=1, max_size=30),
       h=st.integers(0, 10), d=st.integers(0, 14), policy=st.sampled_from(["lru", "lfu"]))
def test_two_tier_steps_are_the_plain_model(calls, h, d, policy):
    """Where every row is after each call, the hit and miss counts, and the evictions
    read off the placements: rows leaving HBM; rows leaving the cache from DDR, or from
    HBM by way of DDR."""
    sim, model = CacheSim(SPACE, h, d, make_policy(policy)), CacheModel(h, d, policy)
    clock = 0
    for call in calls:
        hbm, ddr = placement(sim)
        before = vars(sim.counts).copy()
        run_call(sim, call, clock)
        model.read(call)
        clock += len(call)
        after_h, after_d = placement(sim)
        assert (after_h, after_d) == (set(model.hbm), set(model.ddr))
        c = sim.counts
        if h:
            assert (c.hbm_hits, c.hbm_misses) == tuple(model.counts["hbm"])
            assert c.hbm_evictions - before["hbm_evictions"] == len(hbm - after_h)
        if d:
            assert (c.ddr_hits, c.ddr_misses) == tuple(model.counts["ddr"])
            cached = after_h | after_d
            left = len(ddr - cached) + len((hbm - set(call)) - cached)
            assert c.ddr_evictions - before["ddr_evictions"] == left


def expected_victims(tier: CacheTier, hits: np.ndarray, k: int, next_use: np.ndarray | None) -> set[int]:
    cand = np.setdiff1d(np.flatnonzero(tier.ids.numpy() >= 0), hits)
    last, freq = tier.last.numpy()[cand], tier.freq.numpy()[cand]
    nu = np.full(len(cand), NOT_IN_WINDOW) if next_use is None else next_use[cand]
    pinned = nu != NOT_IN_WINDOW
    farthest_first = -np.where(pinned, nu, 0) if tier.lookahead else np.zeros(len(cand), dtype=np.int64)
    by_frequency = freq if tier.policy.uses_frequency else np.zeros(len(cand), dtype=np.int64)
    return set(cand[np.lexsort((last, by_frequency, farthest_first, pinned))[:k]].tolist())


def filled_tier(data, name: str, capacity: int, policy: str, ids: list[int], clock) -> CacheTier:
    tier = CacheTier(name, capacity, 2, 0, torch.device("cpu"), make_policy(policy), num_rows=10_000)
    n = len(ids)
    tier.add(torch.tensor(ids, dtype=torch.int64), torch.zeros(n, 2), torch.tensor([next(clock) for _ in ids], dtype=torch.int64),
             torch.tensor(data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)), dtype=torch.int64),
             torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool))
    return tier


@settings(max_examples=100, deadline=None)
@given(data=st.data(), capacity=st.integers(4, 48), policy=st.sampled_from(["lru", "lfu"]), lookahead=st.booleans(),
       window=st.booleans())
def test_victims_are_the_lowest_ranked_other_occupied_rows(data, capacity, policy, lookahead, window):
    """Ranking the per-slot arrays (the call's slots and free ones UNUSED) picks what a full
    sort of the other occupied rows' keys does: unpinned rows first, then (lookahead)
    farthest next use, then the base policy."""
    clock = iter(np.random.default_rng(data.draw(st.integers(0, 99))).permutation(100_000))
    ids = data.draw(st.lists(st.integers(0, 9_999), min_size=capacity, max_size=capacity, unique=True))
    tier = filled_tier(data, "ddr", capacity, policy, ids, clock)
    tier.lookahead = lookahead
    freed = data.draw(st.lists(st.integers(0, capacity - 1), unique=True, max_size=capacity - 2))
    tier.remove(torch.tensor(freed, dtype=torch.int64))  # free slots: they keep no row to evict
    occupied = np.flatnonzero(tier.ids.numpy() >= 0)
    hits = np.array(data.draw(st.lists(st.sampled_from(occupied.tolist()), unique=True, max_size=len(occupied) - 1)), dtype=np.int64)
    need = data.draw(st.integers(1, len(occupied) - len(hits)))
    next_use = None
    if window:  # per slot, as the prefetcher gives it: free slots are in no batch
        next_use = np.array([data.draw(st.sampled_from([NOT_IN_WINDOW, 1, 2, 3])) for _ in range(capacity)], dtype=np.int64)
        next_use[tier.ids.numpy() < 0] = NOT_IN_WINDOW
    n_new = tier.free + need
    slot = np.concatenate([hits, np.full(n_new, -1)])
    plan = StepPlanner().plan(None, tier, np.arange(len(slot)), np.full(len(slot), -1), slot,
                              next_use=(lambda t: next_use) if window else None)
    assert plan.ddr.keep.all()
    assert len(plan.ddr.evict) == need and set(plan.ddr.evict.tolist()) == expected_victims(tier, hits, need, next_use)
    if window:  # asking the window about the victims first picks the same rows
        named = set(tier.ids.numpy()[next_use != NOT_IN_WINDOW].tolist())
        asked = StepPlanner().plan(None, tier, np.arange(len(slot)), np.full(len(slot), -1), slot,
                                   next_use=lambda t: next_use, in_window=lambda ids: np.isin(ids, list(named)))
        assert set(asked.ddr.evict.tolist()) == set(plan.ddr.evict.tolist())


@settings(max_examples=150, deadline=None)
@given(data=st.data(), h=st.integers(1, 12), d=st.integers(1, 24), policy=st.sampled_from(["lru", "lfu"]),
       lookahead=st.booleans())
def test_asking_the_window_about_victims_plans_as_ranking_every_slot(data, h, d, policy, lookahead):
    """StepPlanner.plan with in_window (the policy's victims asked first, HBM's demoted rows among
    DDR's candidates) makes the plan that next_use for every slot makes: the same evictions,
    demotions kept or dropped, rows kept in each tier."""
    clock = iter(range(100_000))
    ids = data.draw(st.lists(st.integers(0, 99), min_size=h + d, max_size=h + d, unique=True))
    n_h, n_d = data.draw(st.integers(0, h)), data.draw(st.integers(0, d))
    tiers = [filled_tier(data, "hbm", h, policy, ids[:n_h], clock), filled_tier(data, "ddr", d, policy, ids[h:h + n_d], clock)]
    for tier in tiers:
        tier.lookahead = lookahead
    named = np.array(sorted(data.draw(st.lists(st.integers(0, 99), unique=True, max_size=100))), dtype=np.int64)
    steps = np.array(data.draw(st.lists(st.integers(1, 4), min_size=len(named), max_size=len(named))), dtype=np.int64)

    def next_use(tier):  # what the prefetcher gives: each slot's row's step, free slots in none
        out = np.full(tier.capacity, NOT_IN_WINDOW, dtype=np.int64)
        held = tier.ids.numpy()
        at = np.searchsorted(named, held).clip(max=max(len(named) - 1, 0))
        hit = (held >= 0) & (named[at] == held) if len(named) else np.zeros(len(held), dtype=bool)
        out[hit] = steps[at[hit]]
        return out

    uid = np.array(sorted(data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=h + d, unique=True))))
    slot_h, slot_d = (t.lookup(torch.from_numpy(uid)).numpy() for t in tiers)
    plans = [StepPlanner().plan(*tiers, np.arange(len(uid)) + 200_000, slot_h, slot_d, next_use=next_use, **extra)
             for extra in ({}, {"in_window": lambda ids: np.isin(ids, named)})]
    assert canonical(plans[1]) == canonical(plans[0])


@pytest.mark.parametrize("named_tier", ["hbm", "ddr"])
def test_rows_hbm_demotes_are_asked_about_by_their_own_ids(named_tier):
    """A full HBM tier of the oldest rows demotes them into a full DDR tier, which must evict as
    many: with HBM's rows named by the window DDR keeps them and evicts its own; with DDR's
    named, the demoted rows go. Either way the plan equals next_use's for every slot."""
    clock = iter(range(100_000))
    tiers = []
    for name, ids in (("hbm", range(0, 4)), ("ddr", range(10, 18))):
        tier = CacheTier(name, len(ids), 2, 0, torch.device("cpu"), make_policy("lru"), num_rows=10_000)
        n = len(ids)
        tier.add(torch.tensor(list(ids)), torch.zeros(n, 2), torch.tensor([next(clock) for _ in ids]),
                 torch.ones(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool))
        tiers.append(tier)
    named = np.arange(0, 4) if named_tier == "hbm" else np.arange(10, 18)

    def next_use(tier):
        held = tier.ids.numpy()
        return np.where(np.isin(held, named), 1, NOT_IN_WINDOW).astype(np.int64)

    uid = np.arange(50, 54)  # 4 new rows: HBM makes room by demoting its 4
    slot = np.full(len(uid), -1)
    plans = [StepPlanner().plan(*tiers, np.arange(len(uid)) + 1_000, slot, slot, next_use=next_use, **extra)
             for extra in ({}, {"in_window": lambda ids: np.isin(ids, named)})]
    assert canonical(plans[1]) == canonical(plans[0])
    kept = plans[1].demoted.kept
    assert kept.all() if named_tier == "hbm" else not kept.any()


def canonical(plan) -> dict:
    """A plan as sets and per-row records: which order equal sets come in is no part of it."""
    down = plan.demoted
    out = {"demoted": {int(i): (int(a), int(b), bool(c), bool(k)) for i, a, b, c, k in
                       zip(down.ids, down.last, down.freq, down.dirty, down.kept)},
           "write_back": [sorted(getattr(plan.write_back, f).tolist()) for f in ("call", "hbm", "ddr")]}
    for name in ("hbm", "ddr"):
        level = getattr(plan, name)
        out[name] = (level.keep.tolist(), sorted(level.evict.tolist()), level.evictions)
    return out


@settings(max_examples=80, deadline=None)
@given(data=st.data(), h=st.integers(1, 12), d=st.integers(1, 12), policy=st.sampled_from(["lru", "lfu"]),
       refresh=st.booleans())
def test_a_plan_changes_nothing_and_writes_back_every_dirty_row_leaving(data, h, d, policy, refresh):
    clock = iter(range(100_000))
    ids = data.draw(st.lists(st.integers(0, 99), min_size=h + d, max_size=h + d, unique=True))
    n_h, n_d = data.draw(st.integers(0, h)), data.draw(st.integers(0, d))
    H = filled_tier(data, "hbm", h, policy, ids[:n_h], clock)
    D = filled_tier(data, "ddr", d, policy, ids[h:h + n_d], clock)
    before = [t.clone() for tier in (H, D) for t in (tier.ids, tier.last, tier.freq, tier.dirty, tier._free)]
    uid = np.array(sorted(data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=2 * (h + d), unique=True))))
    slot_h, slot_d = H.lookup(torch.from_numpy(uid)).numpy(), D.lookup(torch.from_numpy(uid)).numpy()
    again = np.array(data.draw(st.lists(st.booleans(), min_size=len(uid), max_size=len(uid)))) if refresh else None
    plan = StepPlanner().plan(H, D, np.arange(len(uid)) + next(clock), slot_h, slot_d, refresh=again)
    after = [t for tier in (H, D) for t in (tier.ids, tier.last, tier.freq, tier.dirty, tier._free)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))

    dirty_h, dirty_d = H.dirty.numpy(), D.dirty.numpy()
    leaving = plan.leaving()
    call_dirty = (dirty_h[slot_h] & (slot_h >= 0)) | (dirty_d[slot_d] & (slot_d >= 0))
    if again is not None:
        call_dirty |= again
    down = plan.demoted
    assert set(plan.write_back.call.tolist()) == set(leaving[call_dirty[leaving]].tolist())
    assert set(plan.write_back.hbm.tolist()) == set(down.slots[~down.kept & dirty_h[down.slots]].tolist())
    assert set(plan.write_back.ddr.tolist()) == set(plan.ddr.evict[dirty_d[plan.ddr.evict]].tolist())
    # what the tiers hold after the plan fits them, and each row is in one place
    assert H.resident - len(plan.hbm.leaving()) + len(plan.hbm.entering()) <= h
    assert D.resident - len(plan.ddr.leaving()) + len(plan.ddr.entering()) + down.kept.sum() <= d
    assert not (plan.hbm.keep & plan.ddr.keep).any()
