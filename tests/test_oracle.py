"""Hit counts against cachetools' LRUCache and LFUCache as independent oracles."""
import numpy as np
import pytest
from cachetools import LFUCache, LRUCache
from hypothesis import given
from hypothesis import strategies as st

from tierstore import TableSpec, TieredStore


def cachetools_hits(cache, stream):
    hits = 0
    for x in stream:
        if x in cache:
            hits += 1
            cache[x]  # a use
        else:
            cache[x] = True
    return hits


def zipf_stream(n, rows, alpha, seed):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, rows + 1) ** alpha
    return rng.choice(rows, size=n, p=p / p.sum()).tolist()


@pytest.mark.parametrize("policy, cache_cls", [("lru", LRUCache), ("lfu", LFUCache)])
@pytest.mark.parametrize("seed", [0, 1])
def test_single_id_calls_match_cachetools(tmp_path, policy, cache_cls, seed):
    stream = zipf_stream(3000, 400, 1.0, seed)
    with TieredStore(tmp_path, [TableSpec("t", 400, 1)], hbm_rows=0, ddr_rows=40, policy=policy, device="cpu") as s:
        for x in stream:
            s.read("t", [x])
        assert s.stats()["ddr"]["hits"] == cachetools_hits(cache_cls(40), stream)


@given(stream=st.lists(st.integers(0, 60), min_size=1, max_size=300), h=st.integers(1, 8), d=st.integers(1, 12))
def test_two_tier_lru_is_one_lru_list(tmp_path_factory, stream, h, d):
    # exclusive tiers under LRU: HBM hits are LRUCache(h) hits, all cache hits LRUCache(h + d) hits
    with TieredStore(tmp_path_factory.mktemp("s"), [TableSpec("t", 61, 1)], hbm_rows=h, ddr_rows=d, device="cpu") as s:
        for x in stream:
            s.read("t", [x])
        stats = s.stats()
    assert stats["hbm"]["hits"] == cachetools_hits(LRUCache(h), stream)
    assert stats["hbm"]["hits"] + stats["ddr"]["hits"] == cachetools_hits(LRUCache(h + d), stream)


@pytest.mark.parametrize("policy, cache_cls", [("lru", LRUCache), ("lfu", LFUCache)])
def test_small_batches_stay_close_to_cachetools(tmp_path, policy, cache_cls):
    # batches of 4 against a 200-row tier: in-call semantics (every id of a call is
    # used at one step) may differ from one-at-a-time only at the margins
    stream = zipf_stream(8000, 2000, 1.05, 3)
    calls = [stream[i : i + 4] for i in range(0, len(stream), 4)]
    with TieredStore(tmp_path, [TableSpec("t", 2000, 1)], ddr_rows=200, policy=policy, device="cpu") as s:
        for call in calls:
            s.read("t", call)
        ours = s.stats()["ddr"]["hits"]
    # the store counts each id once per call: feed cachetools each call's unique ids in first-position order
    firsts = [x for call in calls for x in dict.fromkeys(call)]
    theirs = cachetools_hits(cache_cls(200), firsts)
    assert ours != 0 and abs(ours - theirs) <= 0.01 * len(firsts), (ours, theirs)
