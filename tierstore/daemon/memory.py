"""What bounds the daemon's memory: the bytes of frames in flight (MemoryBudget), the
prefetch hints its store holds for clients (HintPool), and glibc's handling of big
buffers (return_freed_memory). docs/daemon.md states the bound."""
from __future__ import annotations

import threading

import numpy as np

from tierstore.daemon.sessions import Session

# What a prefetch hint costs the daemon's store while it is held: its sorted unique ids
# (the announced window) and the staging slots it pins, 8 B an id each at most.
HINT_BYTES_PER_ID = 16
# What taking a hint in costs beyond its frame, reserved with it: a sorted unique copy, masks
# and slot lookups (measured: ~30 B an id above the frame's 8).
PREFETCH_WORK_PER_ID = 32
# A HELLO's JSON as Python objects, per byte of its text (measured ~8x for a claim list).
HELLO_WORK_PER_BYTE = 16


class MemoryBudget:
    """Bytes handed out to frames in flight; a frame waits until its share fits,
    so memory follows this total, not the number of connections."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0
        self._freed = threading.Condition()

    def acquire(self, nbytes: int) -> int:
        nbytes = min(nbytes, self.total)  # one frame alone always fits
        with self._freed:
            self._freed.wait_for(lambda: self.used + nbytes <= self.total)
            self.used += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        if nbytes:
            with self._freed:
                self.used -= nbytes
                self._freed.notify_all()


class HintPool:
    """The prefetch hints the daemon's store holds, all clients together: their bytes within
    ``pool_bytes``, at most ``max_hints`` per client."""

    def __init__(self, store, pool_bytes: int, max_hints: int):
        self.store = store
        self.pool_bytes = pool_bytes
        self.max_hints = max_hints
        self.held_bytes = 0
        self._lock = threading.Lock()
        self._hinting: dict[int, Session] = {}  # sessions holding hints, by number

    def add(self, s: Session, table: str, ids: np.ndarray) -> None:
        """Hand a hint to the store within the pool and max_hints per client. Room is made
        first, by dropping (releasing) the oldest hints of the client holding the most hint
        bytes: a hint is advisory, and a dropped one only means its rows are read when their
        batch comes. So a client that floods the daemon with hints drops its own, and one that
        holds no more than its share keeps its hints. One hint at a time: the store takes
        them in one at a time anyway (its lock), and no reservation is pending while room is
        made."""
        cost = HINT_BYTES_PER_ID * len(ids)  # <= the pool: the daemon's max_hint_ids
        with self._lock:
            while s.hints and len(s.hints) >= self.max_hints:
                self._drop_oldest(s)
            while self.held_bytes + cost > self.pool_bytes:
                self._drop_oldest(max(self._hinting.values(), key=lambda x: x.hint_bytes))
            ticket = self.store.prefetch(table, ids)
            s.hints.append((ticket, cost))
            s.hint_bytes += cost
            self.held_bytes += cost
            self._hinting[s.number] = s

    def drop_all(self, s: Session) -> None:
        """Release every hint of ``s`` (a client gone)."""
        with self._lock:
            while s.hints:
                self._drop_oldest(s)

    def _drop_oldest(self, s: Session) -> None:
        """Release ``s``'s oldest hint (its pinned rows may be evicted again); with the lock."""
        ticket, cost = s.hints.popleft()
        ticket.release()
        s.hint_bytes -= cost
        self.held_bytes -= cost
        if not s.hints:
            self._hinting.pop(s.number, None)


def return_freed_memory() -> None:
    """Big buffers (frames, replies, a read's working copies) from mmap, returned to the
    system when freed. glibc's default raises its mmap threshold up to 32 MiB after the
    first big free, and each connection thread's arena then keeps what it freed: the
    daemon's memory would follow its connections, not the frames in flight."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, which also turns the dynamic raise off
        libc.mallopt(-8, 1)  # M_ARENA_MAX: connection threads share one arena, so what one frees serves the next
    except (OSError, AttributeError):  # not glibc: its own allocator's policy applies
        pass
