"""Rows on their way to LMDB, written by one background thread.

Dirty rows leaving the cache and writes of rows that are not cached are queued
here, so a training step never waits for an LMDB commit. Until its batch is
committed and reaped, a queued row's value is newer than LMDB's: the store
reads it from here before LMDB, and prefetch stages it from here.

The writer commits several batches in one transaction: it waits until
``group_rows`` rows are queued (at most half the limit), someone waits for the
queue (flush, close, backpressure) or ``linger`` seconds have passed. LMDB
copies a whole 4 KiB page for each row a transaction changes, so rows that share
a page cost one copy: grouping a DLRM trainer's ~3,700 evicted rows a step about
six steps at a time cut the writer's CPU by about a quarter (200k rows of 256
bytes on 15k pages).

Queued rows are kept once per table, newest value only, in a row pool under a
sorted index (ids -> pool slots, found by binary search): finding a step's rows among a few dozen queued
batches is one probe and one gather, where a search per batch cost ~1.5 ms a
step. A batch records only its ids; a commit writes the newest value of each,
taken under the lock, so a row queued twice is written once. A committed batch
leaves the index only the rows that no later batch queued again.

Order keeps values right: batches commit in the order they were queued, and a
commit writes the newest queued values, so LMDB never goes back to an older one. A failed commit stops the
writer (a later batch must not overtake it) and keeps the batch queued; the
failure is raised by the store's next call, and ``retry()`` (flush) resumes.
Nothing queued is ever dropped, except at close after a failed final flush.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .codecs import unique_ids
from .backend import RowBackend

Items = list[tuple[str, np.ndarray, np.ndarray]]  # (table, sorted unique ids, rows)


@dataclass
class WriteBatch:
    ids: list[tuple[str, np.ndarray]]  # (table, sorted unique ids): their values are in the pool
    meta: dict | None
    rows: int
    seq: int
    committed: bool = False


_SEGMENT = 1 << 40  # slot = segment * _SEGMENT + row; segment 0 is the pool, the others adopted bulk writes


class QueuedRows:
    """The newest queued value of each row of one table: its ids sorted, each
    with a slot holding its value and last-use step (np.insert and np.delete
    move a few hundred KiB at most, far less than a search per queued batch).

    Slots are in a growable pool with a free list, or, for a write of at least
    ``adopt_rows`` rows, in that write's own array, adopted uncopied as a
    segment and released whole once its last row is committed or overwritten:
    copying a bulk write into the pool would hold the pool at twice its size
    for good (a 1M x 128 write: 512 MiB more, copied under the store's lock)."""

    def __init__(self, width: int, capacity: int = 1024, adopt_rows: int = 1 << 16, limit_rows: int | None = None):
        self.width = width
        self.ids = np.empty(0, dtype=np.int64)  # sorted
        self.slots = np.empty(0, dtype=np.int64)  # of each id
        self.pool = np.empty((capacity, width), dtype=np.float32)
        self.seq = np.zeros(capacity, dtype=np.int64)  # the batch that queued each slot's value
        self.last = np.zeros(capacity, dtype=np.int64)  # each slot's last-use step (tables with ttl_steps)
        self.places = np.full(capacity, -1, dtype=np.int64)  # where the backend found each slot's row (-1: not known)
        self._free = np.arange(capacity - 1, -1, -1)  # a stack of free pool slots
        self._nfree = capacity
        self._adopt_rows = adopt_rows
        self._limit_rows = limit_rows  # the queue's limit: the pool doubles up to it, no further
        self._segments: dict[int, list] = {}  # number -> [rows, seq, last, places of each row, rows still queued]
        self._next_segment = 1

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes of row storage held (pool and adopted writes)."""
        return self.pool.nbytes + sum(rows.nbytes for rows, *_ in self._segments.values())

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.searchsorted(self.ids, ids)
        found = pos < len(self.ids)
        found[found] = self.ids[pos[found]] == ids[found]
        return pos, found

    def _by_segment(self, slots: np.ndarray):
        """(segment, its rows, seq, last and places, mask of the ``slots`` in it or None for all, their rows there)."""
        number = slots // _SEGMENT
        if not len(slots) or number[0] == number[-1] and (number == number[0]).all():  # the usual case: one
            parts = [(int(number[0]) if len(slots) else 0, None)]
        else:
            parts = [(int(k), number == k) for k in unique_ids(number)]
        for k, mask in parts:
            rows, seq, last, places = (self.pool, self.seq, self.last, self.places) if k == 0 else self._segments[k][:4]
            yield k, rows, seq, last, places, mask, (slots if mask is None else slots[mask]) - k * _SEGMENT

    def put(self, ids: np.ndarray, rows: np.ndarray, seq: int, last: np.ndarray | None = None,
            places: np.ndarray | None = None) -> None:
        """Queue the rows of sorted unique ``ids`` as batch ``seq``'s, replacing older queued
        values; ``last``: their last-use steps; ``places``: where the backend found them."""
        pos, found = self._find(ids)
        old = self.slots[pos[found]]
        if len(ids) >= self._adopt_rows:  # a bulk write: its rows become a segment, uncopied
            k, self._next_segment = self._next_segment, self._next_segment + 1
            steps = np.zeros(len(ids), dtype=np.int64) if last is None else np.array(last, dtype=np.int64)
            where = np.full(len(ids), -1, dtype=np.int64) if places is None else np.array(places, dtype=np.int64)
            self._segments[k] = [np.ascontiguousarray(rows, dtype=np.float32), np.full(len(ids), seq), steps, where, len(ids)]
            slots = k * _SEGMENT + np.arange(len(ids))
            self._release(old)
            self.slots[pos[found]] = slots[found]
            fresh = slots[~found]
        else:  # into the pool: a row queued in a segment moves to the pool, so it does not keep the segment
            moved = old >= _SEGMENT
            n_new = len(ids) - len(old) + int(moved.sum())
            if n_new > self._nfree:
                self._grow(n_new - self._nfree)
            taken = self._free[self._nfree - n_new: self._nfree].copy()
            self._nfree -= n_new
            self._release(old[moved])
            old[moved] = taken[: int(moved.sum())]
            self.slots[pos[found]] = old
            fresh = taken[int(moved.sum()):]
            slots = np.empty(len(ids), dtype=np.int64)
            slots[found] = old
            slots[~found] = fresh
            self.pool[slots] = rows
            self.seq[slots] = seq
            if last is not None:
                self.last[slots] = last
            self.places[slots] = -1 if places is None else places
        # in one statement: a Ctrl-C between two (the main thread's KeyboardInterrupt) left ids
        # longer than slots, and the writer thread failed on them at its next commit
        self.ids, self.slots = np.insert(self.ids, pos[~found], ids[~found]), np.insert(self.slots, pos[~found], fresh)

    def _release(self, slots: np.ndarray) -> None:
        """Slots whose values are no longer queued: back to the pool, or off their segment."""
        for k, *_, local in self._by_segment(slots):
            if k == 0:
                self._free[self._nfree: self._nfree + len(local)] = local
                self._nfree += len(local)
            else:
                self._segments[k][4] -= len(local)
                if self._segments[k][4] == 0:
                    del self._segments[k]

    def _grow(self, extra: int) -> None:
        """At least ``extra`` more free slots."""
        old = len(self.pool)
        doubled = 2 * old if self._limit_rows is None else min(2 * old, max(self._limit_rows, old))
        new = max(doubled, old + extra)
        self.pool = np.concatenate([self.pool, np.empty((new - old, self.width), dtype=np.float32)])
        self.seq = np.concatenate([self.seq, np.zeros(new - old, dtype=np.int64)])
        self.last = np.concatenate([self.last, np.zeros(new - old, dtype=np.int64)])
        self.places = np.concatenate([self.places, np.full(new - old, -1, dtype=np.int64)])
        free = np.empty(new, dtype=np.int64)
        free[: new - old] = np.arange(new - 1, old - 1, -1)
        free[new - old: new - old + self._nfree] = self._free[: self._nfree]
        self._free, self._nfree = free, new - old + self._nfree

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(mask of the sorted ``ids`` queued, their newest rows; None if none is)."""
        if not len(self.ids) or not len(ids):
            return np.zeros(len(ids), dtype=bool), None
        pos, found = self._find(ids)
        if not found.any():
            return found, None
        slots = self.slots[pos[found]]
        out = None
        for _, rows, _, _, _, mask, local in self._by_segment(slots):
            if mask is None:  # one segment
                if local[-1] - local[0] == len(local) - 1 and (np.diff(local) == 1).all():
                    return found, rows[local[0]: local[-1] + 1].copy()  # a bulk write's rows: one memcpy
                return found, rows[local]
            if out is None:
                out = np.empty((len(slots), self.width), dtype=np.float32)
            out[mask] = rows[local]
        return found, out

    def get_last(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of the sorted ``ids`` queued, last-use steps of the queued ones)."""
        return self._per_row(ids, places=False)

    def get_places(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask of the sorted ``ids`` queued, where the backend found the queued ones)."""
        return self._per_row(ids, places=True)

    def _per_row(self, ids: np.ndarray, places: bool) -> tuple[np.ndarray, np.ndarray]:
        """(mask of the sorted ``ids`` queued, the queued ones' places, or last-use steps)."""
        if not len(self.ids) or not len(ids):
            return np.zeros(len(ids), dtype=bool), np.empty(0, dtype=np.int64)
        pos, found = self._find(ids)
        slots = self.slots[pos[found]]
        out = np.empty(len(slots), dtype=np.int64)
        for _, _, _, last, where, mask, local in self._by_segment(slots):
            out[slice(None) if mask is None else mask] = (where if places else last)[local]
        return found, out

    def drop(self, ids: np.ndarray, seq: int) -> None:
        """Batches up to ``seq`` are committed (they commit in order): forget those of their
        rows, sorted unique ``ids``, that no later batch queued again."""
        pos, found = self._find(ids)
        pos = pos[found]
        slots = self.slots[pos]
        mine = np.zeros(len(pos), dtype=bool)
        for _, _, slot_seq, _, _, mask, local in self._by_segment(slots):
            mine[slice(None) if mask is None else mask] = slot_seq[local] <= seq
        self._release(slots[mine])
        self.ids = np.delete(self.ids, pos[mine])
        self.slots = np.delete(self.slots, pos[mine])


class WriteBack:
    """The queue and its writer thread. Every method runs with ``lock`` (the
    store's) held by the caller; waits release it, as Condition waits do."""

    def __init__(self, backend: RowBackend, lock: threading.RLock, limit_rows: int, group_rows: int = 0, linger: float = 1.0,
                 sweep_rows: int = 4096, on_swept: Callable[[str, int], None] | None = None):
        self._backend = backend
        # the sweep: after each commit, sweep_rows rows plus twice those committed of each
        # table in sweeps, {table: (last-use cutoff step or None, L2 norm or None)}, are looked
        # at and deleted if last used at or before the cutoff, or with weights below the norm
        # (RowBackend.sweep); on_swept(table, rows deleted) is called with the lock held
        self._sweep_rows = sweep_rows
        self.sweeps: dict[str, tuple[int | None, float | None]] = {}
        self._on_swept = on_swept
        self._cond = threading.Condition(lock)
        self._limit = limit_rows
        self._group = min(group_rows, limit_rows // 2)  # due before calls wait for the queue
        self._linger = linger
        self._waiters = 0  # callers waiting for commits: the writer does not linger
        self._queue: deque[WriteBatch] = deque()
        self._queued: dict[str, QueuedRows] = {}
        self._seq = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None  # alive while there is something to write
        self.changed: dict[str, list[np.ndarray]] | None = None  # ids submitted, once recording (TieredStore.take_changes)

    @property
    def queued_rows(self) -> int:
        """Rows not yet committed."""
        return sum(b.rows for b in self._queue if not b.committed)

    def submit(self, items: Items, meta: dict | None = None, last: dict[str, np.ndarray] | None = None,
               places: dict[str, np.ndarray] | None = None) -> None:
        """Queue rows (and store metadata), committed together, perhaps with other
        batches; returns at once. The queue owns the rows arrays from now on.
        ``last[table]``: the rows' last-use steps, for tables that keep them;
        ``places[table]``: where the backend found them (RowBackend.put_rows)."""
        self._seq += 1
        for table, ids, _ in items if self.changed is not None else ():
            self.changed.setdefault(table, []).append(ids.copy())
        for table, ids, rows in items:
            if table not in self._queued:
                self._queued[table] = QueuedRows(rows.shape[1], limit_rows=self._limit)
            self._queued[table].put(ids, rows, self._seq, (last or {}).get(table), (places or {}).get(table))
        self._queue.append(WriteBatch([(table, ids) for table, ids, _ in items], meta, sum(len(ids) for _, ids, _ in items), self._seq))
        self._wake()

    def reap(self, wait_below_limit: bool = True) -> None:
        """Drop committed batches from the queue; raise the writer's failure.

        With ``wait_below_limit``, first wait while more rows are queued than the
        limit: the backpressure that bounds the queue's memory. Call it only
        where the caller holds no plan that another thread could invalidate.
        """
        if wait_below_limit and self.queued_rows > self._limit:
            self._wait(lambda: self.queued_rows <= self._limit or self._error is not None)
        committed = []
        while self._queue and self._queue[0].committed:
            committed.append(self._queue.popleft())
        # one drop a table for all of them: a drop moves the table's whole sorted index
        for table, ids in _ids_by_table(committed).items():
            self._queued[table].drop(ids, committed[-1].seq)
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Wait until every queued batch is committed (or the writer failed), then reap.
        Batches, not rows: flush's metadata may come in a batch of no rows."""
        self._wait(lambda: self._error is not None or not self._uncommitted())
        self.reap(wait_below_limit=False)

    def retry(self) -> None:
        """Clear a failure: the writer tries the failed batches again."""
        self._error = None
        self._wake()

    def lookup(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Newest queued value of each of the sorted ``ids``: (found mask, rows of the found ones)."""
        queued = self._queued.get(table)
        if queued is None or not len(ids):
            return np.zeros(len(ids), dtype=bool), None
        return queued.get(ids)

    def lookup_last(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Last-use step of each of the sorted ``ids`` queued: (found mask, steps of the found ones)."""
        queued = self._queued.get(table)
        if queued is None:
            return np.zeros(len(ids), dtype=bool), np.empty(0, dtype=np.int64)
        return queued.get_last(ids)

    def stop(self) -> None:
        """Wait until the writer has written what it can (all, or up to a failure) and left."""
        self._wait(lambda: self._thread is None)

    def _wait(self, done: Callable[[], bool]) -> None:
        self._waiters += 1
        self._cond.notify_all()  # the writer stops lingering
        try:
            self._cond.wait_for(done)
        finally:
            self._waiters -= 1

    def _uncommitted(self) -> list[WriteBatch]:
        return [b for b in self._queue if not b.committed]

    def _due(self) -> bool:
        """The writer commits now, or leaves with nothing to commit."""
        pending = self._uncommitted()
        return not pending or sum(b.rows for b in pending) >= self._group or self._waiters > 0 or self._error is not None

    def _wake(self) -> None:
        # The thread lives only while there is work, and is not a daemon thread:
        # at interpreter exit Python joins it, so queued rows still reach LMDB
        # when a program ends without close().
        if self._thread is not None:
            self._cond.notify_all()  # a lingering writer checks whether a group is due now
        elif self._error is None and self._uncommitted():
            self._thread = threading.Thread(target=self._run, name="tierstore-writeback")
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._due, timeout=self._linger)
                batches = self._uncommitted() if self._error is None else []
                if not batches:  # nothing left, or stopped by a failure until retry()
                    self._thread = None
                    self._cond.notify_all()
                    return
                items, meta, last, places = self._newest(batches)
                sweeps = dict(self.sweeps)
            try:
                # outside the lock: the trainer goes on meanwhile
                self._backend.put_rows(items, meta, **({"last_use": last} if last else {}), **({"places": places} if places else {}))
                # scanning twice the rows written keeps the sweep ahead of the table's growth
                budget = self._sweep_rows + 2 * sum(len(ids) for _, ids, _ in items)
                swept = {table: self._backend.sweep(table, cutoff, budget, l2) for table, (cutoff, l2) in sweeps.items()}
                error = None
            except Exception as e:  # kept and raised in the caller's thread by reap()
                error = e
            with self._cond:
                if error is None:
                    for batch in batches:
                        batch.committed = True
                    for table, n in swept.items():
                        if n and self._on_swept is not None:
                            self._on_swept(table, n)
                else:
                    self._error = error
                self._cond.notify_all()


    def _newest(self, batches: list[WriteBatch]) -> tuple[Items, dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The rows of several batches as one sorted run per table, each row once
        with its newest value (LMDB's cursor then finds consecutive rows on the
        page it is on), their metadata, the newest last, the last-use steps
        of tables that sweep, and where the backend found the rows, where known."""
        meta: dict = {}
        for batch in batches:
            meta.update(batch.meta or {})
        items, last, places = [], {}, {}
        for table, ids in _ids_by_table(batches).items():
            queued = self._queued[table]
            rows = queued.get(ids)[1]
            items.append((table, ids, rows if rows is not None else np.empty((0, queued.width), dtype=np.float32)))
            if self._backend.keeps_last_use(table):
                last[table] = queued.get_last(ids)[1]
            where = queued.get_places(ids)[1]
            if len(where) and where.max() >= 0:
                places[table] = where
        return items, meta, last, places


def _ids_by_table(batches: list[WriteBatch]) -> dict[str, np.ndarray]:
    """Each table's ids in ``batches``, sorted, each once."""
    parts: dict[str, list[np.ndarray]] = {}
    for batch in batches:
        for table, ids in batch.ids:
            parts.setdefault(table, []).append(ids)
    return {table: p[0] if len(p) == 1 else unique_ids(np.concatenate(p)) for table, p in parts.items()}
