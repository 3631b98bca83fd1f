"""A lock that readers hold side by side and a writer alone.

Why: a log table's row index (io.rowindex) is read by every prefetch worker's lookup and
changed only by the writer's commits and spills. Behind one plain lock, the lookups, which
read the pages of its mapped levels from disk, went one at a time: in `tierstore bench
scale`'s 200M x 16 table under 256 MiB (its 11th run, the embedding step), the prefetch
workers waited for the lock 62% of their time, and one of them held it 57% of the wall
time."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SharedLock:
    """``with lock.shared():`` for readers, any number at once; ``with lock:`` for a writer,
    alone. ``writers_first``: a writer waiting holds off readers that come after it, so a
    stream of readers never starves a writer; a thread holding it shared must then not take
    it again (a writer waiting between would wait for it, and it for the writer). Otherwise
    readers go in while a writer waits, a reader within a reader included."""

    def __init__(self, writers_first: bool = True):
        self._writers_first = writers_first
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and not (self._writers_first and self._writers_waiting))
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    def __enter__(self) -> "SharedLock":
        with self._cond:
            self._writers_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._writing and not self._readers)
            finally:
                self._writers_waiting -= 1
            self._writing = True
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._writing = False
            self._cond.notify_all()
