"""Capacity analysis of access traces: how many HBM and DDR rows a table needs.

Everything here predicts what a :class:`tierstore.TieredStore` of a given size
measures when the trace is replayed through it, under the store's batch
semantics (tierstore/store.py):

- A call's unique ids are its *uses*; the store counts each once (a hit at the
  highest tier that held it, a miss at each existing tier above). A use's key
  is ``clock_at_call_start + first_position_in_call``. Only the order of keys
  matters, and tiers are per table, so each table is analysed on its own clock
  (its own positions); that preserves the order of the store's one clock.
- LRU over (HBM h, DDR d) is one LRU list of h + d rows, HBM its top h. The
  *stack distance* of a use is the number of distinct rows of its table whose
  last use is more recent, counted against the state before its call (uses of
  the same call do not see each other); a first touch has infinite distance.
  The use hits HBM iff distance < h, DDR iff h <= distance < h + d. One pass
  gives every size: the exact miss-ratio curve.
- LFU and lookahead are not stack algorithms; :class:`CacheSim` replays a table
  at one size through a data-free copy of the planning in ``TableStore._access`` (tierstore/table.py),
  with the same policies (``tierstore.eviction``), so its counts equal the
  store's. Belady's MIN (farthest next use evicted first, one level of h + d
  rows) bounds the hits any policy can get at that size.
- SHARDS (Waldspurger et al., FAST'15): keep the rows whose hash falls below
  rate * 2**64, compute exact distances on that sub-trace, scale them by
  1/rate; the trace's exact uses and distinct rows (cheap to count) pin the
  first touches and the total (an extension of SHARDS_adj). Its error is
  estimated from the spread between four disjoint sub-samples.

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

import heapq
import json
import math
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierstore.eviction import make_policy
from tierstore.eviction.lookahead import NOT_IN_WINDOW, LookaheadPolicy
from tierstore.trace import Trace, gather_ranges

INT64_MAX = np.iinfo(np.int64).max
DEFAULT_ROW_BYTES = 512  # a dim-128 float32 row, when the trace does not say
_ONE = np.uint64(1)


# -- per-table use streams ----------------------------------------------------------------
@dataclass
class TableStream:
    """One table's calls as the store sees them: each call's unique rows, in
    order of first position, with their keys and previous uses."""

    name: str
    row: np.ndarray  # int64 dense row number of each use
    key: np.ndarray  # int64 use clock on the table's own position axis
    prev: np.ndarray  # int64 index of the previous use of the same row, -1 for a first touch
    bounds: np.ndarray  # int64 [n_calls + 1]: uses of call j are [bounds[j], bounds[j + 1])
    calls: np.ndarray  # int64 global call number of each of the table's calls
    space: int  # size of the dense row space
    n_accesses: int  # ids read (with repeats)
    num_rows: int | None = None  # the table's id space (the store clamps tier sizes to it)
    _next: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_uses(self) -> int:
        return len(self.row)

    @property
    def n_calls(self) -> int:
        return len(self.calls)

    @property
    def working_set(self) -> int:
        """Distinct rows the trace touches."""
        return int(np.count_nonzero(self.prev < 0))

    def next_use(self) -> np.ndarray:
        """Index of the next use of the same row, -1 if none."""
        if self._next is None:
            nxt = np.full(self.n_uses, -1, dtype=np.int64)
            has = np.flatnonzero(self.prev >= 0)
            nxt[self.prev[has]] = has
            self._next = nxt
        return self._next

    def use_call(self) -> np.ndarray:
        """Table-local call number of each use."""
        return np.repeat(np.arange(self.n_calls, dtype=np.int64), np.diff(self.bounds))


def _densify(ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Small non-negative ints for ids: the ids themselves when their range is
    small enough for dense per-row arrays, else their rank among the distinct ids."""
    if len(ids) == 0:
        return np.empty(0, dtype=np.int64), 0
    hi = int(ids.max())
    if hi < min(4 * len(ids) + (1 << 20), 1 << 26):
        return np.asarray(ids, dtype=np.int64), hi + 1
    uniq, inverse = np.unique(ids, return_inverse=True)
    return inverse.astype(np.int64, copy=False), len(uniq)


def build_stream(trace: Trace, table: int) -> TableStream:
    """Deduplicate each call of one table the way the store does and link every
    use to its row's previous use."""
    ids, offsets, calls = trace.table_calls(table)
    dense, space = _densify(ids)
    n_calls = len(calls)
    t = trace.tables[table]
    if n_calls and len(ids) < SMALL_CALLS * n_calls and space * n_calls < 2**62:
        row, key, prev, bounds = _dedupe_by_sort(dense, offsets)
    else:
        row, key, prev, bounds = _dedupe_per_call(dense, offsets, space)
    return TableStream(t.name, row, key, prev, bounds, calls.astype(np.int64), space, len(ids), t.num_rows)


SMALL_CALLS = 64  # mean ids per call below which one sort beats a loop over calls


def _dedupe_per_call(dense: np.ndarray, offsets: np.ndarray, space: int):
    """A loop per call, vectorized within it; per-row scratch arrays."""
    n_ids, n_calls = len(dense), len(offsets) - 1
    # int32 scratch where it fits: these arrays span the id space, and touching
    # their pages is a good part of the cost
    small = np.int32 if n_ids < np.iinfo(np.int32).max else np.int64
    unset = np.iinfo(small).max
    first_pos = np.full(space, unset, dtype=small)  # a row's first position in the current call
    last_use = np.full(space, -1, dtype=small)
    row = np.empty(n_ids, dtype=np.int64)
    key = np.empty(n_ids, dtype=np.int64)
    prev = np.empty(n_ids, dtype=np.int64)
    bounds = np.zeros(n_calls + 1, dtype=np.int64)
    n = 0
    for j in range(n_calls):
        s, e = int(offsets[j]), int(offsets[j + 1])
        x = dense[s:e]
        pos = np.arange(s, e, dtype=small)
        np.minimum.at(first_pos, x, pos)
        is_first = first_pos[x] == pos
        u = x[is_first]
        m = len(u)
        first_pos[u] = unset
        row[n : n + m] = u
        key[n : n + m] = pos[is_first]
        prev[n : n + m] = last_use[u]
        last_use[u] = np.arange(n, n + m, dtype=small)
        n += m
        bounds[j + 1] = n
    return row[:n], key[:n], prev[:n], bounds


def _dedupe_by_sort(dense: np.ndarray, offsets: np.ndarray):
    """All calls at once, for many small calls: sort by (row, call); the first of
    each run is a use, and the use before it in that order, if of the same row,
    is its previous use."""
    n_calls = len(offsets) - 1
    call = np.repeat(np.arange(n_calls, dtype=np.int64), np.diff(offsets))
    order = np.argsort(dense * n_calls + call, kind="stable")  # positions stay in order within a run
    sorted_key = (dense * n_calls + call)[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    pos = order[first]  # first position of each (row, call), by row then call
    rows = dense[pos]
    by_time = np.argsort(pos)
    use = np.empty(len(pos), dtype=np.int64)
    use[by_time] = np.arange(len(pos))
    same_row = np.zeros(len(pos), dtype=bool)
    same_row[1:] = rows[1:] == rows[:-1]
    prev_sorted = np.full(len(pos), -1, dtype=np.int64)
    prev_sorted[1:] = np.where(same_row[1:], use[:-1], -1)
    key = pos[by_time]
    return rows[by_time], key, prev_sorted[by_time], np.searchsorted(key, offsets).astype(np.int64)


def build_streams(trace: Trace, tables: Sequence[str] | None = None) -> list[TableStream]:
    names = list(tables) if tables else trace.table_names
    return [build_stream(trace, trace.table_index(n)) for n in names]


# -- stack distances ----------------------------------------------------------------------------
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


def stack_distances(streams: Sequence[TableStream], progress: bool = False) -> list[np.ndarray]:
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
    bar = _progress(total, "stack distances", progress)
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


def lru_curves(trace: Trace, tables: Sequence[str] | None = None, progress: bool = False) -> list[LruCurve]:
    """The exact LRU curve of each table (one pass over the trace)."""
    streams = build_streams(trace, tables)
    dists = stack_distances(streams, progress)
    return [LruCurve.from_distances(s, d) for s, d in zip(streams, dists)]


# -- SHARDS --------------------------------------------------------------------------------------
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _table_salt(name: str, seed: int) -> np.uint64:
    # per table, so that tables do not all sample the same ids
    return np.uint64((zlib.crc32(name.encode()) * 0x9E3779B1 + seed * 0x85EBCA77) & 0xFFFFFFFFFFFFFFFF)


SUB_SAMPLES = 16  # disjoint sub-samples whose spread estimates SHARDS's error
MIN_SAMPLE_ROWS = 16_384  # a table's rate is raised until its sample holds about this many rows
ERROR_SIGMAS = 4.0  # the error band, in standard errors (held on every Zipf trace of the tests)


def shards_sample(trace: Trace, rate, seed: int = 0, chunk: int = 1 << 20,
                  progress: bool = False) -> tuple[Trace, np.ndarray]:
    """The sub-trace of rows whose hash is below rate * 2**64 (same calls, fewer ids),
    and each kept id's sub-sample number (0..SUB_SAMPLES-1, from the hash's low bits).
    ``rate``: one rate, or one per table of the trace."""
    rates = np.broadcast_to(np.asarray(rate, dtype=np.float64), (len(trace.tables),))
    if not np.all((rates > 0) & (rates <= 1)):
        raise ValueError(f"SHARDS rate must be in (0, 1], got {rate}")
    thresholds = np.array([min(int(r * 2.0**64), 2**64 - 1) for r in rates], dtype=np.uint64)
    salts = np.array([_table_salt(t.name, seed) for t in trace.tables], dtype=np.uint64)
    lengths = np.diff(trace.offsets)
    kept_ids, kept_pos, kept_sub = [], [], []
    bar = _progress(trace.n_accesses, "SHARDS sampling", progress)
    c0 = 0
    buf = np.empty(0, dtype=np.uint64)
    while c0 < trace.n_calls:
        # whole calls per chunk, about `chunk` ids each, so the salts are one repeat
        c1 = int(np.searchsorted(trace.offsets, trace.offsets[c0] + chunk, side="right")) - 1
        c1 = min(max(c1, c0 + 1), trace.n_calls)
        s, e = int(trace.offsets[c0]), int(trace.offsets[c1])
        ids = np.asarray(trace.ids[s:e])
        if len(buf) < e - s:
            buf = np.empty(e - s, dtype=np.uint64)
        h = buf[: e - s]
        tables = trace.call_table[c0:c1]
        np.bitwise_xor(ids.view(np.uint64), np.repeat(salts[tables], lengths[c0:c1]), out=h)
        # splitmix64's finaliser: every id bit moves every hash bit
        h ^= h >> np.uint64(30)
        h *= _M1
        h ^= h >> np.uint64(27)
        h *= _M2
        h ^= h >> np.uint64(31)
        kept = np.flatnonzero(h < np.repeat(thresholds[tables], lengths[c0:c1]))
        kept_ids.append(ids[kept])
        kept_pos.append(kept + s)
        kept_sub.append((h[kept] & np.uint64(SUB_SAMPLES - 1)).astype(np.int8))
        bar.update(e - s)
        c0 = c1
    bar.close()
    pos = np.concatenate(kept_pos) if kept_pos else np.empty(0, dtype=np.int64)
    offsets = np.searchsorted(pos, trace.offsets).astype(np.int64)
    sub = Trace(trace.tables, np.concatenate(kept_ids) if kept_ids else np.empty(0, dtype=np.int64), offsets,
                trace.call_table, trace.call_step, trace.complete)
    return sub, (np.concatenate(kept_sub) if kept_sub else np.empty(0, dtype=np.int8))


@dataclass
class ShardsResult:
    curves: list[LruCurve]
    rate: float  # as asked; each curve's own rate may be higher (see table_rates)
    sampled_accesses: int
    error_sizes: list[np.ndarray]  # per table: cache sizes (rows) where the error band is known
    error_bound: list[np.ndarray]  # per table: bound on |miss ratio error| at those sizes
    seconds: float

    @property
    def table_rates(self) -> list[float]:
        return [c.rate for c in self.curves]

    def bound(self, i: int, rows) -> np.ndarray:
        """Table i's error bound at any sizes: the larger of the two known sizes around each."""
        x, b = self.error_sizes[i], self.error_bound[i]
        if not len(x):
            return np.full(np.shape(rows), np.nan)
        j = np.clip(np.searchsorted(x, rows), 1, len(x) - 1) if len(x) > 1 else np.zeros(np.shape(rows), dtype=np.int64)
        return np.maximum(b[j], b[np.maximum(j - 1, 0)])

    @property
    def max_bound(self) -> list[float]:
        return [float(b.max()) if len(b) else float("nan") for b in self.error_bound]

    @property
    def mean_bound(self) -> list[float]:
        return [float(b.mean()) if len(b) else float("nan") for b in self.error_bound]


def shards_curves(trace: Trace, rate: float, tables: Sequence[str] | None = None, seed: int = 0,
                  adjust: bool = True, progress: bool = False, estimate_error: bool = True,
                  min_sample_rows: int = MIN_SAMPLE_ROWS) -> ShardsResult:
    """Approximate LRU curves by SHARDS at ``rate``.

    A table whose sample would hold fewer than ``min_sample_rows`` rows is sampled
    at a higher rate (up to 1, exact): at rate 0.01 a 100k-row table keeps ~1000
    rows, and the few hot rows that decide small caches are in or out by chance.

    Adjustment (SHARDS_adj, extended): the trace's exact uses U and distinct
    rows W are cheap to count (a scatter per call, no streams), so the first
    touches are set to W and the difference between the sampled uses and their
    expectation is put at distance 0: hits(C) = U - W - (sampled reuses with
    distance >= rate * C) / rate. Only the reuse distances are estimated.

    Error band, per size: ERROR_SIGMAS standard errors (from the spread of
    SUB_SAMPLES disjoint sub-samples, whose variance is SUB_SAMPLES times the
    whole sample's; the largest within a factor 2 of the size, since one size's
    spread is itself noisy) plus the curve's rise over +-1/rate rows (what one
    sampled row of distance stands for).
    """
    t0 = time.perf_counter()
    names = list(tables) if tables else trace.table_names
    exact = trace_counts(trace, names)
    rates = np.full(len(trace.tables), float(rate))
    for n, w in zip(names, exact[1]):
        rates[trace.table_index(n)] = min(1.0, max(float(rate), min_sample_rows / max(w, 1)))
    sub, part = shards_sample(trace, rates, seed, progress=progress)
    per_table = trace.accesses_per_table()
    accesses = [int(per_table[trace.table_index(n)]) for n in names]
    name_rates = [float(rates[trace.table_index(n)]) for n in names]
    curves = _sample_curves(sub, names, name_rates, exact if adjust else None, accesses, progress)
    sizes = [_error_grid(c.working_set) for c in curves]
    bounds = [np.full(len(g), np.nan) for g in sizes]
    sampled = [i for i, c in enumerate(curves) if c.rate < 1.0]  # a table read whole is exact: no band
    for i in set(range(len(curves))) - set(sampled):
        bounds[i] = np.zeros(len(sizes[i]))
    if estimate_error and sub.n_accesses and sampled:
        some = [names[i] for i in sampled]
        some_exact = ([exact[0][i] for i in sampled], [exact[1][i] for i in sampled]) if adjust else None
        parts = []
        for k in range(SUB_SAMPLES):
            keep = part == k
            offs = np.searchsorted(np.flatnonzero(keep), sub.offsets).astype(np.int64)
            parts.append(_sample_curves(Trace(sub.tables, sub.ids[keep], offs, sub.call_table, sub.call_step), some,
                                        [name_rates[i] / SUB_SAMPLES for i in sampled], some_exact,
                                        [accesses[i] for i in sampled], False))
        for j, i in enumerate(sampled):
            c, g = curves[i], sizes[i]
            se = np.array([p[j].hit_ratio(g) for p in parts]).std(axis=0, ddof=1) / math.sqrt(SUB_SAMPLES)
            lo, hi = np.searchsorted(g, g / 2), np.searchsorted(g, g * 2, side="right")
            se = np.array([se[a:b].max() for a, b in zip(lo, hi)])  # a loop over ~300 sizes
            step = 1 / c.rate
            rise = c.hit_ratio(g + step) - c.hit_ratio(np.maximum(g - step, 0))
            bounds[i] = ERROR_SIGMAS * se + rise
    return ShardsResult(curves, rate, sub.n_accesses, sizes, bounds, time.perf_counter() - t0)


def _error_grid(working_set: float) -> np.ndarray:
    """Sizes for the error band: even steps and geometric ones (small caches) to the working set."""
    ws = max(int(math.ceil(working_set)), 1)
    return np.unique(np.concatenate([_grid(ws), np.geomspace(1, ws, 120).round().astype(np.int64)]))


def _sample_curves(sub: Trace, names, rates, exact, accesses, progress) -> list[LruCurve]:
    streams = build_streams(sub, names)
    dists = stack_distances(streams, progress)
    out = []
    for i, (s, d) in enumerate(zip(streams, dists)):
        rate = rates[i]
        c = LruCurve.from_distances(s, d, rate)
        if exact is not None:
            uses, distinct = exact[0][i], exact[1][i]
            c.cold = rate * distinct
            c.adjust = rate * uses - float(c.hist.sum()) - c.cold
        c.n_accesses = accesses[i]
        out.append(c)
    return out


def trace_counts(trace: Trace, names) -> tuple[list[int], list[int]]:
    """Per table: uses (unique ids per call, summed) and distinct rows, without
    building streams: a scatter and a gather per call, or one sort for many small calls."""
    uses, distinct = [], []
    for name in names:
        ids, offsets, _ = trace.table_calls(trace.table_index(name))
        dense, space = _densify(ids)
        n_calls = len(offsets) - 1
        if n_calls and len(ids) < SMALL_CALLS * n_calls and space * n_calls < 2**62:
            call = np.repeat(np.arange(n_calls, dtype=np.int64), np.diff(offsets))
            k = np.sort(dense * n_calls + call)
            uses.append(int(len(k) and 1 + np.count_nonzero(k[1:] != k[:-1])))
            seen = np.zeros(space, dtype=bool)
            seen[dense] = True
        else:
            stamp = np.full(space, -1, dtype=np.int64)
            n = 0
            for j in range(n_calls):
                x = dense[offsets[j] : offsets[j + 1]]
                pos = np.arange(len(x))
                stamp[x] = pos  # whichever position wins, exactly one per distinct id matches
                n += int(np.count_nonzero(stamp[x] == pos))
            uses.append(n)
            seen = stamp >= 0
        distinct.append(int(np.count_nonzero(seen)))
    return uses, distinct


def _grid(working_set: float, n: int = 200) -> np.ndarray:
    """Cache sizes to evaluate a curve at: 0..working set, evenly spaced."""
    ws = max(int(math.ceil(working_set)), 1)
    return np.unique(np.linspace(0, ws, n).round().astype(np.int64))


def mean_abs_error(approx: LruCurve, exact: LruCurve, sizes: np.ndarray | None = None) -> float:
    """Mean |miss ratio difference| over evenly spaced sizes up to the working set."""
    sizes = _grid(exact.working_set) if sizes is None else sizes
    return float(np.mean(np.abs(approx.hit_ratio(sizes) - exact.hit_ratio(sizes))))


# -- simulation at one size (LRU, LFU, lookahead, Belady) ---------------------------------------------
@dataclass
class TierCounts:
    hbm_hits: int = 0
    hbm_misses: int = 0
    ddr_hits: int = 0
    ddr_misses: int = 0
    hbm_evictions: int = 0
    ddr_evictions: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _SimTier:
    """One tier's slots: row, use clock and step count per slot, like CacheTier without data."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows = np.full(capacity, -1, dtype=np.int64)
        self.last = np.zeros(capacity, dtype=np.int64)
        self.freq = np.zeros(capacity, dtype=np.int64)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.n_free = capacity

    def occupied_except(self, slots: np.ndarray) -> np.ndarray:
        mask = self.rows >= 0
        mask[slots] = False
        return np.flatnonzero(mask)

    def add(self, rows, last, freq) -> np.ndarray:
        n = len(rows)
        slots = self._free[self.n_free - n : self.n_free].copy()
        self.n_free -= n
        self.rows[slots], self.last[slots], self.freq[slots] = rows, last, freq
        return slots

    def remove(self, slots) -> None:
        n = len(slots)
        self.rows[slots] = -1
        self._free[self.n_free : self.n_free + n] = slots
        self.n_free += n


class CacheSim:
    """The store's two exclusive tiers for one table, without data: the planning of
    ``TableStore._access`` (tierstore/table.py) on slot arrays, one call at a time.

    ``choose(rows, last, freq, k, now)`` returns positions of the k victims among
    resident rows; ``choose_call`` (default: ``choose``) ranks the rows of a call
    that is larger than a tier (the store uses the plain policy there). A call
    costs O(call + tier) like the store's own planning: the victims are chosen
    among every resident row.
    """

    def __init__(self, space: int, hbm_rows: int, ddr_rows: int,
                 choose: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], np.ndarray],
                 choose_call: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], np.ndarray] | None = None):
        self.H = _SimTier(int(hbm_rows)) if hbm_rows > 0 else None
        self.D = _SimTier(int(ddr_rows)) if ddr_rows > 0 else None
        self.choose = choose
        self.choose_call = choose_call or choose
        self.where = np.zeros(space, dtype=np.int8)  # 0 uncached, 1 HBM, 2 DDR
        self.slot = np.zeros(space, dtype=np.int64)
        self.counts = TierCounts()

    def call(self, u: np.ndarray, key: np.ndarray, now: int) -> None:
        H, D, c = self.H, self.D, self.counts
        n = len(u)
        w = self.where[u]
        sl = self.slot[u]
        in_h, in_d = w == 1, w == 2
        n_h = int(np.count_nonzero(in_h))
        if H is not None:
            c.hbm_hits += n_h
            c.hbm_misses += n - n_h
            if n_h == n:
                H.last[sl] = key
                H.freq[sl] += 1
                return
        n_d = int(np.count_nonzero(in_d))
        if D is not None:
            c.ddr_hits += n_d
            c.ddr_misses += n - n_h - n_d
            if H is None and n_d == n:
                D.last[sl] = key
                D.freq[sl] += 1
                return
        if H is None and D is None:
            return
        new_freq = np.ones(n, dtype=np.int64)
        if n_h:
            new_freq[in_h] += H.freq[sl[in_h]]
        if n_d:
            new_freq[in_d] += D.freq[sl[in_d]]
        keep_h = np.zeros(n, dtype=bool)
        demote = np.empty(0, dtype=np.int64)  # HBM slots of non-call rows going down
        if H is not None:
            keep_h[:] = True
            if n <= H.capacity:
                need = (n - n_h) - H.n_free
                if need > 0:
                    cand = H.occupied_except(sl[in_h])
                    demote = cand[self.choose(H.rows[cand], H.last[cand], H.freq[cand], need, now)]
            else:
                keep_h[self.choose_call(u, key, new_freq, n - H.capacity, now)] = False
                demote = H.occupied_except(sl[in_h])
        e_rows = H.rows[demote] if H is not None else demote
        e_last = H.last[demote] if H is not None else demote
        e_freq = H.freq[demote] if H is not None else demote
        down = np.flatnonzero(~keep_h)
        keep_d = np.zeros(n, dtype=bool)
        drop = np.empty(0, dtype=np.int64)  # DDR slots of non-call rows leaving
        survive = np.zeros(len(demote), dtype=bool)
        if D is not None:
            keep_d[down] = True
            if len(down) > D.capacity:
                keep_d[down[self.choose_call(u[down], key[down], new_freq[down], len(down) - D.capacity, now)]] = False
            others = D.occupied_except(sl[in_d])
            survive[:] = True
            k = len(others) + len(demote) - (D.capacity - int(np.count_nonzero(keep_d)))
            if k > 0:
                v = self.choose(np.concatenate([D.rows[others], e_rows]), np.concatenate([D.last[others], e_last]),
                                np.concatenate([D.freq[others], e_freq]), k, now)
                drop = others[v[v < len(others)]]
                survive[v[v >= len(others)] - len(others)] = False
        if H is not None:
            c.hbm_evictions += len(demote) + int(np.count_nonzero(in_h & ~keep_h))
        if D is not None:
            c.ddr_evictions += int(np.count_nonzero(in_d & ~keep_d & ~keep_h)) + len(drop) + int(np.count_nonzero(~survive))
        # commit, in the store's order
        if H is not None:
            H.remove(np.concatenate([demote, sl[in_h & ~keep_h]]))
            stay = in_h & keep_h
            H.last[sl[stay]], H.freq[sl[stay]] = key[stay], new_freq[stay]
            enter = ~in_h & keep_h
            self.slot[u[enter]] = H.add(u[enter], key[enter], new_freq[enter])
        if D is not None:
            self.where[D.rows[drop]] = 0
            D.remove(np.concatenate([sl[in_d & ~keep_d], drop]))
            stay = in_d & keep_d
            D.last[sl[stay]], D.freq[sl[stay]] = key[stay], new_freq[stay]
            enter = ~in_d & keep_d
            self.slot[u[enter]] = D.add(u[enter], key[enter], new_freq[enter])
            self.slot[e_rows[survive]] = D.add(e_rows[survive], e_last[survive], e_freq[survive])
        self.where[e_rows] = np.where(survive, 2, 0)
        self.where[u] = np.where(keep_h, 1, np.where(keep_d, 2, 0))


_BIG = 1 << 64  # above any use clock: freq * _BIG + last orders by (freq, last), as LFU does


class HeapSim:
    """:class:`CacheSim`'s tiers with each tier's rows in heaps ordered by the policy, so a
    call costs O((call + victims) log tier) instead of O(call + tier): the replay of many
    small calls (one id per call at worst) that CacheSim pays a whole tier scan for.

    Every policy here is a total order on resident rows (LRU: last; LFU: (freq, last);
    lookahead: rows outside the window by the base order, then in-window rows by
    (farthest next use, base order)), and the store's victims are the k smallest, so
    popping k times picks the same rows. Entries go stale when their row is used or
    leaves (checked against the row's ``last`` on pop); a lookahead row whose next use
    enters the window is found on pop and moved to the in-window heap.
    """

    def __init__(self, hbm_rows: int, ddr_rows: int, lfu: bool, window: int | None, look: bool,
                 choose_call: Callable[[np.ndarray, np.ndarray, np.ndarray, int, int], np.ndarray]):
        self.cap = (0, int(hbm_rows), int(ddr_rows))  # tiers 1 (HBM) and 2 (DDR); 0 rows: no tier
        self.members: tuple[set, set, set] = (set(), set(), set())
        self.tier: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.freq: dict[int, int] = {}
        self.next: dict[int, int] = {}  # lookahead: the call that next uses the row
        self.lfu, self.window, self.look = lfu, window, look
        self.heaps: tuple[list, list, list] = ([], [], [])  # by base order (lookahead: rows outside the window)
        self.inside: tuple[list, list, list] = ([], [], [])  # lookahead: in-window rows by (-next use, base order)
        self.choose_call = choose_call
        self.counts = TierCounts()
        self.now = 0

    def _in_window(self, row: int) -> bool:
        nxt = self.next.get(row, NOT_IN_WINDOW)
        return nxt != NOT_IN_WINDOW and (self.window is None or nxt <= self.now + self.window)

    def _push(self, t: int, row: int) -> None:
        last = self.last[row]
        base = self.freq[row] * _BIG + last if self.lfu else last
        if self.look and self._in_window(row):
            heapq.heappush(self.inside[t], ((-self.next[row], base), last, row))
        else:
            heapq.heappush(self.heaps[t], (base, last, row))
        if len(self.heaps[t]) + len(self.inside[t]) > 2 * len(self.members[t]) + 1024:
            self._compact(t)

    def _valid(self, t: int, entry, exclude) -> bool:
        row = entry[2]
        return self.tier.get(row) == t and self.last[row] == entry[1] and row not in exclude

    def _compact(self, t: int) -> None:
        for h in (self.heaps[t], self.inside[t]):
            h[:] = [e for e in h if self._valid(t, e, ())]
            heapq.heapify(h)

    def _pop(self, t: int, exclude) -> int:
        """The smallest resident row of tier t outside ``exclude`` (there is one)."""
        h = self.heaps[t]
        while h:
            entry = heapq.heappop(h)
            if not self._valid(t, entry, exclude):
                continue
            if self.look and self._in_window(entry[2]):
                heapq.heappush(self.inside[t], ((-self.next[entry[2]], entry[0]), entry[1], entry[2]))
                continue
            return entry[2]
        h = self.inside[t]
        while True:
            entry = heapq.heappop(h)
            if self._valid(t, entry, exclude):
                return entry[2]

    def _move(self, row: int, t: int) -> None:
        """Row to tier t (0: out of the cache)."""
        old = self.tier.get(row, 0)
        if old:
            self.members[old].discard(row)
        if t:
            self.tier[row] = t
            self.members[t].add(row)
            self._push(t, row)
        else:
            self.tier.pop(row, None)
            self.last.pop(row, None)
            self.freq.pop(row, None)

    def call(self, u: list, key: list, nxt: list | None, now: int) -> None:
        self.now = now
        if nxt is not None:
            self.next.update(zip(u, nxt))
        if len(u) == 1:
            return self._call_one(u[0], key[0])
        H, D = self.cap[1] > 0, self.cap[2] > 0
        c, tier, n = self.counts, self.tier, len(u)
        where = [tier.get(r, 0) for r in u]
        n_h, n_d = where.count(1), where.count(2)
        if H:
            c.hbm_hits += n_h
            c.hbm_misses += n - n_h
        if D:
            c.ddr_hits += n_d
            c.ddr_misses += n - n_h - n_d
        if (H and n_h == n) or (not H and D and n_d == n):
            for r, k in zip(u, key):  # all resident in the top tier: a touch
                self.last[r], self.freq[r] = k, self.freq[r] + 1
                self._push(tier[r], r)
            return
        if not (H or D):
            return
        new_freq = [self.freq[r] + 1 if w else 1 for r, w in zip(u, where)]
        exclude = set(u)
        keep_h = [H] * n
        demote = []
        if H:
            if n <= self.cap[1]:
                need = (n - n_h) - (self.cap[1] - len(self.members[1]))
                demote = [self._pop(1, exclude) for _ in range(need)]
            else:
                for i in self.choose_call(np.array(u), np.array(key), np.array(new_freq), n - self.cap[1], now).tolist():
                    keep_h[i] = False
                demote = list(self.members[1] - exclude)
        down = [i for i in range(n) if not keep_h[i]]
        keep_d = [False] * n
        dead = set()  # rows leaving the cache: DDR victims, demoted rows with no room
        if D:
            for i in down:
                keep_d[i] = True
            if len(down) > self.cap[2]:
                cand = np.array(down)
                for i in self.choose_call(np.array(u)[cand], np.array(key)[cand], np.array(new_freq)[cand],
                                          len(down) - self.cap[2], now).tolist():
                    keep_d[down[i]] = False
            for r in demote:  # demoted rows compete for DDR with their HBM order
                self._move(r, 2)
            k = len(self.members[2]) - n_d - (self.cap[2] - keep_d.count(True))
            dead = {self._pop(2, exclude) for _ in range(k)}
        else:
            dead = set(demote)
        if H:
            c.hbm_evictions += len(demote) + sum(1 for w, kh in zip(where, keep_h) if w == 1 and not kh)
        if D:
            c.ddr_evictions += len(dead) + sum(1 for w, kh, kd in zip(where, keep_h, keep_d) if w == 2 and not kh and not kd)
        for r in dead:
            self._move(r, 0)
        for r, k, f, kh, kd in zip(u, key, new_freq, keep_h, keep_d):
            self.last[r], self.freq[r] = k, f
            self._move(r, 1 if kh else 2 if kd else 0)

    def _call_one(self, r: int, k: int) -> None:
        """``call`` for one id, where every branch of the general case is known."""
        H, D = self.cap[1] > 0, self.cap[2] > 0
        c, w = self.counts, self.tier.get(r, 0)
        if H:
            c.hbm_hits += w == 1
            c.hbm_misses += w != 1
        if D:
            c.ddr_hits += w == 2
            c.ddr_misses += w == 0
        if (H and w == 1) or (not H and D and w == 2):
            self.last[r], self.freq[r] = k, self.freq[r] + 1
            self._push(w, r)
            return
        if not (H or D):
            return
        f = self.freq[r] + 1 if w else 1
        exclude = (r,)
        dead = []
        if H:
            demote = [self._pop(1, exclude)] if len(self.members[1]) >= self.cap[1] else []
            c.hbm_evictions += len(demote)
            if D:
                for d in demote:
                    self._move(d, 2)
                dead = [self._pop(2, exclude) for _ in range(len(self.members[2]) - (w == 2) - self.cap[2])]
                c.ddr_evictions += len(dead)
            else:
                dead = demote
        else:
            dead = [self._pop(2, exclude) for _ in range(len(self.members[2]) - self.cap[2] + 1)]
            c.ddr_evictions += len(dead)
        for d in dead:
            self._move(d, 0)
        self.last[r], self.freq[r] = k, f
        self._move(r, 1 if H else 2)


def simulate(stream: TableStream, hbm_rows: int, ddr_rows: int, policy: str = "lfu",
             window: int | None = None, base: str = "lru", progress: bool = False, method: str = "auto") -> TierCounts:
    """Replay one table through the store's tiers at one size.

    ``policy``: "lru", "lfu" (the store's policies), "lookahead" (the store's
    ``eviction="lookahead"`` with the next ``window`` calls of the table
    announced by prefetch: resident rows they use are pinned and ranked by next
    use, the rest by ``base``; a call larger than a tier keeps its rows by
    ``base``, as the store does) or "belady" (farthest next use first over the
    whole future, the call's own rows included: the offline bound).
    ``method``: "heap" (:class:`HeapSim`, O(log tier) per id), "scan"
    (:class:`CacheSim`, O(call + tier) per call, vectorized) or "auto": the
    cheaper for the stream's mean call size. Both count the same.
    """
    if stream.num_rows is not None:  # as the store does
        hbm_rows, ddr_rows = min(hbm_rows, stream.num_rows), min(ddr_rows, stream.num_rows)
    hbm_rows, ddr_rows = clamp_sizes(hbm_rows, ddr_rows, stream.working_set)
    choose_call = None
    if policy in ("lru", "lfu"):
        pol = make_policy(policy)
        choose = lambda rows, last, freq, k, now: pol.select(last, freq, k)  # noqa: E731
        next_call = None
    elif policy in ("lookahead", "belady"):
        look = LookaheadPolicy(make_policy(base), None if policy == "belady" else window)
        if policy == "lookahead" and window is None:
            raise ValueError("policy='lookahead' needs window=K (batches); policy='belady' is the infinite window")
        nxt = stream.next_use()
        calls = stream.use_call()
        next_call = np.where(nxt >= 0, calls[np.maximum(nxt, 0)], NOT_IN_WINDOW)
        row_next = np.full(stream.space, NOT_IN_WINDOW, dtype=np.int64)

        def choose(rows, last, freq, k, now):
            return look.select(look.next_use_in_window(row_next[rows], now), last, freq, k)

        if policy == "lookahead":
            choose_call = lambda rows, last, freq, k, now: look.base.select(last, freq, k)  # noqa: E731
    else:
        raise ValueError(f"unknown policy {policy!r}; choose lru, lfu, lookahead or belady")
    if method == "auto":
        method = "heap" if _heap_is_cheaper(stream, hbm_rows + ddr_rows) else "scan"
    if method not in ("heap", "scan"):
        raise ValueError(f"unknown method {method!r}; choose auto, heap or scan")
    b = stream.bounds
    bar = _progress(stream.n_uses, f"{policy} {stream.name} {hbm_rows}:{ddr_rows}", progress)
    if method == "heap":
        sim = HeapSim(hbm_rows, ddr_rows, "lfu" in (policy, base if next_call is not None else None),
                      window if policy == "lookahead" else None, next_call is not None, choose_call or choose)
        rows, keys = stream.row.tolist(), stream.key.tolist()
        nxt = next_call.tolist() if next_call is not None else None
        bl = b.tolist()
        done = 0
        for j in range(stream.n_calls):  # a loop per call; O(log tier) per id
            lo, hi = bl[j], bl[j + 1]
            if hi == lo:
                continue
            if policy == "belady":  # its choose_call reads row_next
                row_next[stream.row[lo:hi]] = next_call[lo:hi]
            sim.call(rows[lo:hi], keys[lo:hi], nxt[lo:hi] if nxt is not None else None, j)
            if hi - done >= 1 << 16:
                bar.update(hi - done)
                done = hi
        bar.update(stream.n_uses - done)
        bar.close()
        return sim.counts
    sim = CacheSim(stream.space, hbm_rows, ddr_rows, choose, choose_call)
    for j in range(stream.n_calls):  # a loop per call; each call is vectorized
        lo, hi = int(b[j]), int(b[j + 1])
        if hi == lo:
            continue
        u = stream.row[lo:hi]
        if next_call is not None:
            row_next[u] = next_call[lo:hi]
        sim.call(u, stream.key[lo:hi], j)
        bar.update(hi - lo)
    bar.close()
    return sim.counts


def _heap_is_cheaper(stream: TableStream, cached_rows: int) -> bool:
    """HeapSim costs ~HEAP_ID_NS per id; CacheSim ~SCAN_CALL_NS per call plus
    ~SCAN_ROW_NS per id and cached row (measured on the 2-core machine)."""
    per_call = stream.n_uses / max(stream.n_calls, 1)
    return per_call * HEAP_ID_NS < SCAN_CALL_NS + (per_call + cached_rows) * SCAN_ROW_NS


HEAP_ID_NS, SCAN_CALL_NS, SCAN_ROW_NS = 8000, 60000, 20


def clamp_sizes(hbm_rows: int, ddr_rows: int, working_set: float) -> tuple[int, int]:
    """The same tiers, no larger than the rows the trace touches: counts do not change
    (HBM fills before anything goes down and stays full, so DDR never holds more
    than the working set less HBM), and slot arrays are not sized by a huge ask.
    A tier stays at least one row, since a tier that exists counts its misses."""
    ws = int(math.ceil(working_set))
    h = min(int(hbm_rows), max(ws, 1))
    return h, min(int(ddr_rows), max(ws - h, 1))


def belady_hits(stream: TableStream, rows: int) -> int:
    """Hits of Belady's MIN with one level of ``rows`` rows under the store's batch
    semantics (every row of a call is brought in; farthest next use leaves first):
    the most any policy can hit with that many rows in total."""
    return simulate(stream, rows, 0, "belady").hbm_hits if rows > 0 else 0


# -- recommendations --------------------------------------------------------------------------------
def rows_for_targets(curve: LruCurve, hbm_target: float | None, hit_target: float | None) -> dict:
    """Smallest HBM rows reaching ``hbm_target`` HBM hit ratio, and smallest DDR rows
    on top reaching ``hit_target`` cache hit ratio (LRU)."""
    out = {"reachable": True, "max_hit_ratio": curve.max_hit_ratio()}
    ws = int(math.ceil(curve.working_set))
    h = 0
    if hbm_target:
        r = curve.rows_for(hbm_target)
        out["reachable"] &= r is not None
        h = ws if r is None else r
    total = h
    if hit_target:
        r = curve.rows_for(hit_target)
        out["reachable"] &= r is not None
        total = max(h, ws if r is None else r)
    out.update(hbm_rows=int(h), ddr_rows=int(total - h))
    return out


def _size_grid(curves, row_bytes, start=None, points: int = 400):
    """Per table, candidate extra rows (0 and geometric steps to the working set),
    the hits they add on top of ``start`` rows, and their bytes: (T, points + 1) each."""
    start = np.zeros(len(curves), dtype=np.int64) if start is None else np.asarray(start, dtype=np.int64)
    T = len(curves)
    cand = np.zeros((T, points + 1), dtype=np.float64)
    gain = np.zeros((T, points + 1), dtype=np.float64)
    for i, c in enumerate(curves):  # a loop per table
        room = max(int(math.ceil(c.working_set)) - int(start[i]), 0)
        sizes = np.unique(np.concatenate([[0], np.geomspace(1, max(room, 1), points).round()]))[: points + 1] if room else np.zeros(1)
        sizes = np.pad(sizes, (0, points + 1 - len(sizes)), mode="edge")
        cand[i] = sizes
        gain[i] = np.asarray(c.hits(start[i] + sizes), dtype=np.float64) - float(c.hits(start[i]))
    return cand, gain, cand * np.asarray(row_bytes, dtype=np.float64)[:, None]


def total_curve(curves: Sequence[LruCurve], row_bytes: Sequence[int], points: int = 40) -> dict:
    """The whole trace's LRU hit ratio against the bytes of one cache split across
    the tables by :func:`split_budget` (each table its own tiers), at budgets from
    one row to every working set."""
    if not curves:
        return {"bytes": [], "rows": [], "hit_ratio": []}
    rb = np.asarray(row_bytes, dtype=np.float64)
    full = float(sum(math.ceil(c.working_set) * b for c, b in zip(curves, rb)))
    budgets = np.unique(np.geomspace(rb.min(), max(full, rb.min()), points).round())
    uses = sum(c.n_uses for c in curves) or 1.0
    out = {"bytes": [], "rows": [], "hit_ratio": []}
    for b in budgets:  # a loop per budget
        sizes = split_budget(curves, row_bytes, float(b))
        out["bytes"].append(float(sum(x * r for x, r in zip(sizes, rb))))
        out["rows"].append(int(sum(sizes)))
        out["hit_ratio"].append(float(sum(float(c.hits(x)) for c, x in zip(curves, sizes))) / uses)
    return out


def split_budget(curves: Sequence[LruCurve], row_bytes: Sequence[int], budget: float,
                 start: Sequence[int] | None = None, points: int = 400) -> list[int]:
    """Rows per table that maximise total hits within ``budget`` bytes (on top of
    ``start`` rows already given): a Lagrangian over each curve's hull, searched
    on a grid of sizes per table, bisecting the price of a byte."""
    T = len(curves)
    if T == 0 or budget <= 0:
        return [0] * T
    cand, gain, cost = _size_grid(curves, row_bytes, start, points)

    def pick(price):
        k = np.argmax(gain - price * cost, axis=1)
        return k, cost[np.arange(T), k].sum()

    k, spent = pick(0.0)
    if spent <= budget:
        return cand[np.arange(T), k].astype(np.int64).tolist()
    lo, hi = 0.0, 1.0
    while pick(hi)[1] > budget:
        hi *= 4
    for _ in range(60):
        mid = (lo + hi) / 2
        if pick(mid)[1] > budget:
            lo = mid
        else:
            hi = mid
    k, spent = pick(hi)
    sizes = cand[np.arange(T), k].astype(np.int64)
    # the price leaves part of the budget where a hull segment did not fit whole:
    # spend it on the steepest next segments, the last one partly
    left = budget - spent
    open_ = np.ones(T, dtype=bool)
    rb = np.asarray(row_bytes, dtype=np.float64)
    for _ in range(4 * T):
        nxt = np.minimum(k + 1, points)
        step_rows = cand[np.arange(T), nxt] - cand[np.arange(T), k]
        can = open_ & (step_rows > 0) & (rb <= left)
        if not can.any():
            break
        slope = np.where(can, (gain[np.arange(T), nxt] - gain[np.arange(T), k]) / np.maximum(step_rows * rb, 1e-300), -np.inf)
        i = int(np.argmax(slope))
        rows = min(int(step_rows[i]), int(left // rb[i]))
        sizes[i] += rows
        left -= rows * rb[i]
        if rows == step_rows[i]:
            k[i] += 1
        else:
            open_[i] = False
    return sizes.tolist()


# -- the analysis --------------------------------------------------------------------------------------
@dataclass
class CapacityConfig:
    """What ``tierstore capacity`` computes (validated)."""

    tables: tuple[str, ...] | None = None
    shards_rate: float | None = None  # None: exact curves
    compare_exact: bool = False  # with shards_rate: also the exact curve, and SHARDS's measured error
    sizes: tuple[tuple[str, str], ...] = ()  # (hbm, ddr) per simulated point: rows, or "N%" of the working set
    policies: tuple[str, ...] = ("lfu",)  # simulated; LRU comes from the curve at every size
    window: int = 16
    belady: bool = True
    hbm_target: float | None = None
    hit_target: float | None = None
    hbm_bytes: float | None = None
    ddr_bytes: float | None = None
    steps_per_s: float = 1.0
    row_bytes: int | None = None  # overrides the trace's
    seed: int = 0
    progress: bool = False
    iec: bool = False  # report bytes in KiB/MiB/GiB (the budget was given so), else kB/MB/GB
    admit_after: int | None = None  # predict admission (TableSpec.admit_after) with this sketch
    admit_width: int = 1 << 20
    admit_depth: int = 4

    def __post_init__(self):
        if self.shards_rate is not None and not 0 < self.shards_rate <= 1:
            raise ValueError(f"--shards rate must be in (0, 1], got {self.shards_rate}")
        for name in ("hbm_target", "hit_target"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1:
                raise ValueError(f"{name} must be a hit ratio in (0, 1], got {v}")
        if (self.hbm_target or self.hit_target) and (self.hbm_bytes is not None or self.ddr_bytes is not None):
            raise ValueError("give hit-ratio targets (per table) or byte budgets (split across tables), not both")
        if self.hbm_target and self.hit_target and self.hit_target < self.hbm_target:
            raise ValueError(f"hit_target ({self.hit_target}) counts HBM and DDR hits, so it cannot be below hbm_target ({self.hbm_target})")
        for name in ("hbm_bytes", "ddr_bytes"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        bad = [p for p in self.policies if p not in ("lru", "lfu", "lookahead")]
        if bad:
            raise ValueError(f"unknown policies {bad}; simulate lru, lfu or lookahead")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1 (batches), got {self.window!r}")
        if not self.steps_per_s > 0:
            raise ValueError(f"steps_per_s must be > 0, got {self.steps_per_s}")
        if self.row_bytes is not None and self.row_bytes <= 0:
            raise ValueError(f"row_bytes must be > 0, got {self.row_bytes}")
        for h, d in self.sizes:
            _size_rows(h, 1)
            _size_rows(d, 1)
        if self.admit_after is not None:  # the store's own checks, with its messages
            from tierstore.spec import TableSpec
            TableSpec("t", None, 1, admit_after=self.admit_after, admit_width=self.admit_width, admit_depth=self.admit_depth)


def _size_rows(spec, working_set: float) -> int:
    s = str(spec).strip()
    try:
        if s.endswith("%"):
            v = float(s[:-1])
            if v < 0:
                raise ValueError
            return int(math.ceil(v / 100 * working_set))
        v = int(s)
        if v < 0:
            raise ValueError
        return v
    except ValueError:
        raise ValueError(f"a size must be rows (int >= 0) or a percentage of the working set like '5%', got {spec!r}") from None


def analyze(trace: Trace, config: CapacityConfig | None = None) -> dict:
    """The full report as a JSON-ready dict (see ``tierstore capacity --help``)."""
    cfg = config or CapacityConfig()
    names = list(cfg.tables) if cfg.tables else trace.table_names
    for n in names:
        trace.table_index(n)
    per_table = trace.accesses_per_table()
    empty = [n for n in names if per_table[trace.table_index(n)] == 0]
    if len(empty) == len(names):
        raise ValueError(f"the trace has no accesses{' to ' + ', '.join(map(repr, names)) if cfg.tables else ''} "
                         f"({trace.n_calls:,} calls): nothing to size. Record reads into it first "
                         "(a killed recorder keeps only what it synced), or pick tables that were read")
    n_steps = max(trace.n_steps, 1)
    per_s = cfg.steps_per_s / n_steps  # multiply a whole-trace count by this for a rate per second
    t0 = time.perf_counter()
    need_streams = cfg.shards_rate is None or cfg.compare_exact or bool(cfg.policies) or cfg.belady  # replays need every use
    streams = build_streams(trace, names) if need_streams else None
    t_streams = time.perf_counter() - t0
    report: dict = {
        "iec": cfg.iec,
        "notes": [f"table {n!r} has no accesses in this trace: its rows are zero" for n in empty],
        "trace": {"calls": trace.n_calls, "steps": trace.n_steps, "accesses": trace.n_accesses, "tables": len(names)},
        "steps_per_s": cfg.steps_per_s,
    }
    exact = None
    if cfg.shards_rate is None or cfg.compare_exact:
        te = time.perf_counter()
        dists = stack_distances(streams, cfg.progress)
        exact = [LruCurve.from_distances(s, d) for s, d in zip(streams, dists)]
        seconds = time.perf_counter() - te + t_streams  # the curve needs the streams too
        report["exact"] = {"seconds": seconds, "accesses_per_s": trace.n_accesses / max(seconds, 1e-9)}
    curves = exact
    if cfg.shards_rate is not None:
        sh = shards_curves(trace, cfg.shards_rate, names, cfg.seed, progress=cfg.progress)
        curves = sh.curves
        report["shards"] = {"rate": sh.rate, "table_rates": dict(zip(names, sh.table_rates)),
                            "min_sample_rows": MIN_SAMPLE_ROWS, "sampled_accesses": sh.sampled_accesses,
                            "seconds": sh.seconds, "accesses_per_s": trace.n_accesses / max(sh.seconds, 1e-9),
                            "error_bound": dict(zip(names, sh.max_bound)), "error_bound_mean": dict(zip(names, sh.mean_bound))}
        if exact is not None:
            report["shards"]["measured_mae"] = {c.name: mean_abs_error(a, c) for a, c in zip(sh.curves, exact)}
            report["shards"]["measured_max_error"] = {
                c.name: float(np.abs(a.hit_ratio(g) - c.hit_ratio(g)).max()) for a, c, g in zip(sh.curves, exact, sh.error_sizes)}
    report["method"] = "exact" if cfg.shards_rate is None else f"shards@{cfg.shards_rate:g}"
    row_bytes = [_row_bytes(trace.tables[trace.table_index(n)], cfg.row_bytes) for n in names]

    tables = []
    for i, c in enumerate(curves):
        grid = np.unique(np.concatenate([[0], np.geomspace(1, max(c.working_set, 1), 120).round()])).astype(np.int64)
        ratios = c.hit_ratio(grid)
        t = {
            "name": c.name, "accesses": c.n_accesses, "uses": _num(c.n_uses), "calls": c.n_calls,
            "working_set": _num(c.working_set), "uses_per_step": c.n_uses / n_steps,
            "row_bytes": row_bytes[i], "max_hit_ratio": c.max_hit_ratio(),
            "curve": {"rows": grid.tolist(), "hit_ratio": ratios.tolist(),
                      **({"error_bound": sh.bound(i, grid).tolist()} if cfg.shards_rate is not None else {})},
            "reuse_histogram": c.reuse_histogram(),
            "reuse_by_decade": _decade_shares(c),
            "ssd_no_cache": _rate(c.n_uses, per_s, row_bytes[i]),
        }
        if exact is not None and exact is not curves:
            t["exact_curve"] = {"rows": grid.tolist(), "hit_ratio": exact[i].hit_ratio(grid).tolist()}
        tables.append(t)

    # recommendations: targets per table, or a byte budget split across tables
    recs = None
    if cfg.hbm_target or cfg.hit_target:
        recs = [rows_for_targets(c, cfg.hbm_target, cfg.hit_target) for c in curves]
    if cfg.hbm_bytes is not None or cfg.ddr_bytes is not None:
        h = split_budget(curves, row_bytes, cfg.hbm_bytes or 0)
        d = split_budget(curves, row_bytes, cfg.ddr_bytes or 0, start=h)
        recs = [{"hbm_rows": hi, "ddr_rows": di, "reachable": True, "max_hit_ratio": c.max_hit_ratio()}
                for hi, di, c in zip(h, d, curves)]
        report["budget"] = {"hbm_bytes": cfg.hbm_bytes or 0, "ddr_bytes": cfg.ddr_bytes or 0,
                            "hbm_bytes_used": int(sum(x * b for x, b in zip(h, row_bytes))),
                            "ddr_bytes_used": int(sum(x * b for x, b in zip(d, row_bytes)))}
        full = all(float(c.hits(hi + di)) >= float(c.hits(math.ceil(c.working_set))) for c, hi, di in zip(curves, h, d))
        for tier, asked in (("HBM", cfg.hbm_bytes or 0), ("DDR", cfg.ddr_bytes or 0)):
            used = report["budget"][f"{tier.lower()}_bytes_used"]
            if asked > used and full:
                report["notes"].append(f"the {tier} budget {_fmt_bytes(asked, cfg.iec)} is beyond what the tables can use: "
                                       f"{_fmt_bytes(used, cfg.iec)} of it already get every hit the trace allows")
    if recs is not None:
        for t, c, r, rb in zip(tables, curves, recs, row_bytes):
            tiers = c.tiers(r["hbm_rows"], r["ddr_rows"])
            r.update(_tier_summary(tiers, c.n_uses, per_s, rb))
            r["hbm_bytes"], r["ddr_bytes"] = r["hbm_rows"] * rb, r["ddr_rows"] * rb
            t["recommendation"] = r

    # simulations at chosen sizes (default: the recommendation, else 1% / 10% of the working set)
    for i, (t, c) in enumerate(zip(tables, curves)):
        points = [(_size_rows(h, c.working_set), _size_rows(d, c.working_set)) for h, d in cfg.sizes]
        if not points:
            points = [(t["recommendation"]["hbm_rows"], t["recommendation"]["ddr_rows"])] if "recommendation" in t else \
                [(_size_rows("1%", c.working_set), _size_rows("10%", c.working_set))]
        sims = []
        for ask in points:
            h, d = clamp_sizes(*ask, c.working_set)
            if (h, d) != ask:
                report["notes"].append(
                    f"table {c.name!r}: {ask[0]:,}:{ask[1]:,} rows is beyond its working set of {_fmt(c.working_set)} rows "
                    f"(more rows cannot hit more); reported as {h:,}:{d:,}")
            # LRU needs no replay: the curve gives every size
            sims.append({"policy": "lru", "hbm_rows": h, "ddr_rows": d, "predicted": "curve" if c.exact else report["method"],
                         **_tier_summary(c.tiers(h, d), c.n_uses, per_s, row_bytes[i])})
            if streams is None:
                continue
            s = streams[i]
            for pol in cfg.policies:
                counts = simulate(s, h, d, pol, cfg.window, progress=cfg.progress)
                hh, dh = counts.hbm_hits, counts.ddr_hits
                sims.append({"policy": pol if pol != "lookahead" else f"lookahead(window={cfg.window}, base=lru)",
                             "hbm_rows": h, "ddr_rows": d, "predicted": "simulated",
                             **_tier_summary({"hbm_hits": hh, "ddr_hits": dh, "misses": s.n_uses - hh - dh}, s.n_uses, per_s, row_bytes[i])})
            if cfg.belady:
                bh = simulate(s, h, 0, "belady", progress=cfg.progress).hbm_hits if h else 0
                bt = simulate(s, h + d, 0, "belady", progress=cfg.progress).hbm_hits if h + d else 0
                sims.append({"policy": "belady (bound)", "hbm_rows": h, "ddr_rows": d, "predicted": "simulated",
                             **_tier_summary({"hbm_hits": bh, "ddr_hits": bt - bh, "misses": s.n_uses - bt}, s.n_uses, per_s, row_bytes[i])})
        t["simulations"] = sims
    report["tables"] = tables
    if cfg.admit_after is not None:
        report["admission"] = {n: predict_admission(trace, n, cfg.admit_after, cfg.admit_width, cfg.admit_depth) for n in names}
    report["total"] = _totals(tables, per_s)
    report["total"]["curve"] = total_curve(curves, row_bytes)
    report["seconds"] = time.perf_counter() - t0
    return report


DECADES = [10**k for k in range(1, 8)]


def _decade_shares(c: LruCurve) -> list[float]:
    """Share of uses with stack distance < 10, in [10, 100), ... >= 1e7, then first touches."""
    n = c.n_uses
    if not n:
        return [0.0] * (len(DECADES) + 2)
    below = np.asarray(c.hits(np.array(DECADES)), dtype=np.float64) / n
    reuses = 1.0 - c.working_set / n
    return np.maximum(np.diff(np.concatenate([[0.0], below, [reuses]])), 0.0).tolist() + [c.working_set / n]


def _row_bytes(table, override) -> int:
    if override:
        return int(override)
    if table.row_bytes:
        return int(table.row_bytes)
    if table.dim:
        return 4 * int(table.dim)
    return DEFAULT_ROW_BYTES


def _num(x):
    return int(round(x)) if float(x).is_integer() else float(x)


def _rate(rows: float, per_s: float, row_bytes: int) -> dict:
    r = float(rows) * per_s
    return {"rows_per_s": r, "mb_per_s": r * row_bytes / 1e6}


def _tier_summary(tiers: dict, uses: float, per_s: float, row_bytes: int) -> dict:
    uses = float(uses) or 1.0
    hh, dh, m = (float(tiers[k]) for k in ("hbm_hits", "ddr_hits", "misses"))
    out = {"hbm_hits": _num(hh), "ddr_hits": _num(dh), "misses": _num(m),
           "hbm_hit_ratio": hh / uses, "hit_ratio": (hh + dh) / uses}
    out["ssd"] = _rate(m, per_s, row_bytes)
    return out


def _totals(tables: list[dict], per_s: float) -> dict:
    out = {"accesses": sum(t["accesses"] for t in tables), "uses": sum(t["uses"] for t in tables),
           "working_set_rows": sum(t["working_set"] for t in tables),
           "working_set_bytes": sum(t["working_set"] * t["row_bytes"] for t in tables),
           "ssd_no_cache": {k: sum(t["ssd_no_cache"][k] for t in tables) for k in ("rows_per_s", "mb_per_s")}}
    if tables and all("recommendation" in t for t in tables):
        r = [t["recommendation"] for t in tables]
        uses = out["uses"] or 1
        out["recommendation"] = {
            "hbm_rows": sum(x["hbm_rows"] for x in r), "ddr_rows": sum(x["ddr_rows"] for x in r),
            "hbm_bytes": sum(x["hbm_bytes"] for x in r), "ddr_bytes": sum(x["ddr_bytes"] for x in r),
            "hbm_hit_ratio": sum(x["hbm_hits"] for x in r) / uses,
            "hit_ratio": sum(x["hbm_hits"] + x["ddr_hits"] for x in r) / uses,
            "ssd": {k: sum(x["ssd"][k] for x in r) for k in ("rows_per_s", "mb_per_s")},
        }
    return out


# -- output -----------------------------------------------------------------------------------------------
def format_report(report: dict) -> str:
    """A terminal table per section."""
    lines = []
    iec = report.get("iec", False)
    div, mb = _mb(report)
    tr = report["trace"]
    lines.append(f"trace: {tr['accesses']:,} accesses, {tr['calls']:,} calls, {tr['steps']:,} steps, {tr['tables']} tables; "
                 f"curves: {report['method']}; rates at {report['steps_per_s']:g} steps/s")
    if "exact" in report:
        lines.append(f"exact LRU curve: {report['exact']['seconds']:.2f} s ({report['exact']['accesses_per_s'] / 1e6:.1f}M accesses/s)")
    if "shards" in report:
        s = report["shards"]
        worst = lambda d: max([v for v in d.values() if v == v], default=float("nan"))  # noqa: E731
        raised = {n: r for n, r in s["table_rates"].items() if r > s["rate"]}
        line = (f"SHARDS rate {s['rate']:g}: {s['sampled_accesses']:,} sampled accesses, {s['seconds']:.2f} s "
                f"({s['accesses_per_s'] / 1e6:.1f}M accesses/s)")
        if raised:
            line += (f"; rate raised to sample >= {s['min_sample_rows']:,} rows in {len(raised)} table(s) ("
                     + ", ".join(f"{n} {r:.3g}" for n, r in list(raised.items())[:5]) + (", ..." if len(raised) > 5 else "") + ")")
        lines.append(line)
        line = (f"SHARDS miss-ratio error bound ({ERROR_SIGMAS:g} sigma of {SUB_SAMPLES} sub-samples + resolution, worst table): "
                f"<= {worst(s['error_bound']):.4f} at any size, {worst(s['error_bound_mean']):.4f} on average")
        if "measured_mae" in s:
            line += f"; measured max {worst(s['measured_max_error']):.4f}, mean {worst(s['measured_mae']):.4f}"
        lines.append(line)
    lines += [f"note: {n}" for n in report.get("notes", [])]
    lines.append("")
    head = ["table", "accesses", "uses/step", "working set", "max hit", "hit@1%", "hit@10%", f"SSD {mb}/s no cache"]
    rows = []
    for t in report["tables"]:
        rows_grid, ratio = np.array(t["curve"]["rows"]), np.array(t["curve"]["hit_ratio"])
        at = lambda f: float(np.interp(f * t["working_set"], rows_grid, ratio))  # noqa: E731
        rows.append([t["name"], f"{t['accesses']:,}", f"{t['uses_per_step']:,.0f}", f"{_fmt(t['working_set'])} rows",
                     f"{t['max_hit_ratio']:.3f}", f"{at(0.01):.3f}", f"{at(0.10):.3f}", f"{t['ssd_no_cache']['mb_per_s'] * 1e6 / div:,.1f}"])
    lines += _table(head, rows)
    lines.append("")
    lines.append("reuse distances (share of uses by LRU stack distance, rows; first touch = cold miss at any size):")
    head = ["table"] + [f"<{_fmt_rows(d)}" for d in DECADES] + [f">={_fmt_rows(DECADES[-1])}", "first touch"]
    rows = [[t["name"]] + [f"{x:.3f}" for x in t["reuse_by_decade"]] for t in report["tables"]]
    lines += _table(head, rows)
    if any("recommendation" in t for t in report["tables"]):
        lines.append("")
        lines.append("recommendation (LRU" + (", byte budget split" if "budget" in report else ", targets") + "):")
        head = ["table", "HBM rows", "DDR rows", "HBM hit", "hit", "SSD rows/s", f"SSD {mb}/s", "note"]
        rows = []
        for t in report["tables"]:
            r = t.get("recommendation")
            if r:
                rows.append([t["name"], f"{r['hbm_rows']:,}", f"{r['ddr_rows']:,}", f"{r['hbm_hit_ratio']:.3f}", f"{r['hit_ratio']:.3f}",
                             f"{r['ssd']['rows_per_s']:,.0f}", f"{r['ssd']['mb_per_s'] * 1e6 / div:,.1f}",
                             "" if r["reachable"] else f"target unreachable (max {r['max_hit_ratio']:.3f}: first touches)"])
        tot = report["total"].get("recommendation")
        if tot:
            rows.append(["TOTAL", f"{tot['hbm_rows']:,}", f"{tot['ddr_rows']:,}", f"{tot['hbm_hit_ratio']:.3f}", f"{tot['hit_ratio']:.3f}",
                         f"{tot['ssd']['rows_per_s']:,.0f}", f"{tot['ssd']['mb_per_s'] * 1e6 / div:,.1f}",
                         f"{_fmt_bytes(tot['hbm_bytes'], iec)} HBM + {_fmt_bytes(tot['ddr_bytes'], iec)} DDR"])
        lines += _table(head, rows)
    if any("simulations" in t for t in report["tables"]):
        lines.append("")
        lines.append("at chosen sizes (LRU read off the curve, other policies replayed; hits as the store counts them):")
        head = ["table", "policy", "HBM rows", "DDR rows", "HBM hit", "hit", "SSD rows/s", f"SSD {mb}/s"]
        rows = []
        for t in report["tables"]:
            for s in t.get("simulations", []):
                name = s["policy"] if s["predicted"] == "simulated" or "belady" in s["policy"] else f"{s['policy']} ({s['predicted']})"
                rows.append([t["name"], name, f"{s['hbm_rows']:,}", f"{s['ddr_rows']:,}", f"{s['hbm_hit_ratio']:.3f}",
                             f"{s['hit_ratio']:.3f}", f"{s['ssd']['rows_per_s']:,.0f}", f"{s['ssd']['mb_per_s'] * 1e6 / div:,.1f}"])
        lines += _table(head, rows)
    if "admission" in report:
        lines.append("")
        first = next(iter(report["admission"].values()))
        lines.append(f"admission (admit_after {first['admit_after']}, sketch {first['sketch']['width']:,} x {first['sketch']['depth']}, "
                     f"{_fmt_bytes(first['sketch']['bytes'], iec)} a table; uses kept / dropped, rows that get storage):")
        head = ["table", "distinct rows", "rows stored", "uses kept", "uses dropped", "sketch fill", "exact: rows stored", "uses dropped"]
        rows = [[n, f"{a['distinct_rows']:,}", f"{a['rows_admitted']:,}", f"{a['admitted']:,}", f"{a['rejected']:,}",
                 f"{a['sketch']['fill']:.3f}", f"{a['exact_rows_admitted']:,}", f"{a['exact_rejected']:,}"]
                for n, a in report["admission"].items()]
        lines += _table(head, rows)
    tot = report["total"]
    lines.append("")
    lines.append(f"total: working set {_fmt(tot['working_set_rows'])} rows ({_fmt_bytes(tot['working_set_bytes'], iec)}); "
                 f"SSD demand with no cache {tot['ssd_no_cache']['mb_per_s'] * 1e6 / div:,.1f} {mb}/s")
    tc = tot.get("curve")
    if tc and tc["hit_ratio"]:
        ratio, spent = np.array(tc["hit_ratio"]), np.array(tc["bytes"])
        top = float(ratio.max())
        marks = [f"{q:.0%} of the max at {_fmt_bytes(float(spent[np.argmax(ratio >= q * top - 1e-12)]), iec)}" for q in (0.5, 0.8, 0.9, 0.99)]
        lines.append(f"total LRU hit ratio with a cache split well across tables: max {top:.3f}; " + ", ".join(marks))
    return "\n".join(lines)


def _table(head, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _fmt_rows(n: int) -> str:
    return f"{n // 10**6}M" if n >= 10**6 else f"{n // 1000}k" if n >= 1000 else str(n)


def _fmt(x) -> str:
    return f"{x:,.0f}"


def _fmt_bytes(b, iec: bool = False) -> str:
    step, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if iec else (1000, ("B", "kB", "MB", "GB", "TB"))
    for unit in units:
        if abs(b) < step or unit == units[-1]:
            return f"{b:,.1f} {unit}"
        b /= step


def _mb(report: dict) -> tuple[float, str]:
    """The unit of the report's bandwidths: MiB/s when bytes were given in binary units."""
    return (2**20, "MiB") if report.get("iec") else (1e6, "MB")


_POLICY_STYLE = {  # marker and colour per replayed policy, apart from the tables' line colours
    "lru": ("o", "none", "simulated LRU"),
    "lfu": ("s", "tab:red", "LFU"),
    "lookahead": ("^", "tab:purple", "lookahead"),
    "belady": ("x", "black", "Belady bound"),
}


def _policy_key(name: str) -> str:
    return next(k for k in _POLICY_STYLE if name.startswith(k))


def plot_report(report: dict, out_dir: str | Path) -> list[Path]:
    """PNG plots: the miss-ratio curves, the total curve against bytes, and the SSD bandwidth per table."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'tierstore[plot]'") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    tables = report["tables"]
    div, mb = _mb(report)
    iec = report.get("iec", False)
    plain = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")

    fig, ax = plt.subplots(figsize=(9, 5.5))
    seen = set()
    for t in tables[:20]:
        rows = np.maximum(np.array(t["curve"]["rows"]), 1)
        miss = 1 - np.array(t["curve"]["hit_ratio"])
        (line,) = ax.plot(rows, miss, label=t["name"])
        if "error_bound" in t["curve"]:
            err = np.array(t["curve"]["error_bound"])
            ax.fill_between(rows, np.clip(miss - err, 0, 1), np.clip(miss + err, 0, 1), color=line.get_color(), alpha=0.15, lw=0)
        if "exact_curve" in t:
            ax.plot(rows, 1 - np.array(t["exact_curve"]["hit_ratio"]), "k:", lw=0.8)
        r = t.get("recommendation")
        if r:  # the recommended sizes: HBM alone and HBM + DDR
            for size, ratio, mk in ((r["hbm_rows"], r["hbm_hit_ratio"], "v"), (r["hbm_rows"] + r["ddr_rows"], r["hit_ratio"], "*")):
                ax.plot(max(size, 1), 1 - ratio, mk, color=line.get_color(), ms=12, mec="black", mew=0.8, zorder=5)
                ax.axvline(max(size, 1), color=line.get_color(), ls="--", lw=0.8, alpha=0.7)
        for s in t.get("simulations", []):
            if s["predicted"] != "simulated":
                continue
            k = _policy_key(s["policy"])
            marker, colour, _ = _POLICY_STYLE[k]
            for size, ratio in ((s["hbm_rows"], s["hbm_hit_ratio"]), (s["hbm_rows"] + s["ddr_rows"], s["hit_ratio"])):
                if size:  # HBM hits at the HBM size, all cache hits at HBM + DDR
                    ax.plot(size, 1 - ratio, marker, ms=8, mew=1.5, zorder=6,
                            color=line.get_color() if colour == "none" else colour, mfc="none" if marker != "x" else None)
            seen.add(k)
    for k in _POLICY_STYLE:  # legend entries for the point styles used
        if k in seen:
            marker, colour, label = _POLICY_STYLE[k]
            ax.plot([], [], marker, color="gray" if colour == "none" else colour, mfc="none" if marker != "x" else None,
                    ms=8, mew=1.5, ls="none", label=label)
    if any(t.get("recommendation") for t in tables):
        ax.plot([], [], "v", color="gray", mec="black", ms=10, ls="none", label="recommended HBM rows")
        ax.plot([], [], "*", color="gray", mec="black", ms=12, ls="none", label="recommended HBM + DDR rows")
    if any("exact_curve" in t for t in tables):
        ax.plot([], [], "k:", lw=0.8, label="exact LRU")
    if any("error_bound" in t["curve"] for t in tables):
        ax.fill_between([], [], [], color="gray", alpha=0.15, label="SHARDS error bound")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plain)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("cache rows (HBM + DDR), per table")
    ax.set_ylabel("miss ratio\n(points: HBM at HBM rows, all tiers at HBM + DDR)")
    ax.set_title(f"Miss ratio against cache rows per table ({report['method']})")
    ax.legend(fontsize=7, loc="lower left", ncol=2 if len(tables) > 6 else 1)
    ax.grid(True, which="both", alpha=0.3)
    files.append(out / "miss_ratio.png")
    fig.savefig(files[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    tc = report.get("total", {}).get("curve")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if tc and tc["bytes"]:
        ax.plot(np.maximum(np.array(tc["bytes"]), 1) / div, 1 - np.array(tc["hit_ratio"]), "k-", label="LRU, bytes split for the most hits")
    b = report.get("budget")
    if b:  # the chosen budget: HBM alone, then HBM + DDR
        for x, label, colour in ((b["hbm_bytes"], "HBM budget", "tab:green"), (b["hbm_bytes"] + b["ddr_bytes"], "HBM + DDR budget", "tab:orange")):
            if x > 0:
                ax.axvline(x / div, color=colour, ls="--", lw=1.5, label=f"{label} {_fmt_bytes(x, iec)}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plain)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"cache {mb} (HBM + DDR), split across tables for the most hits")
    ax.set_ylabel("miss ratio, all tables (LRU)")
    ax.set_title("Miss ratio of the whole trace against cache bytes")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    files.append(out / "total_miss_ratio.png")
    fig.savefig(files[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    files.append(out / "ssd_bandwidth.png")
    _plot_bandwidth(report, files[-1], plt, plain, div, mb)
    return files


def _plot_bandwidth(report: dict, path: Path, plt, plain, div: float, mb: str) -> None:
    """SSD reads per table and in total, with no cache and with the recommended tiers:
    a log axis (demands span decades) whose bars start a decade below the smallest,
    so a small bar still shows, with the value written on each."""
    tables = report["tables"]
    names = [t["name"] for t in tables] + ["TOTAL"]
    series = [("no cache", [t["ssd_no_cache"]["mb_per_s"] for t in tables] + [report["total"]["ssd_no_cache"]["mb_per_s"]], "tab:gray")]
    rec = report["total"].get("recommendation")
    if rec:
        series.append(("recommended tiers", [t["recommendation"]["ssd"]["mb_per_s"] for t in tables] + [rec["ssd"]["mb_per_s"]], "tab:blue"))
    values = np.array([v for _, vs, _ in series for v in vs]) * 1e6 / div
    positive = values[values > 0]
    bottom = 10 ** math.floor(math.log10(positive.min())) / 10 if len(positive) else 0.1
    top = max(positive.max() if len(positive) else 1.0, bottom * 10) * 4
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) + 2), 4.5))
    x = np.arange(len(names))
    width = 0.8 / len(series)
    for i, (label, vs, colour) in enumerate(series):
        v = np.array(vs) * 1e6 / div
        pos = x - 0.4 + width * (i + 0.5)
        ax.bar(pos, np.maximum(v, bottom) - bottom, width, bottom=bottom, label=label, color=colour)
        for px, val in zip(pos, v):
            ax.text(px, max(val, bottom) * 1.15, f"{val:.2g}" if val < 1 else f"{val:,.1f}" if val < 100 else f"{val:,.0f}", ha="center", va="bottom", fontsize=7)
    ax.axvline(len(names) - 1.5, color="black", lw=0.6)
    ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    ax.yaxis.set_major_formatter(plain)
    ax.set_xticks(x, names, rotation=90 if len(names) > 10 else 0, fontsize=8)
    ax.set_ylabel(f"SSD reads, {mb}/s")
    ax.set_title(f"SSD read bandwidth per table and in total at {report['steps_per_s']:g} steps/s")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def to_json(report: dict) -> str:
    return json.dumps(report, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


PROGRESS_SECONDS = 5.0  # between progress lines when stderr is not a terminal
PROGRESS_ACCESSES = 2_000_000  # traces longer than this show progress by default (a run of seconds or more)


class _LineBar:
    """Progress for a log or a pipe: a line to stderr every PROGRESS_SECONDS, and one at the end."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.t0 = self.shown = time.monotonic()

    def _line(self, now: float, end: str = "") -> None:
        rate = self.n / max(now - self.t0, 1e-9)
        left = f", ~{(self.total - self.n) / rate:,.0f} s left" if rate and self.n < self.total else ""
        print(f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}s ({self.n / max(self.total, 1):.0%}, "
              f"{rate:,.0f} {self.unit}s/s{left}){end}", file=sys.stderr, flush=True)
        self.shown = now

    def update(self, n):
        self.n += n
        now = time.monotonic()
        if now - self.shown >= PROGRESS_SECONDS:
            self._line(now)

    def close(self):
        self._line(time.monotonic(), f", done in {time.monotonic() - self.t0:.1f} s")


def _progress(total: int, desc: str, enabled: bool):
    """tqdm on a terminal, timed lines otherwise (both to stderr), or nothing."""
    if not enabled:
        return _NoBar()
    unit = "id" if "SHARDS" in desc else "use"
    if not sys.stderr.isatty():
        return _LineBar(total, desc, unit)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, leave=False)


# -- benchmark ---------------------------------------------------------------------------------------------
def bench(args) -> None:
    """``tierstore bench capacity``: exact LRU and SHARDS speed on a Zipf trace, against
    a plain-Python LRU simulation of one size on a prefix of the same trace."""
    from collections import OrderedDict

    from tierstore.tools.bench import report as bench_report
    from tierstore.tools.synth import SynthConfig, synth

    # the trace: 10M accesses, Zipf 1.05 over 10M rows; --batch sets the ids per call
    accesses, rows = 10_000_000, 10_000_000
    batch = int(getattr(args, "batch", 65_536))
    steps = -(-accesses // batch)
    cfg = SynthConfig(tables=(("t0", rows),), alpha=1.05, batch_size=batch, pooling=1, steps=steps, seed=int(getattr(args, "seed", 0)))
    trace = synth(cfg)
    from tierstore.tools.bench import median_seconds

    repeat = max(1, min(int(getattr(args, "repeat", 3)), 3))  # each run is seconds long
    # baseline: an OrderedDict LRU of one size (1% of the rows), per id, on the first 1M accesses
    ids = trace.ids[:1_000_000].tolist()

    def one_size_lru():
        lru, cap = OrderedDict(), rows // 100
        for x in ids:
            if x in lru:
                lru.move_to_end(x)
            else:
                lru[x] = None
                if len(lru) > cap:
                    lru.popitem(last=False)

    base = len(ids) / median_seconds(one_size_lru, repeat, warmup=0)
    exact = trace.n_accesses / median_seconds(lambda: lru_curves(trace), repeat, warmup=0)
    fast = trace.n_accesses / median_seconds(lambda: shards_curves(trace, 0.01, estimate_error=False), repeat, warmup=0)
    bench_report(
        "capacity: miss-ratio curves of a Zipf trace",
        {"accesses": f"{trace.n_accesses:,}", "rows": f"{rows:,}", "alpha": 1.05, "batch": batch, "median of": repeat},
        [("plain-Python LRU, one size", f"{base / 1e6:.2f}M accesses/s"),
         ("exact LRU curve, every size", f"{exact / 1e6:.2f}M accesses/s (goal >= 2M)"),
         ("SHARDS rate 0.01", f"{fast / 1e6:.2f}M accesses/s (goal >= 20M)")],
        "exact curve vs one-size Python LRU", exact / base, ">= 1x, while giving every size at once",
    )


# -- admission (TableSpec.admit_after) ------------------------------------------------------------
def predict_admission(trace: Trace, table: str, admit_after: int, width: int = 1 << 20, depth: int = 4) -> dict:
    """What a table with ``admit_after`` does on this trace, each read call one step:
    ``admitted`` and ``rejected`` row uses (update kept; initial value served and
    update dropped) and ``rows_admitted`` (rows admitted by the end: those that get
    storage once trained), by the store's own count-min sketch, so equal to its
    counters; ``exact_*`` the same by exact counts: the difference is the
    sketch's false positives (rows admitted early)."""
    from tierstore.admission import CountMinSketch

    ids, offsets, _ = trace.table_calls(trace.table_index(table))
    sketch = CountMinSketch(width, depth) if admit_after > 1 else None
    rejected, kept = 0, []
    for lo, hi in zip(offsets[:-1], offsets[1:]):  # a loop per call, as the store's steps
        if sketch is None:
            break
        uid = np.unique(ids[lo:hi])
        admitted = sketch.add(uid)[1] >= admit_after
        rejected += len(uid) - int(admitted.sum())
        kept.append(uid[admitted])
    rows, uses = _uses_per_row(ids, offsets)
    exact_rejected = int(np.minimum(uses, admit_after - 1).sum())
    # admitted at one of its uses (not merely by the end, through other rows' counts)
    rows_admitted = len(np.unique(np.concatenate(kept))) if kept else (0 if sketch else len(rows))
    return {"admit_after": admit_after, "sketch": {"width": width, "depth": depth, "bytes": width * depth,
                                                   "fill": sketch.fill() if sketch else 0.0},
            "distinct_rows": len(rows), "uses": int(uses.sum()), "admitted": int(uses.sum()) - rejected, "rejected": rejected,
            "rows_admitted": rows_admitted, "exact_admitted": int(uses.sum()) - exact_rejected, "exact_rejected": exact_rejected,
            "exact_rows_admitted": int((uses >= admit_after).sum())}


def _uses_per_row(ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows, and the calls that use each (a row repeated in a call counts once)."""
    call = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    pairs = np.unique(np.stack([ids, call]), axis=1)  # (row, call) once each
    return np.unique(pairs[0], return_counts=True)
