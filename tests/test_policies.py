"""The policies' victims on tiers large enough that only values up to a sampled bound are partitioned."""
import numpy as np
import pytest

from tierstore.eviction import UNUSED, EvictionPolicy, make_policy, register
from tierstore.eviction.policies import LFUPolicy, LRUPolicy, kth_smallest, smallest

from policy_examples import CONTRACT_POLICIES, policy_named  # noqa: F401 (a fixture)

N = 50_000


def values_named(name: str) -> np.ndarray:
    if name == "random":
        return np.random.default_rng(0).permutation(N)
    if name == "ascending":
        return np.arange(N)
    if name == "descending":
        return np.arange(N)[::-1].copy()
    out = np.arange(N) + N  # the strided sample holds the smallest values: its bound holds too few
    out[:: N // 4096] = np.arange(len(out[:: N // 4096]))
    return out


@pytest.mark.parametrize("name", ["random", "ascending", "descending", "sample-holds-the-smallest"])
@pytest.mark.parametrize("k", [1, 100, 4000, N // 4, N - 1])
def test_smallest_are_the_k_smallest(name, k):
    values = values_named(name)
    got = smallest(values, k)
    assert len(got) == k == len(set(got.tolist()))
    assert np.array_equal(np.sort(values[got]), np.sort(values)[:k])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 300, 5000])
def test_victims_equal_a_full_sort(seed, k):
    """LRU: the k least recent; LFU: the k least frequent, ties least recent first (a lexsort of all)."""
    rng = np.random.default_rng(seed)
    last = rng.permutation(3 * N)[:N]
    freq = rng.integers(1, 4, N) if seed % 2 else rng.zipf(1.5, N)
    assert set(LRUPolicy().select(last, freq, k).tolist()) == set(np.argsort(last)[:k].tolist())
    assert set(LFUPolicy().select(last, freq, k).tolist()) == set(np.lexsort((last, freq))[:k].tolist())


@pytest.mark.parametrize("name", ["step counts", "distinct", "one value", "sample-holds-the-smallest"])
@pytest.mark.parametrize("k", [1, 100, 4000, N // 2, N])
def test_kth_smallest_is_the_kth_of_a_sort(name, k):
    rng = np.random.default_rng(3)
    values = {"step counts": rng.zipf(1.3, N), "distinct": rng.permutation(N), "one value": np.full(N, 7),
              "sample-holds-the-smallest": values_named("sample-holds-the-smallest")}[name]
    assert kth_smallest(values, k) == np.sort(values)[k - 1]


# -- the policy contract, for every registered policy and one registered here ---------------------------------
@pytest.mark.parametrize("policy_named", CONTRACT_POLICIES, indirect=True)
@pytest.mark.parametrize("seed", range(3))
def test_victims_are_the_rows_of_smallest_order_and_free_slots_go_last(policy_named, seed):
    policy = make_policy(policy_named)
    rng = np.random.default_rng(seed)
    n = 3000 if seed else 40_000  # a large tier takes the sampled-bound paths
    last = rng.permutation(n).astype(np.int64)
    freq = rng.integers(1, 5, n)  # step counts: mostly ties
    free = rng.random(n) < 0.1
    last[free], freq[free] = UNUSED, UNUSED
    by_order = sorted(range(n), key=lambda i: policy.order(int(last[i]), int(freq[i])))
    for k in (1, 17, n // 3, int((~free).sum())):
        assert sorted(policy.select(last, freq, k).tolist()) == sorted(by_order[:k]), (policy_named, k)


def test_register_refuses_a_taken_name_and_a_class_that_is_no_policy():
    with pytest.raises(ValueError, match="named 'lru' exists already"):
        register(type("Other", (LRUPolicy,), {}))
    with pytest.raises(ValueError, match="'lookahead' exists already"):
        register(type("Look", (EvictionPolicy,), {"name": "lookahead"}))
    with pytest.raises(TypeError, match="EvictionPolicy subclass"):
        register(object)
