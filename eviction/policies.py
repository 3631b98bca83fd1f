"""Eviction policies: which resident rows leave a tier.

A policy sees only per-row metadata as numpy arrays: ``last``, the use clock of
the row's most recent use (unique per row, larger is more recent), and
``freq``, the number of steps that used it since it entered the cache. It knows
nothing of rows, tensors, tiers or disks, so the store and the capacity
simulator share it and agree to the row.
"""
from __future__ import annotations

import numpy as np

from tierstore.errors import ArgumentTypeError, SettingError


_SAMPLE = 4096  # values read to bound the k smallest


def smallest(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of ``k`` smallest ``values`` (0 < k < len(values)), in no order: with
    unique values, the k smallest.

    Partitioning a whole tier's values each step does not scale: np.argpartition over
    1M took 9 ms, one comparison pass 0.24 ms. So a bound is read off a strided sample,
    where ~2k values should lie below it, and only the values up to the bound are
    partitioned; where fewer than k lie there, all of them are. Exact either way."""
    n = len(values)
    if n >= 8 * _SAMPLE and 4 * k <= n:
        sample = values[:: n // _SAMPLE]
        j = min(len(sample) - 1, 2 * k * len(sample) // n + 8)
        candidates = np.flatnonzero(values <= np.partition(sample, j)[j])
        if len(candidates) >= k:
            return candidates[np.argpartition(values[candidates], k - 1)[:k]]
    return np.argpartition(values, k - 1)[:k]


def kth_smallest(values: np.ndarray, k: int) -> int:
    """The k-th smallest of ``values`` (1 <= k <= len(values)). Step counts are mostly
    ties (most rows of a large tier were used once): the value read off a strided
    sample is then usually the answer, checked by two comparison passes, where the
    k smallest positions would partition most of the tier (23 ms a step at 1M slots)."""
    n = len(values)
    if n >= 8 * _SAMPLE:
        sample = values[:: n // _SAMPLE]
        j = min(len(sample) - 1, k * len(sample) // n)
        guess = np.partition(sample, j)[j]
        below = np.count_nonzero(values < guess)
        if below < k <= below + np.count_nonzero(values == guess):
            return guess
    return values[smallest(values, k)].max()


class EvictionPolicy:
    """What a policy brings: :meth:`victims`, the rows it evicts from a tier's metadata
    arrays, and :meth:`order`, the same ranking for one row, as a sortable key (the
    capacity simulator keeps rows in heaps by it). A new policy is a subclass with a
    unique ``name``, registered with :func:`register`: the store, ``tierstore capacity``
    and the conformance tests (tests/test_policies.py) then take it by name.

    The contract, checked by those tests: ``victims(last, freq, k)`` are the k rows of
    smallest ``order``; ``last`` is unique per row, so that order is total; and a slot
    whose ``last`` and ``freq`` are both :data:`UNUSED` (a free slot, or a row the store
    must keep) ranks after every row."""

    name = "base"
    uses_frequency = True  # False lets the store skip counting steps on its hot path

    def victims(self, last: np.ndarray, freq: np.ndarray, k: int) -> np.ndarray:
        """Positions (into ``last``/``freq``) of the ``k`` rows to evict."""
        raise NotImplementedError

    def order(self, last: int, freq: int):
        """One row's rank as a sortable key: rows of smaller keys are evicted first."""
        raise NotImplementedError

    def select(self, last: np.ndarray, freq: np.ndarray, k: int) -> np.ndarray:
        n = len(last)
        if k <= 0:
            return np.empty(0, dtype=np.int64)
        if k >= n:
            return np.arange(n, dtype=np.int64)
        return self.victims(last, freq, k).astype(np.int64, copy=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# the use clock and step count of a slot that holds no row: every policy ranks it after every row
UNUSED = np.iinfo(np.int64).max

POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(policy: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Makes ``policy`` choosable by its ``name`` everywhere a policy is named (a class
    decorator)."""
    if not (isinstance(policy, type) and issubclass(policy, EvictionPolicy)):
        raise ArgumentTypeError(f"register takes an EvictionPolicy subclass, got {policy!r}")
    if policy.name in POLICIES or policy.name in ("base", "lookahead", "belady"):
        raise SettingError(f"an eviction policy named {policy.name!r} exists already; give {policy.__name__} another name")
    POLICIES[policy.name] = policy
    return policy


@register
class LRUPolicy(EvictionPolicy):
    """Evict the least recently used rows."""

    name = "lru"
    uses_frequency = False

    def victims(self, last, freq, k):
        # use clocks are unique, so the k smallest are a well-defined set
        return smallest(last, k)

    def order(self, last, freq):
        return last


@register
class LFUPolicy(EvictionPolicy):
    """Evict the least frequently used rows, ties broken by least recent use.

    Frequencies count steps while the row is cached (in any tier; they move with
    the row between tiers) and are forgotten when the row leaves the cache, as in
    cachetools.LFUCache.
    """

    name = "lfu"

    def victims(self, last, freq, k):
        threshold = kth_smallest(freq, k)
        below = np.flatnonzero(freq < threshold)
        tied = np.flatnonzero(freq == threshold)
        need = k - len(below)
        if need < len(tied):
            tied = tied[smallest(last[tied], need)]
        return np.concatenate([below, tied])

    def order(self, last, freq):
        return (freq, last)


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise SettingError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
