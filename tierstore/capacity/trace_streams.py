"""A trace's calls as the store sees them: per table, each call's unique rows.

The store's batch semantics (tierstore/store.py): a call's unique ids are its
*uses*; the store counts each once (a hit at the highest tier that held it, a
miss at each existing tier above). A use's key is ``clock_at_call_start +
first_position_in_call``. Only the order of keys matters, and tiers are per
table, so each table is analysed on its own clock (its own positions); that
preserves the order of the store's one clock.

:class:`TableStream` is that view of one table, with every use linked to its
row's previous use: what the LRU curves (tierstore/capacity/curves.py), SHARDS
(tierstore/capacity/shards.py) and the cache simulators (tierstore/capacity/cachesim.py) read.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tierstore.capacity.progress import Progress, ProgressFactory, open_progress
from tierstore.trace import Trace


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


def build_stream(trace: Trace, table: int, bar: Progress | None = None) -> TableStream:
    """Deduplicate each call of one table the way the store does and link every
    use to its row's previous use; ``bar`` counts the ids done."""
    if bar is None:
        bar = open_progress(None, 0, "")
    ids, offsets, calls = trace.table_calls(table)
    dense, space = _densify(ids)
    n_calls = len(calls)
    t = trace.tables[table]
    if n_calls and len(ids) < SMALL_CALLS * n_calls and space * n_calls < 2**62:
        row, key, prev, bounds = _dedupe_by_sort(dense, offsets)
        bar.update(len(ids))  # one sort: done all at once
    else:
        row, key, prev, bounds = _dedupe_per_call(dense, offsets, space, bar)
    return TableStream(t.name, row, key, prev, bounds, calls.astype(np.int64), space, len(ids), t.num_rows)


SMALL_CALLS = 64  # mean ids per call below which one sort beats a loop over calls


def _dedupe_per_call(dense: np.ndarray, offsets: np.ndarray, space: int, bar: Progress):
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
        bar.update(e - s)
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


def build_streams(trace: Trace, tables: Sequence[str] | None = None, progress: ProgressFactory | None = None) -> list[TableStream]:
    """The streams of ``tables`` (default: every table of the trace), in that order;
    ``progress`` (tierstore.capacity.progress) is shown one bar over their ids."""
    names = list(tables) if tables else trace.table_names
    per_table = trace.accesses_per_table()
    bar = open_progress(progress, int(sum(per_table[trace.table_index(n)] for n in names)), "deduplicating ids")
    streams = [build_stream(trace, trace.table_index(n), bar) for n in names]
    bar.close()
    return streams


def trace_counts(trace: Trace, names: Sequence[str]) -> tuple[list[int], list[int]]:
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
