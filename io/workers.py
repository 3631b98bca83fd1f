"""Cold reads on a pool of threads.

py-lmdb releases the GIL inside LMDB calls, so page faults on a cold file
overlap across threads (~20k rows/s on one thread, ~130k on eight on our
machines). A read is split into contiguous parts of its sorted ids, one pool
task each; the task finishing last hands the whole result to ``on_done``, so
nothing ever blocks a pool thread waiting for another.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from .backend import RowBackend

# rows a part reads at the least, and between two pauses: with 64, the threads' per-chunk work
# (a transaction, the pause's lock, GIL hand-offs) doubled their CPU with rows from disk as well
# as from the page cache, and slowed the embedding-only step (BENCHMARKS.md, "Cost per row moved")
MIN_CHUNK = 256


def read_rows_async(
    backend: RowBackend, table: str, ids: np.ndarray, width: int, executor: Executor, parts: int,
    on_done: Callable[[np.ndarray, np.ndarray, BaseException | None, float, np.ndarray], None],
    pause: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter, chunk: int = MIN_CHUNK,
) -> None:
    """Read rows of sorted ``ids`` in ``parts`` tasks of at least ``chunk`` rows; then
    ``on_done(rows, found, error, seconds, places)``, seconds being the time the tasks spent
    reading, summed, and places where the backend found each row (RowBackend.get_rows).
    With ``pause``, a task reads ``chunk`` rows a call of the backend and
    calls ``pause()`` before each; with none, it reads its rows in one call (a call costs a
    read transaction and an index lookup: 0.6 ms of CPU each in chunks of 256 rows from
    disk, a quarter of the threads' CPU beside the reads)."""
    rows = np.empty((len(ids), width), dtype=np.float32)
    found = np.zeros(len(ids), dtype=bool)
    places = np.full(len(ids), -1, dtype=np.int64)
    parts = max(1, min(parts, len(ids) // chunk))
    bounds = np.linspace(0, len(ids), parts + 1).astype(np.int64)
    state = {"left": parts, "error": None, "seconds": 0.0}
    lock = threading.Lock()

    def part(lo: int, hi: int) -> None:
        err, seconds = None, 0.0
        try:
            per_call = chunk if pause is not None else hi - lo
            for a in range(lo, hi, per_call):
                if pause is not None:
                    pause()
                b = min(hi, a + per_call)
                start = clock()
                found[a:b] = backend.get_rows(table, ids[a:b], rows[a:b], places[a:b])[1]
                seconds += clock() - start
        except BaseException as e:  # handed to on_done, which raises it where it concerns
            err = e
        with lock:
            state["error"] = state["error"] or err
            state["seconds"] += seconds
            state["left"] -= 1
            last = state["left"] == 0
        if last:
            on_done(rows, found, state["error"], state["seconds"], places)

    for lo, hi in zip(bounds[:-1], bounds[1:]):
        executor.submit(part, int(lo), int(hi))
