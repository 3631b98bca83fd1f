"""The policies' victims on tiers large enough that only values up to a sampled bound are partitioned."""
import numpy as np
import pytest

from tierstore.eviction.policies import LFUPolicy, LRUPolicy, kth_smallest, smallest

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
