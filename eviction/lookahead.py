"""Lookahead eviction: rank rows by their next use inside a window of future batches.

A caller that knows the next K batches (a prefetch queue, or an offline trace)
passes, per candidate row, the index of the step that next uses it, or
:data:`NOT_IN_WINDOW` when no step in the window does. Victims are then chosen:

1. rows with no use in the window first, ranked by the base policy (lru/lfu),
   so they are evicted while any such row remains: in-window rows are pinned;
2. then in-window rows, farthest next use first (Belady's rule inside the
   window); rows whose next use falls on the same step are ranked by the base
   policy, so the choice is deterministic.

With an infinite window this is Belady's MIN (farthest next use evicted first).
Numpy only, like the other policies: the store and the capacity
simulator share it and agree to the row.
"""
from __future__ import annotations

import numpy as np

from .policies import EvictionPolicy

from tierstore.errors import BadValuesError, SettingError

NOT_IN_WINDOW = np.iinfo(np.int64).max  # next_use of a row the window does not use


def lookahead_victims(
    next_use: np.ndarray, last: np.ndarray, freq: np.ndarray, k: int, base_policy: EvictionPolicy
) -> np.ndarray:
    """Positions (into the candidate arrays) of the ``k`` rows to evict.

    ``next_use``: step index of each candidate's next use, ``NOT_IN_WINDOW`` for
    none in the window; ``last``/``freq`` as for every policy (unique ``last``).
    """
    n = len(next_use)
    if not (len(last) == len(freq) == n):
        raise BadValuesError(f"next_use, last and freq must have one entry per candidate, got {n}, {len(last)}, {len(freq)}")
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    next_use = np.asarray(next_use)
    outside = np.flatnonzero(next_use == NOT_IN_WINDOW)
    if len(outside) >= k:
        return outside[base_policy.select(last[outside], freq[outside], k)]
    need = k - len(outside)
    inside = np.flatnonzero(next_use != NOT_IN_WINDOW)
    nu = next_use[inside]
    cut = len(nu) - need  # the need-th farthest next use is the threshold
    threshold = np.partition(nu, cut)[cut]
    farther = inside[nu > threshold]
    tied = inside[nu == threshold]
    rest = need - len(farther)
    if rest < len(tied):
        tied = tied[base_policy.select(last[tied], freq[tied], rest)]
    return np.concatenate([outside, farther, tied]).astype(np.int64, copy=False)


class LookaheadPolicy:
    """Lookahead ranking over a base policy; ``victims`` takes ``next_use`` too."""

    name = "lookahead"

    def __init__(self, base_policy: EvictionPolicy, window: int | None):
        if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
            raise SettingError(f"lookahead window must be an int >= 1 batches (None = infinite, Belady), got {window!r}")
        self.base = base_policy
        self.window = window

    def next_use_in_window(self, next_step: np.ndarray, now: int) -> np.ndarray:
        """Map absolute next-use steps to ``next_use`` (``NOT_IN_WINDOW`` past now + window)."""
        if self.window is None:
            return next_step
        return np.where(next_step <= now + self.window, next_step, NOT_IN_WINDOW)

    def select(self, next_use, last, freq, k) -> np.ndarray:
        return lookahead_victims(next_use, last, freq, k, self.base)

    def __repr__(self) -> str:
        return f"LookaheadPolicy(base={self.base!r}, window={self.window})"
