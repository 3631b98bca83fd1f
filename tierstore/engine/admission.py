"""Admission of new rows: a count-min sketch of the steps each id was used in.

A table with ``admit_after=N`` keeps a trainer's update of a row only from the
N-th step that uses the row on (docs/admission.md). Counting every
id exactly would grow with the id space, which is what admission is there to
bound, so the counts live in a count-min sketch of fixed size: ``depth`` rows
of ``width`` 8-bit counters, each row indexed by its own hash of the id. An
id's count is the smallest of its ``depth`` counters: never below the true
count, above it only where other ids share every one of its counters. Such an
id is admitted early; never late. Counters saturate at 255, so they never wrap.

Everything is a pure function of the ids counted, in order: the hashes have
fixed seeds, so the same steps give the same counts, and the same admissions,
on every run and machine.
"""
from __future__ import annotations

import numpy as np

from tierstore.io.codecs import row_norms_sq

from tierstore.spec import _splitmix64
from tierstore.errors import FormatError, SettingError

_SATURATED = 255
# one odd 64-bit constant per sketch row: row i hashes id ^ _SEEDS[i]
_SEEDS = _splitmix64(np.arange(1, 9, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


class CountMinSketch:
    """Saturating 8-bit count-min sketch over int64 ids."""

    def __init__(self, width: int, depth: int):
        if width < 1 or width & (width - 1) or not 1 <= depth <= len(_SEEDS):
            raise SettingError(f"a sketch needs a power-of-two width and 1..{len(_SEEDS)} rows, got width={width}, depth={depth}")
        self.width = width
        self.depth = depth
        self.counters = np.zeros((depth, width), dtype=np.uint8)

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        """[depth, n] flat positions into ``counters`` of each id's counters."""
        keys = ids.astype(np.uint64)
        with np.errstate(over="ignore"):
            h = _splitmix64(keys[None, :] ^ _SEEDS[: self.depth, None])
        col = (h & np.uint64(self.width - 1)).astype(np.int64)
        return col + (np.arange(self.depth, dtype=np.int64) * self.width)[:, None]

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Each id's count (int64): its smallest counter."""
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        return self.counters.reshape(-1)[self._cells(ids)].min(axis=0).astype(np.int64)

    def add(self, uid: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple]:
        """Count one use of each of the unique ids ``uid``; returns their counts
        before and after it, and what ``undo`` needs to take it back.

        Ids sharing a counter each add one to it (a fancy-index += would add
        one for all of them), capped at 255."""
        cells = self._cells(uid)
        flat = self.counters.reshape(-1)
        touched, hits = np.unique(cells, return_counts=True)
        old = flat[touched]
        before = flat[cells].min(axis=0).astype(np.int64) if len(uid) else np.zeros(0, dtype=np.int64)
        flat[touched] = np.minimum(old.astype(np.int64) + hits, _SATURATED).astype(np.uint8)
        after = flat[cells].min(axis=0).astype(np.int64) if len(uid) else before
        return before, after, (touched, old)

    def undo(self, token: tuple) -> None:
        touched, old = token
        self.counters.reshape(-1)[touched] = old

    def load(self, blob: bytes) -> None:
        """Counters as ``counters.tobytes()`` gave them (a stored sketch of this shape)."""
        if len(blob) != self.counters.nbytes:
            raise FormatError(f"a stored sketch of {len(blob)} bytes does not fit {self.depth} x {self.width} counters")
        self.counters = np.frombuffer(blob, dtype=np.uint8).reshape(self.depth, self.width).copy()

    def fill(self) -> float:
        """Share of counters that are not zero: near 1, most new ids look seen (admitted early)."""
        return float(np.count_nonzero(self.counters)) / self.counters.size


class RowLife:
    """One table's admission and TTL bookkeeping, advanced by its counted steps.

    A step is one read call of the table (docs/store.md, "Cache semantics"); prefetch,
    writes and a backward's re-read are not steps. ``steps`` counts them over
    the table's life (durable at flush). A row's last use is the step number
    of the last step that used it; ``step_clocks`` maps the store's use clocks,
    which the tiers keep per row, to step numbers: the clock at the start of
    each step of this session."""

    def __init__(self, admit_after: int, width: int, depth: int, ttl_steps: int | None, steps: int = 0,
                 l2_below: float | None = None):
        self.admit_after = admit_after
        self.ttl_steps = ttl_steps
        self.l2_below = l2_below
        self.sketch = CountMinSketch(width, depth) if admit_after > 1 else None
        self.steps = steps
        # steps in the metadata LMDB holds (the last flush's): what a reopen after a
        # crash counts from, so the only clock the sweep may judge rows by
        self.durable_steps = steps
        self._base = steps  # steps before this session: its first step is base + 1
        self._clocks = np.empty(1024, dtype=np.int64)
        self._n = 0
        self.current: np.ndarray | None = None  # unique ids of the step in progress
        self._undo = None

    @property
    def active(self) -> bool:
        return self.sketch is not None or self.resets

    @property
    def resets(self) -> bool:
        """Rows may read as initial again (TTL, or the L2 score)."""
        return self.ttl_steps is not None or self.l2_below is not None

    def too_small(self, weights: np.ndarray) -> np.ndarray:
        """Rows whose weights' L2 norm is below ``l2_below`` (none without it). One
        computation wherever a row is (tiers, LMDB, the sweep): the same bits decide."""
        if self.l2_below is None:
            return np.zeros(len(weights), dtype=bool)
        return row_norms_sq(weights) < self.l2_below ** 2

    def admitted(self, uid: np.ndarray) -> np.ndarray:
        """Whether each id's updates are kept now, after the steps counted so far."""
        if self.sketch is None:
            return np.ones(len(uid), dtype=bool)
        return self.sketch.estimate(uid) >= self.admit_after

    def begin_step(self, uid: np.ndarray, clock: int) -> np.ndarray:
        """A step starting at use clock ``clock`` uses the unique ids ``uid``: counts
        them and returns which are admitted.
        ``end_step`` confirms it, ``abort_step`` takes it back."""
        if self._n == len(self._clocks):
            self._clocks = np.concatenate([self._clocks, np.empty_like(self._clocks)])
        self._clocks[self._n] = clock
        self._n += 1
        self.current = uid
        if self.sketch is None:
            self._undo = None
            return np.ones(len(uid), dtype=bool)
        _, after, self._undo = self.sketch.add(uid)
        return after >= self.admit_after

    def abort_step(self) -> None:
        self._n -= 1
        self.current = None
        if self._undo is not None:
            self.sketch.undo(self._undo)

    def end_step(self) -> None:
        self.steps += 1
        self.current = None

    def step_start_clock(self) -> int | None:
        """Use clock at the start of the latest step of this session (None before the first)."""
        return int(self._clocks[self._n - 1]) if self._n else None

    def steps_of(self, clocks: np.ndarray) -> np.ndarray:
        """Step number of each use clock of this session (a step in progress included)."""
        return self._base + np.searchsorted(self._clocks[: self._n], clocks, side="right")

    def expired(self, last_use: np.ndarray, steps: int | None = None) -> np.ndarray:
        """Rows whose value is gone after ``steps`` steps (default: so far): last
        used T or more steps ago (``last_use`` -1: never stored)."""
        steps = self.steps if steps is None else steps
        if self.ttl_steps is None:
            return last_use < 0
        return (last_use < 0) | (last_use + self.ttl_steps <= steps)

    def sweep_cutoff(self) -> int | None:
        """Rows last used at or before this step may be deleted from disk: no later read sees them,
        not even one after a crash.

        Judged by the durable step count, not ``steps``: a cached row in use keeps its
        newer last-use step in memory until flush writes it, and a reopen counts from
        the last flush's steps, so a cutoff ahead of those would delete rows that the
        durable store still holds alive. Every row used before a flush is written by
        that flush with its last use, ahead of the steps (store.flush)."""
        return None if self.ttl_steps is None else self.durable_steps - self.ttl_steps
