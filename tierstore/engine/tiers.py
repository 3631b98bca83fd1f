"""One cache level (HBM or DDR) of one table: rows, id->slot index, policy metadata.

Everything a row carries between tiers lives in per-slot tensors on the tier's
device: its weights and its optimizer state (two tensors, so that the weights
are one contiguous [capacity, dim] matrix that embedding kernels index by slot
directly), its id, its use clock (``last``), its step count (``freq``) and
whether it differs from LMDB (``dirty``). A stored row, as LMDB and the read
API see it, is its weights followed by its state. Tiers are exclusive: a cached row lives in
exactly one tier, so its one cached copy is always the newest.

Which rows a step moves is planned by tierstore.engine.step, which reads a tier through
slot_meta and meta_at; the tier carries its part of the plan out (commit).
"""
from __future__ import annotations

import numpy as np
import torch

from tierstore.eviction import EvictionPolicy

from tierstore.engine.hashindex import DenseIndex, make_index
from tierstore.engine.step import UNUSED, LevelPlan, StepPlan


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
        # where the backend found each row (RowBackend.get_rows's places, -1: not known), handed
        # back when the row is written: the store's index is then not asked where it was (a page
        # of a mapped index read a row, out of core). Host tiers only: a row through a GPU tier
        # forgets it, and its write asks the index.
        self.places = np.full(capacity, -1, dtype=np.int64) if device.type == "cpu" else None
        self._free = torch.arange(capacity - 1, -1, -1, dtype=torch.int64, device=device)
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

    def slot_meta(self) -> tuple[np.ndarray, np.ndarray]:
        """Use clock and step count of every slot, on the host (views on the CPU); see
        tierstore.engine.step.TierMeta."""
        return self.last.cpu().numpy(), self.freq.cpu().numpy()

    def meta_at(self, slots: np.ndarray, *names: str) -> list[np.ndarray]:
        """The per-slot ``names`` ("ids", "last", "freq", "dirty") at host ``slots``, on the host."""
        if self.device.type == "cpu":
            return [getattr(self, name).numpy()[slots] for name in names]
        s = torch.from_numpy(slots).to(self.device)
        return [getattr(self, name).index_select(0, s).cpu().numpy() for name in names]

    def commit(self, level: LevelPlan, plan: StepPlan, uid: torch.Tensor, entering: torch.Tensor,
               places: np.ndarray | None = None) -> torch.Tensor:
        """Carry out this tier's part of a planned step of the unique ids ``uid`` (on the
        CPU): the rows leaving it go, the call rows it keeps are used, and ``entering``,
        the rows of level.entering() in uid order, come in (``places``: theirs, in uid order:
        places_at). Returns their slots."""
        self.remove(torch.from_numpy(level.leaving()).to(self.device))
        stay = level.staying()
        if len(stay):
            self.touch(torch.from_numpy(level.slot[stay]), torch.from_numpy(plan.clock[stay]), torch.from_numpy(plan.freq[stay]))
        enter = torch.from_numpy(level.entering())
        clock, freq, dirty = (torch.from_numpy(a).index_select(0, enter) for a in (plan.clock, plan.freq, plan.dirty))
        return self.add(uid.index_select(0, enter), entering, clock, freq, dirty,
                        None if places is None else places[level.entering()])

    def places_at(self, slots: torch.Tensor | np.ndarray) -> np.ndarray:
        """Where the backend found the rows at ``slots`` (see places), -1 where not known."""
        if self.places is None:
            return np.full(len(slots), -1, dtype=np.int64)
        return self.places[slots.numpy() if isinstance(slots, torch.Tensor) else slots]

    def touch(self, slots: torch.Tensor, use_clock: torch.Tensor, freq: torch.Tensor | None = None) -> None:
        """Resident rows used again: their use clock, and their step count (one more, or ``freq``)."""
        s = slots.to(self.device)
        self.last.index_copy_(0, s, use_clock.to(self.device))
        if freq is None:
            self.freq[s] += 1
        else:
            self.freq.index_copy_(0, s, freq.to(self.device))

    def rows_by_id(self, slots: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ids and rows at ``slots`` as LMDB takes them (host numpy, sorted by id), in one
        gather, and where LMDB had them (places_at)."""
        ids = self.ids.index_select(0, slots)
        order = torch.argsort(ids)
        slots = slots.index_select(0, order)
        return ids.index_select(0, order).cpu().numpy(), self.gather(slots).cpu().numpy(), self.places_at(slots.cpu())

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

    def add(self, ids, rows, last, freq, dirty, places: np.ndarray | None = None) -> torch.Tensor:
        """Rows into free slots, returned; ``places``: where the backend found them (None: not known)."""
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
        if self.places is not None:  # every slot taken is set: a hint never outlives its row
            self.places[slots.numpy()] = -1 if places is None else places
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
        if self.device.type == "cpu":  # numpy's: half the time of the torch ops below for a step's few thousand slots
            s, last = slots.numpy(), self.last.numpy()
            clocks = np.arange(clock, clock + len(s))
            last[s] = clock + len(s)
            np.minimum.at(last, s, clocks)
            first_use = last[s] == clocks  # one True per distinct row
            if self.policy.uses_frequency:
                self.freq.numpy()[s[first_use]] += 1
            return int(np.count_nonzero(first_use))
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


def found_all(slots: torch.Tensor) -> bool:
    """Whether a lookup found every id (no slot is -1). On the CPU one numpy reduction in
    place of three torch ops (a compare, all() and its read): a step looks up every table."""
    if slots.device.type == "cpu":
        return len(slots) == 0 or int(slots.numpy().min()) >= 0
    return bool((slots >= 0).all())


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


def by_id(ids: torch.Tensor, rows: torch.Tensor, order: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows as LMDB takes them: host numpy, sorted by id (``order``: argsort of ids, where known)."""
    order = torch.argsort(ids.cpu()) if order is None else order
    return ids.cpu()[order].numpy(), rows.cpu()[order].numpy()
