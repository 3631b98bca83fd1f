"""LRU stack distances and miss-ratio curves of a trace, exact, under the store's
batch semantics (tierstore/capacity/trace_streams.py).

LRU over (HBM h, DDR d) is one LRU list of h + d rows, HBM its top h. The
*stack distance* of a use is the number of distinct rows of its table whose
last use is more recent, counted against the state before its call (uses of
the same call do not see each other); a first touch has infinite distance. The
use hits HBM iff distance < h, DDR iff h <= distance < h + d. One pass gives
every size: the exact miss-ratio curve (:class:`LruCurve`).

Stack distances use a set of "removed" use positions: a use at position m is
removed once its row is used again, so the distance of a use whose previous use
is at p, in a call starting at b, is (b - p - 1) minus the removed positions in
(p, b). :class:`RemovedSet` answers those counts for a whole batch of uses at a
time (no Python loop per id): calls of different tables are independent and go
through it together (a step of a many-table trace is one batch), and runs of
small calls of one table share a batch with a correction for the removals of
their earlier calls.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tierstore.capacity.progress import ProgressFactory, open_progress
from tierstore.trace import Trace, gather_ranges
from tierstore.capacity.trace_streams import TableStream, build_streams

_ONE = np.uint64(1)


class RemovedSet:
    """A growing set of positions in [0, n) with vectorized rank queries.

    Three levels sized to stay in cache: a bitmap word per 64 positions; per
    word, the count in earlier words of its super block (2**sb words); per super
    block, the count before it (a cumsum after each batch of additions). A
    query is three gathers and a popcount; an addition touches its word, and
    the super blocks it lands in are re-summed once per batch.
    """

    def __init__(self, n: int):
        words = (n >> 6) + 1
        self.sb = int(min(8, max(3, round(math.log2(max(words, 2)) / 2))))
        supers = (words >> self.sb) + 1
        words = supers << self.sb
        self.words = np.zeros(words, dtype=np.uint64)
        self.within = np.zeros(words, dtype=np.int32)  # removed in earlier words of the same super block
        self.per_super = np.zeros(supers, dtype=np.int64)
        self.before = np.zeros(supers, dtype=np.int64)  # removed in earlier super blocks
        self._delta = np.zeros(words, dtype=np.int32)
        self._touched = np.zeros(supers, dtype=bool)

    def count_below(self, x: np.ndarray) -> np.ndarray:
        """Number of members < x, for each x (0 <= x <= n)."""
        x = np.asarray(x, dtype=np.int64)
        w = x >> 6
        low = self.words[w] & ((_ONE << (x & 63).astype(np.uint64)) - _ONE)
        return self.before[x >> (6 + self.sb)] + self.within[w] + np.bitwise_count(low).astype(np.int64)

    def add(self, p: np.ndarray) -> None:
        """Add positions that are distinct and not members yet."""
        p = np.asarray(p, dtype=np.int64)
        if len(p) == 0:
            return
        w = p >> 6
        # distinct unset bits of one word sum to their OR, and add.at is numpy's fast scatter
        np.add.at(self.words, w, _ONE << (p & 63).astype(np.uint64))
        np.add.at(self._delta, w, 1)
        self._touched[p >> (6 + self.sb)] = True
        touched = np.flatnonzero(self._touched)
        self._touched[touched] = False
        delta = self._delta.reshape(-1, 1 << self.sb)
        rows = delta[touched]
        inclusive = np.cumsum(rows, axis=1, dtype=np.int32)
        self.within.reshape(-1, 1 << self.sb)[touched] += inclusive - rows
        self.per_super[touched] += inclusive[:, -1]
        delta[touched] = 0
        np.cumsum(self.per_super[:-1], out=self.before[1:])


def stack_distances(streams: Sequence[TableStream], progress: ProgressFactory | None = None) -> list[np.ndarray]:
    """LRU stack distance of every use of every stream (-1 for a first touch).

    Calls are taken in trace order, in groups answered together: a run of calls
    of different tables (they do not see each other), or a short run of small
    calls that repeats tables, where a use also subtracts the removals made by
    earlier calls of its group (counted from a (queries x calls) prefix table).
    """
    if not streams:
        return []
    n_uses = np.array([s.n_uses for s in streams], dtype=np.int64)
    base = np.zeros(len(streams) + 1, dtype=np.int64)
    np.cumsum(n_uses, out=base[1:])
    total = int(base[-1])
    # every call of every stream, in trace order: (stream, start on the global axis, length, uses seen before)
    call_num = np.concatenate([s.calls for s in streams])
    call_stream = np.repeat(np.arange(len(streams)), [s.n_calls for s in streams])
    call_lo = np.concatenate([base[i] + s.bounds[:-1] for i, s in enumerate(streams)])
    call_len = np.concatenate([np.diff(s.bounds) for s in streams])
    call_q = np.concatenate([np.diff(np.concatenate([[0], np.cumsum(s.prev >= 0)])[s.bounds]) for s in streams])
    order = np.argsort(call_num, kind="stable")
    keep = call_len[order] > 0
    order = order[keep]
    call_stream, call_lo, call_len, call_q = call_stream[order], call_lo[order], call_len[order], call_q[order]
    # the uses in trace order, their previous use and their call's start, on the global axis
    coords = gather_ranges(np.arange(total, dtype=np.int64), call_lo, call_len)
    prev_global = np.concatenate([np.where(s.prev >= 0, s.prev + base[i], -1) for i, s in enumerate(streams)])
    prev_o = prev_global[coords]
    start_o = np.repeat(call_lo, call_len)
    call_o = np.repeat(np.arange(len(call_len)), call_len)

    dist = np.full(total, -1, dtype=np.int64)
    removed = RemovedSet(total + 1)
    bar = open_progress(progress, total, "stack distances")
    lo = 0
    ends = np.concatenate([[0], np.cumsum(call_len)])
    for c0, c1, repeats in _groups(call_stream.tolist(), call_q.tolist()):
        lo, hi = int(ends[c0]), int(ends[c1])
        p = prev_o[lo:hi]
        seen = np.flatnonzero(p >= 0)
        if len(seen):
            pm, bm = p[seen], start_o[lo:hi][seen]
            between = removed.count_below(bm) - removed.count_below(pm + 1)
            if repeats:
                between += _earlier_removals(pm, bm, call_o[lo:hi][seen] - c0, c1 - c0)
            dist[coords[lo:hi][seen]] = (bm - pm - 1) - between
            removed.add(pm)
        bar.update(hi - lo)
    bar.close()
    return [dist[base[i] : base[i + 1]] for i in range(len(streams))]


_GROUP_CELLS = 1 << 16  # queries x calls of a group that repeats tables


def _groups(call_stream: list[int], call_q: list[int]) -> list[tuple[int, int, bool]]:
    """(first call, end call, repeats a table) of each group, greedily."""
    out, seen, q, start, repeats = [], set(), 0, 0, False
    for c, (s, n) in enumerate(zip(call_stream, call_q)):  # a loop per call, not per id
        again = s in seen
        if (again or repeats) and (q + n) * (c + 1 - start) > _GROUP_CELLS and c > start:
            out.append((start, c, repeats))
            seen, q, start, repeats, again = set(), 0, c, False, False
        seen.add(s)
        q += n
        repeats |= again
    if len(call_stream) > start:
        out.append((start, len(call_stream), repeats))
    return out


def _earlier_removals(p: np.ndarray, b: np.ndarray, call: np.ndarray, n_calls: int) -> np.ndarray:
    """For each query, removals by earlier calls of its group inside (p, b): the
    queries e' with call(e') < call(e) and p < p' < b (which also keeps e' to the
    same table, since tables own disjoint ranges of the axis)."""
    order = np.argsort(p, kind="stable")
    ps = p[order]
    first_above = np.searchsorted(ps, p, side="right")
    first_at_b = np.searchsorted(ps, b, side="left")
    # below[k, c]: among the k smallest p', how many belong to calls before c
    below = np.zeros((len(p) + 1, n_calls + 1), dtype=np.int32)
    below[1:] = call[order][:, None] < np.arange(n_calls + 1)[None, :]
    np.cumsum(below, axis=0, out=below)
    return below[first_at_b, call] - below[first_above, call]


# -- miss-ratio curves ----------------------------------------------------------------------------
@dataclass
class LruCurve:
    """A table's LRU hit counts at every size, from a histogram of stack distances.

    Exact (``rate == 1``): ``hist[k]`` uses had distance k, ``cold`` were first
    touches. SHARDS: the histogram of the sampled uses' distances, which stand
    for distances k / rate; ``cold`` = rate * the trace's distinct rows and
    ``adjust`` uses put at distance 0 make the total rate * the trace's uses
    (SHARDS_adj), all in sampled units.
    """

    name: str
    hist: np.ndarray
    cold: float  # first touches (sampled units; an int when exact)
    n_accesses: int
    n_calls: int
    rate: float = 1.0
    adjust: float = 0.0
    _cum: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def from_distances(cls, stream: TableStream, dist: np.ndarray, rate: float = 1.0, adjust: float = 0.0) -> "LruCurve":
        finite = dist[dist >= 0]
        hist = np.bincount(finite, minlength=1) if len(finite) else np.zeros(1, dtype=np.int64)
        return cls(stream.name, hist, int(len(dist) - len(finite)), stream.n_accesses, stream.n_calls, rate, adjust)

    @property
    def exact(self) -> bool:
        return self.rate == 1.0 and self.adjust == 0.0

    @property
    def sampled_uses(self) -> float:
        return float(self.hist.sum()) + self.cold + self.adjust

    @property
    def n_uses(self) -> float:
        """Uses (unique ids per call, summed over calls); an estimate under SHARDS."""
        return self.sampled_uses / self.rate

    @property
    def working_set(self) -> float:
        return self.cold / self.rate

    def cum(self) -> np.ndarray:
        if self._cum is None:
            self._cum = np.cumsum(self.hist) + self.adjust if self.adjust else np.cumsum(self.hist)
        return self._cum

    def hits(self, rows) -> np.ndarray:
        """Uses that hit a cache of ``rows`` rows (array or scalar); exact ints if exact."""
        rows = np.asarray(rows)
        idx = np.ceil(rows * self.rate).astype(np.int64) if self.rate != 1.0 else rows.astype(np.int64)
        cum = self.cum()
        out = np.where(idx <= 0, 0, cum[np.clip(idx, 1, len(cum)) - 1])
        # a negative SHARDS adjustment can push the smallest sizes below zero
        return out if self.exact else np.maximum(out, 0) / self.rate

    def hit_ratio(self, rows) -> np.ndarray:
        total = self.n_uses
        return np.asarray(self.hits(rows), dtype=np.float64) / total if total else np.zeros(np.shape(rows))

    def tiers(self, hbm_rows: int, ddr_rows: int) -> dict:
        """What a store with these tiers counts: hits per tier and misses (SSD reads)."""
        h = self.hits(hbm_rows)
        hd = self.hits(hbm_rows + ddr_rows)
        n = self.n_uses if not self.exact else int(self.sampled_uses)
        return {"hbm_hits": h, "ddr_hits": hd - h, "misses": n - hd}

    def max_hit_ratio(self) -> float:
        return float(self.hit_ratio(self.working_set + 1 / self.rate)) if self.n_uses else 0.0

    def rows_for(self, ratio: float) -> int | None:
        """Smallest cache (rows) with hit ratio >= ratio; None when cold misses forbid it."""
        if ratio <= 0 or self.sampled_uses == 0:
            return 0
        need = ratio * self.sampled_uses
        cum = self.cum()
        i = int(np.searchsorted(cum, need - 1e-9 * max(need, 1), side="left"))
        if i >= len(cum):
            return None
        return i + 1 if self.rate == 1.0 else int(math.floor(i / self.rate)) + 1

    def reuse_histogram(self) -> dict:
        """Uses per stack-distance bucket [0,1), [1,2), [2,4), ... (rows) plus first touches."""
        n = len(self.hist)
        edges_s = [0, 1]
        while edges_s[-1] < n:
            edges_s.append(edges_s[-1] * 2)
        counts = np.add.reduceat(self.hist, np.minimum(edges_s[:-1], n - 1)) if n else np.zeros(0)
        counts[np.array(edges_s[:-1]) >= n] = 0
        counts = counts.astype(np.float64)
        counts[0] += self.adjust
        scale = 1 / self.rate
        return {
            "buckets": [[e * scale, edges_s[i + 1] * scale] for i, e in enumerate(edges_s[:-1])],
            "uses": (counts * scale).tolist() if not self.exact else counts.astype(np.int64).tolist(),
            "first_touches": self.working_set if not self.exact else int(self.cold),
        }


def lru_curves(trace: Trace, tables: Sequence[str] | None = None,
               progress: ProgressFactory | None = None) -> list[LruCurve]:
    """The exact LRU curve of each table (one pass over the trace)."""
    streams = build_streams(trace, tables)
    dists = stack_distances(streams, progress)
    return [LruCurve.from_distances(s, d) for s, d in zip(streams, dists)]


def even_sizes(working_set: float, n: int = 200) -> np.ndarray:
    """Cache sizes to evaluate a curve at: 0..working set, evenly spaced."""
    ws = max(int(math.ceil(working_set)), 1)
    return np.unique(np.linspace(0, ws, n).round().astype(np.int64))


def mean_abs_error(approx: LruCurve, exact: LruCurve, sizes: np.ndarray | None = None) -> float:
    """Mean |miss ratio difference| over evenly spaced sizes up to the working set."""
    sizes = even_sizes(exact.working_set) if sizes is None else sizes
    return float(np.mean(np.abs(approx.hit_ratio(sizes) - exact.hit_ratio(sizes))))
