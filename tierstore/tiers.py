"""One cache level (HBM or DDR) of one table: rows, id->slot index, policy metadata.

Everything a row carries between tiers lives in per-slot tensors on the tier's
device: its weights and its optimizer state (two tensors, so that the weights
are one contiguous [capacity, dim] matrix that embedding kernels index by slot
directly), its id, its use clock (``last``), its step count (``freq``) and
whether it differs from LMDB (``dirty``). A stored row, as LMDB and the read
API see it, is its weights followed by its state. Tiers are exclusive: a cached row lives in
exactly one tier, so its one cached copy is always the newest.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tierstore.eviction import EvictionPolicy
from tierstore.eviction.lookahead import NOT_IN_WINDOW, lookahead_victims

from .hashindex import DenseIndex, make_index

# use clock and step count of a free slot: ranked after every row by each policy, so
# that victims can be chosen over the per-slot arrays as they are (see make_room)
UNUSED = np.iinfo(np.int64).max


class CacheTier:
    def __init__(self, name: str, capacity: int, dim: int, state_dim: int, device: torch.device, policy: EvictionPolicy,
                 num_rows: int | None = None, dtype: torch.dtype = torch.float32):
        self.name = name
        self.capacity = capacity
        self.device = device
        self.policy = policy
        self.lookahead = False  # rank pinned rows by next use (eviction="lookahead")
        self.index = make_index(capacity, num_rows, device)
        self.dim = dim
        self.width = dim + state_dim
        self.weights = torch.empty((capacity, dim), dtype=dtype, device=device)  # rows go in and out as float32
        self.state = torch.empty((capacity, state_dim), dtype=torch.float32, device=device)
        # bumped whenever a slot changes owner: slots taken at one generation still
        # hold the same rows while it is unchanged
        self.generation = 0
        self.ids = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.last = torch.full((capacity,), UNUSED, dtype=torch.int64, device=device)
        self.freq = torch.full((capacity,), UNUSED, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)
        self._free = torch.arange(capacity - 1, -1, -1, dtype=torch.int64, device=device)
        self._rank_buffers: tuple[np.ndarray, np.ndarray] | None = None  # see ranked
        self._nfree = capacity

    @property
    def dense_index(self) -> bool:
        """Whether a lookup is one gather (a DenseIndex) rather than hash probes."""
        return isinstance(self.index, DenseIndex)

    @property
    def resident(self) -> int:
        return self.capacity - self._nfree

    @property
    def free(self) -> int:
        return self._nfree

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id on this tier's device, -1 where absent."""
        # non-blocking only to a GPU: a copy to the host would be read before it lands
        return self.index.lookup(ids.to(self.device, non_blocking=ids.device.type == "cpu"))

    def occupied_except(self, slots: torch.Tensor) -> torch.Tensor:
        """Occupied slots not in ``slots``."""
        mask = self.ids >= 0
        mask.index_fill_(0, slots, False)
        return nonzero(mask)

    def pick_victims(self, last: np.ndarray, freq: np.ndarray, k: int, next_use: np.ndarray | None = None) -> torch.Tensor:
        """Positions into the candidates' use clocks and step counts (from ``ranked``,
        which it may overwrite) of the k rows to evict. A candidate whose use clock is
        UNUSED is not a row: it is never chosen.

        ``next_use`` (the prefetch window's next step using each candidate, or
        NOT_IN_WINDOW) pins rows the window uses: they go only when nothing else
        is left, farthest next use first with lookahead eviction, else by policy.
        """
        pinned = None if next_use is None else np.flatnonzero(next_use != NOT_IN_WINDOW)
        if pinned is not None and len(pinned):
            pinned = pinned[last[pinned] != UNUSED]
            if np.count_nonzero(last != UNUSED) - len(pinned) >= k:  # the usual step: enough rows the window does not use
                last[pinned] = UNUSED
                if self.policy.uses_frequency:
                    freq[pinned] = UNUSED
                pinned = None
        if pinned is None or not len(pinned):
            return torch.from_numpy(self.policy.select(last, freq, k))
        if not self.lookahead:  # pinned, but ranked among themselves by the policy
            next_use = np.where(next_use == NOT_IN_WINDOW, NOT_IN_WINDOW, 0)
        next_use = np.where(last == UNUSED, -1, next_use)  # not a row: behind every pinned one
        return torch.from_numpy(lookahead_victims(next_use, last, freq, k, self.policy))

    def make_room(self, hit_slots: torch.Tensor, n_new: int, use_clock: torch.Tensor, freq: torch.Tensor,
                  next_use: Callable[[], np.ndarray | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan one step of this tier, changing nothing: the call's unique rows
        (used at ``use_clock``, step counts ``freq``) are resident at ``hit_slots``
        or ``n_new`` rows to bring in. Returns the mask of call rows the tier keeps
        (all of them unless the call is larger than the tier) and the CPU slots of
        resident rows to evict. ``next_use()``, per slot, pins the prefetch window.

        The policy ranks the per-slot arrays themselves, the call's slots set to
        UNUSED in a copy (free slots hold it already), not a gathered list of the
        other occupied slots: at 1M slots, gathering that list and its metadata took
        ~20 ms a step, the copy ~1 ms."""
        n = len(use_clock)
        keep = torch.ones(n, dtype=torch.bool)
        if n > self.capacity:  # keep the call rows the policy ranks highest, and only them
            keep[torch.from_numpy(self.policy.select(use_clock.numpy(), freq.numpy(), n - self.capacity))] = False
            return keep, self.occupied_except(hit_slots.to(self.device)).cpu()
        need = n_new - self.free
        if need <= 0:
            return keep, torch.empty(0, dtype=torch.int64)
        last, freq = self.ranked(hit_slots.cpu().numpy())
        return keep, self.pick_victims(last, freq, need, next_use() if next_use else None)

    def ranked(self, hits: np.ndarray, more_last: torch.Tensor | None = None, more_freq: torch.Tensor | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """What a policy ranks to evict from this tier, but the rows at slots ``hits``: the
        per-slot use clocks and step counts, the hits' (and free slots') UNUSED, followed
        by those of rows coming in from above (``more_*``, also candidates). Copies, in
        buffers kept for the next step: a fresh 8 MB array (1M slots) page-faults on
        every step."""
        n = self.capacity + (0 if more_last is None else len(more_last))
        if self._rank_buffers is None or len(self._rank_buffers[0]) < n:
            self._rank_buffers = (np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64))
        ranked = []
        for buffer, values, more in zip(self._rank_buffers, (self.last, self.freq), (more_last, more_freq)):
            if values is self.freq and not self.policy.uses_frequency and more is None:
                ranked.append(values.cpu().numpy())  # not read, not written (pick_victims)
                continue
            out = buffer[:n]
            np.copyto(out[: self.capacity], values.cpu().numpy())
            out[hits] = UNUSED
            if more is not None:
                out[self.capacity:] = more.cpu().numpy()
            ranked.append(out)
        return ranked[0], ranked[1]

    def counts_after(self, slot: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
        """Step counts of one step's unique rows after it: one more than a resident
        row (at ``slot`` where ``hit``) had, 1 for a row coming in (on the CPU)."""
        freq = torch.ones(len(slot), dtype=torch.int64)
        at = nonzero(hit)
        freq.index_add_(0, at, self.freq.index_select(0, slot.index_select(0, at).to(self.device)).cpu())
        return freq

    def apply_step(self, uid: torch.Tensor, slot: torch.Tensor, hit: torch.Tensor, keep: torch.Tensor, evict: torch.Tensor,
                   entering: torch.Tensor, use_clock: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Carry out what ``make_room`` planned for one step's unique rows ``uid``
        (resident at ``slot`` where ``hit``): evict ``evict`` and the call rows not
        kept, update the kept hits, add the kept misses (``entering``, their rows in
        uid order) clean. Returns the slots they were added at and how many rows left."""
        leaving = torch.cat([evict, masked(slot, hit & ~keep)])
        self.remove(leaving.to(self.device))
        self.touch(*select(hit & keep, slot, use_clock, freq))
        ids, clock, counts = select(~hit & keep, uid, use_clock, freq)
        added = self.add(ids, entering, clock, counts, torch.zeros(len(ids), dtype=torch.bool))
        return added, len(leaving)

    def touch(self, slots: torch.Tensor, use_clock: torch.Tensor, freq: torch.Tensor | None = None) -> None:
        """Resident rows used again: their use clock, and their step count (one more, or ``freq``)."""
        s = slots.to(self.device)
        self.last.index_copy_(0, s, use_clock.to(self.device))
        if freq is None:
            self.freq[s] += 1
        else:
            self.freq.index_copy_(0, s, freq.to(self.device))

    def rows_by_id(self, slots: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The ids and rows at ``slots`` as LMDB takes them (host numpy, sorted by id), in one gather."""
        ids = self.ids.index_select(0, slots)
        order = torch.argsort(ids)
        return ids.index_select(0, order).cpu().numpy(), self.gather(slots.index_select(0, order)).cpu().numpy()

    def gather(self, slots: torch.Tensor, cols: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at ``slots`` (on this tier's device): the weights, or with ``cols``
        = width (the default) the weights then the state. Into ``out`` when given."""
        cols = self.width if cols is None else cols
        if cols == self.dim:
            if self.weights.dtype != torch.float32:
                rows = self.weights.index_select(0, slots).to(torch.float32)
                return rows if out is None else out.copy_(rows)
            return self.weights.index_select(0, slots) if out is None else torch.index_select(self.weights, 0, slots, out=out)
        if out is None:
            out = torch.empty((len(slots), self.width), dtype=torch.float32, device=self.device)
        out[:, : self.dim] = self.weights.index_select(0, slots)
        out[:, self.dim :] = self.state.index_select(0, slots)
        return out

    def put(self, slots: torch.Tensor, rows: torch.Tensor, cols: int | None = None) -> None:
        """Set the first ``cols`` columns (default: all) of the rows at ``slots``."""
        cols = self.width if cols is None else cols
        rows = rows.to(self.device)
        dtype = self.weights.dtype  # rows hold values it represents: converting does not round
        if cols == self.dim == rows.shape[1]:
            _copy_rows(self.weights, slots, rows.to(dtype))
            return
        _copy_rows(self.weights, slots, rows[:, : self.dim].to(dtype))
        if cols > self.dim:
            _copy_rows(self.state, slots, rows[:, self.dim : cols])

    def add(self, ids, rows, last, freq, dirty) -> torch.Tensor:
        n = len(ids)
        if n > self._nfree:
            raise RuntimeError(f"{self.name} tier: adding {n} rows with {self._nfree} free slots")
        slots = self._free[self._nfree - n : self._nfree].clone()
        self._nfree -= n
        dev = self.device
        self.index.insert(ids.to(dev), slots)
        self.ids.index_copy_(0, slots, ids.to(dev))
        self.put(slots, rows)
        self.generation += 1
        self.last.index_copy_(0, slots, last.to(dev))
        self.freq.index_copy_(0, slots, freq.to(dev))
        self.dirty.index_copy_(0, slots, dirty.to(dev))
        return slots

    def remove(self, slots: torch.Tensor) -> None:
        n = len(slots)
        if n == 0:
            return
        self.index.remove(self.ids.index_select(0, slots))
        self.generation += 1
        for values, free in ((self.ids, -1), (self.last, UNUSED), (self.freq, UNUSED), (self.dirty, False)):
            fill(values, slots, free)
        self._free[self._nfree : self._nfree + n] = slots
        self._nfree += n

    def use_resident(self, slots: torch.Tensor, clock: int) -> int:
        """One step that uses only resident rows: row at position i is used at
        ``clock + i`` (a repeated row keeps its first position). Returns the
        number of distinct rows used; no dedupe is needed."""
        clocks = torch.arange(clock, clock + len(slots), device=self.device)
        # include_self=False would fill the slots by a scatter: filling them first costs ~25% less
        fill(self.last, slots, clock + len(slots))
        self.last.scatter_reduce_(0, slots, clocks, "amin")
        first_use = self.last.index_select(0, slots) == clocks  # one True per distinct row
        if self.policy.uses_frequency:
            self.freq.index_add_(0, slots, first_use.long())
        return int(first_use.sum())

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Rows at ``slots`` (on this tier's device; they may repeat) differ from LMDB's."""
        fill(self.dirty, slots, True)

    def dirty_slots(self) -> torch.Tensor:
        return nonzero(self.dirty)


def fill(dst: torch.Tensor, slots: torch.Tensor, value) -> None:
    """dst[slots] = value (slots may repeat). On the CPU by numpy: index_fill_ there took
    1.5-2x the time over a resident step's 64k slots of a 1M-slot tier (0.30 against 0.19 ms
    for the dirty bits, 1M x 128, 1 thread), and a resident step fills twice."""
    if dst.device.type == "cpu":
        dst.numpy()[slots.numpy()] = value
    else:
        dst.index_fill_(0, slots, value)


def _copy_rows(dst: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[slots] = rows. On the CPU by numpy where it has the dtype: it copies a row at
    a time, torch's index_copy_ an element at a time (1,000 rows of 64 floats: 14 us
    against 31); index_copy_ elsewhere (faster than index_put_ here, with 2 threads)."""
    if dst.device.type == "cpu" and dst.dtype != torch.bfloat16:
        dst.detach().numpy()[slots.numpy()] = rows.detach().numpy()
    else:
        dst.index_copy_(0, slots, rows.contiguous())


def select(mask: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``tensors`` at ``mask`` (1-D, on their device), positions found once:
    t[mask] by advanced indexing costs 2-3x an index_select on the CPU."""
    at = nonzero(mask)
    return [t.index_select(0, at) for t in tensors]


def masked(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """t[mask] (see select)."""
    return select(mask, t)[0]


def nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Positions where ``mask`` is True (int64, on its device). On the CPU by numpy:
    torch's nonzero runs ~40 instructions an element there (callgrind), over masks
    as long as a tier, several times a step; numpy's a few."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).squeeze(1)


def first_uses(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted unique ids, the inverse map, and each unique id's first position."""
    uid, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((len(uid),), len(ids), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(len(ids)), "amin")
    return uid, inverse, first


def is_sorted_unique(ids: torch.Tensor) -> bool:
    return len(ids) < 2 or bool((ids[1:] > ids[:-1]).all())


def last_values(ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique ids with the last value given for each (a repeated id's last one wins)."""
    if is_sorted_unique(ids):
        return ids, values  # already sorted and unique (a backward's rows): nothing to gather
    uid, inverse = torch.unique(ids, return_inverse=True)
    last_pos = torch.full((len(uid),), -1, dtype=torch.int64)
    last_pos.scatter_reduce_(0, inverse, torch.arange(len(ids)), "amax")
    return uid, values.index_select(0, last_pos)


def by_id(ids: torch.Tensor, rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Rows as LMDB takes them: host numpy, sorted by id."""
    order = torch.argsort(ids.cpu())
    return ids.cpu()[order].numpy(), rows.cpu()[order].numpy()
