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

Order keeps values right: batches commit in the order they were queued, so a
row queued twice ends with its newer value in LMDB. A failed commit stops the
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

from .lmdb_backend import LmdbBackend

Items = list[tuple[str, np.ndarray, np.ndarray]]  # (table, sorted unique ids, rows)


@dataclass
class WriteBatch:
    items: Items
    meta: dict | None
    rows: int
    committed: bool = False


class WriteBack:
    """The queue and its writer thread. Every method runs with ``lock`` (the
    store's) held by the caller; waits release it, as Condition waits do."""

    def __init__(self, backend: LmdbBackend, lock: threading.RLock, limit_rows: int, group_rows: int = 0, linger: float = 1.0):
        self._backend = backend
        self._cond = threading.Condition(lock)
        self._limit = limit_rows
        self._group = min(group_rows, limit_rows // 2)  # due before calls wait for the queue
        self._linger = linger
        self._waiters = 0  # callers waiting for commits: the writer does not linger
        self._queue: deque[WriteBatch] = deque()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None  # alive while there is something to write

    @property
    def queued_rows(self) -> int:
        """Rows not yet committed."""
        return sum(b.rows for b in self._queue if not b.committed)

    def submit(self, items: Items, meta: dict | None = None) -> None:
        """Queue rows (and store metadata), committed together, perhaps with other batches; returns at once."""
        batch = WriteBatch(items, meta, sum(len(ids) for _, ids, _ in items))
        self._queue.append(batch)
        self._wake()

    def reap(self, wait_below_limit: bool = True) -> None:
        """Drop committed batches from the queue; raise the writer's failure.

        With ``wait_below_limit``, first wait while more rows are queued than the
        limit: the backpressure that bounds the queue's memory. Call it only
        where the caller holds no plan that another thread could invalidate.
        """
        if wait_below_limit and self.queued_rows > self._limit:
            self._wait(lambda: self.queued_rows <= self._limit or self._error is not None)
        while self._queue and self._queue[0].committed:
            self._queue.popleft()
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Wait until every queued batch is committed (or the writer failed), then reap."""
        self._wait(lambda: self._error is not None or self.queued_rows == 0)
        self.reap(wait_below_limit=False)

    def retry(self) -> None:
        """Clear a failure: the writer tries the failed batches again."""
        self._error = None
        self._wake()

    def lookup(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Newest queued value of each of the sorted ``ids``: (found mask, rows of the found ones)."""
        found = np.zeros(len(ids), dtype=bool)
        rows = None
        for batch in reversed(self._queue) if len(ids) else ():  # newest first
            for name, qids, qrows in batch.items:
                if name != table or len(qids) == 0:
                    continue
                pos = np.minimum(np.searchsorted(qids, ids), len(qids) - 1)
                hit = (qids[pos] == ids) & ~found
                if hit.any():
                    found |= hit
                    if rows is None:
                        rows = np.empty((len(ids), qrows.shape[1]), dtype=np.float32)
                    rows[hit] = qrows[pos[hit]]
        return found, (rows[found] if rows is not None else None)

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
            try:
                # outside the lock: the trainer goes on meanwhile
                self._backend.put_rows(*_merged(batches))
                error = None
            except Exception as e:  # kept and raised in the caller's thread by reap()
                error = e
            with self._cond:
                if error is None:
                    for batch in batches:
                        batch.committed = True
                else:
                    self._error = error
                self._cond.notify_all()


def _merged(batches: list[WriteBatch]) -> tuple[Items, dict]:
    """One table's rows of several batches as one sorted run, the newest value of
    a row repeated; LMDB's cursor then finds consecutive rows on the page it is on."""
    by_table: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    meta: dict = {}
    for batch in batches:
        for table, ids, rows in batch.items:
            by_table.setdefault(table, []).append((ids, rows))
        meta.update(batch.meta or {})
    items = []
    for table, parts in by_table.items():
        if len(parts) == 1:
            items.append((table, *parts[0]))
            continue
        ids = np.concatenate([p[0] for p in parts])
        rows = np.concatenate([p[1] for p in parts])
        order = np.argsort(ids, kind="stable")  # a repeated row: queue order, the newest last
        ids, rows = ids[order], rows[order]
        newest = np.append(ids[1:] != ids[:-1], True)
        items.append((table, ids[newest], rows[newest]))
    return items, meta
