"""Vectorized id -> tier slot maps: an open-addressing hash table, or a dense array.

Per-id Python dicts run at ~1.5M ids/s; these run whole batches as a few array ops
per probe round, on the tier's own device. Their arrays are numpy's on the host and
torch's on a GPU: torch wakes its OpenMP team for each of these small ops, and on a
2-core machine with a second busy thread the team spins against it (a 65k-id lookup
took 93 ms at 2 intra-op threads against 10 at one; numpy, one thread, 7 ms). The
hash table's memory is ~32 bytes per slot of capacity, independent of the id space.

Out of core the table is far larger than the caches and a lookup's cost is its cache
misses: each slot's key and value sit side by side (one [slots, 2] array), so an id
found at its home slot costs one miss, not one for its key and one for its value
(28k ids in the 4M-slot table of 1.06M ids, caches cold: 4.4 ms as two arrays, 3.5 side by side).
"""
from __future__ import annotations

import numpy as np
import torch

EMPTY = -1
TOMBSTONE = -2
PROBE_WINDOW = 8
# Fibonacci hashing multiplier 0x9E3779B97F4A7C15 as a signed int64
_MULT = -7046029254386353131


class _HostArrays:
    """The array operations the maps use, on numpy arrays (viewing the callers' tensors)."""

    device = torch.device("cpu")
    int32 = np.int32

    @staticmethod
    def array(t: torch.Tensor) -> np.ndarray:
        return t.numpy()

    @staticmethod
    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a)

    @staticmethod
    def int64(a: np.ndarray) -> np.ndarray:
        return a.astype(np.int64)

    @staticmethod
    def full(n: int, value: int, dtype=np.int64) -> np.ndarray:
        return np.full(n, value, dtype=dtype)

    @staticmethod
    def rows(table: np.ndarray, at: np.ndarray) -> np.ndarray:
        return table.take(at, axis=0)  # take: numpy's fancy indexing is several times slower

    @staticmethod
    def arange(n: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64)

    where = staticmethod(np.where)
    nonzero = staticmethod(np.flatnonzero)

    @staticmethod
    def first_true(rows: np.ndarray) -> np.ndarray:
        return rows.argmax(1)

    @staticmethod
    def sort(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(a, kind="stable")
        return a[order], order

    @staticmethod
    def cummax(a: np.ndarray) -> np.ndarray:
        return np.maximum.accumulate(a)


class _DeviceArrays:
    """The same operations on torch tensors on an accelerator."""

    int32 = torch.int32

    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def array(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def tensor(a: torch.Tensor) -> torch.Tensor:
        return a

    @staticmethod
    def int64(a: torch.Tensor) -> torch.Tensor:
        return a.long()

    def full(self, n: int, value: int, dtype=torch.int64) -> torch.Tensor:
        return torch.full((n,), value, dtype=dtype, device=self.device)

    @staticmethod
    def rows(table: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return table.index_select(0, at)

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=self.device)

    where = staticmethod(torch.where)

    @staticmethod
    def nonzero(mask: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(mask).squeeze(1)

    @staticmethod
    def first_true(rows: torch.Tensor) -> torch.Tensor:
        return rows.to(torch.uint8).argmax(1)

    @staticmethod
    def sort(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sort(a, stable=True)

    @staticmethod
    def cummax(a: torch.Tensor) -> torch.Tensor:
        return torch.cummax(a, 0).values


def _arrays(device: torch.device | str) -> _HostArrays | _DeviceArrays:
    device = torch.device(device)
    return _HostArrays() if device.type == "cpu" else _DeviceArrays(device)


class HashIndex:
    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = int(capacity)
        self._xp = _arrays(device)
        self.device = self._xp.device
        bits = max(4, (2 * max(self.capacity, 1) - 1).bit_length())  # load <= 0.5
        self._bits = bits
        self._mask = (1 << bits) - 1
        # slot s: key at flat[2s], value at flat[2s + 1]; keys and vals are views of its columns
        self._flat = self._xp.full(2 << bits, -1)
        self._table = self._flat.reshape(1 << bits, 2)
        self.keys, self.vals = self._table[:, 0], self._table[:, 1]
        self.keys[:] = EMPTY
        self._window = self._xp.arange(PROBE_WINDOW)
        self.live = 0
        self.tombstones = 0

    def __len__(self) -> int:
        return self.live

    def home_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Where each id's probe starts."""
        return self._xp.tensor(self._home(self._xp.array(ids.to(torch.int64))))

    def _home(self, ids):
        # int64 products wrap, and >> keeps the sign, alike in numpy and torch: the same slots
        return ((ids * _MULT) >> (64 - self._bits)) & self._mask

    def _key_at(self, pos):
        return self._flat.take(pos << 1)  # the flat array: a take from a column view copies the table

    def _find(self, ids):
        """Table position and value of each id, -1 (both) where absent.

        After the home slot, probes a window of PROBE_WINDOW slots per round as
        one [n, window] gather: at load <= 0.75 nearly every id ends in the first
        window (a hit, or an EMPTY slot, which ends a linear probe), so a lookup
        is a handful of array ops instead of a round of ops per probe.
        """
        xp = self._xp
        h = self._home(ids)
        # first the home slot alone, key and value together: at load <= 0.5 it settles
        # most ids (the id, or EMPTY), so only the rest pay for a window's gather and compares
        entry = xp.rows(self._table, h)
        k = entry[:, 0]
        home = k == ids
        pos, val = xp.where(home, h, -1), xp.where(home, entry[:, 1], -1)
        todo = xp.nonzero(~home & (k != EMPTY))
        want, h = ids[todo], (h[todo] + 1) & self._mask
        while len(todo):
            k = self._key_at((h[:, None] + self._window) & self._mask)
            hit = k == want[:, None]
            found = hit.any(1)
            at = xp.where(found, (h + xp.first_true(hit)) & self._mask, -1)
            pos[todo] = at
            val[todo] = xp.where(found, self._flat.take((at.clip(min=0) << 1) + 1), -1)
            go_on = xp.nonzero(~found & ~(k == EMPTY).any(1))
            todo, want, h = todo[go_on], want[go_on], (h[go_on] + PROBE_WINDOW) & self._mask
        return pos, val

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id (int64), -1 where absent."""
        return self._xp.tensor(self._find(self._xp.array(ids.to(torch.int64)))[1])

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ids (unique, none present) mapping to slots."""
        n = len(ids)
        if n == 0:
            return
        if self.live + self.tombstones + n > (self._mask + 1) * 3 // 4:
            self._rebuild(extra=n)
        self._place(self._xp.array(ids.to(torch.int64)), self._xp.array(slots.to(torch.int64)))
        self.live += n

    def _place(self, ids, slots) -> None:
        xp = self._xp
        h = self._home(ids)
        while len(ids):
            # the first free slot (EMPTY or TOMBSTONE) in each id's next window
            k = self._key_at((h[:, None] + self._window) & self._mask)
            free = (k == EMPTY) | (k == TOMBSTONE)
            has = free.any(1)
            first = xp.first_true(free)
            at = (h + first) & self._mask
            tried = xp.nonzero(has)
            pos, want = at[tried], ids[tried]
            self.keys[pos] = want
            # ids that chose the same slot race; the id read back is the one that won
            won = self._key_at(pos) == want
            self.tombstones -= int((k[tried, first[tried]][won] == TOMBSTONE).sum())
            self.vals[pos[won]] = slots[tried][won]
            # a loser goes on from the slot it lost (every slot before it is taken); an id
            # whose window was full, from the next window
            again = ~has
            again[tried[~won]] = True
            ids, slots = ids[again], slots[again]
            h = xp.where(has, at, (h + PROBE_WINDOW) & self._mask)[again]

    def remove(self, ids: torch.Tensor) -> None:
        """Drop ids (all present)."""
        if len(ids) == 0:
            return
        pos = self._find(self._xp.array(ids.to(torch.int64)))[0]
        if bool((pos < 0).any()):
            raise KeyError("HashIndex.remove: id not present")
        self.keys[pos] = TOMBSTONE
        self.vals[pos] = -1
        self.live -= len(ids)
        self.tombstones += len(ids)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, vals = self._items()
        return self._xp.tensor(keys), self._xp.tensor(vals)

    def _items(self):
        at = self._xp.nonzero(self.keys >= 0)
        return self.keys[at], self.vals[at]

    def _rebuild(self, extra: int) -> None:
        """Drop the tombstones: the live ids placed afresh in a few whole-table ops
        (inserting them again took ~0.3 s for 0.5M ids, a stalled step)."""
        keys, vals = self._items()
        if len(keys) + extra > (self._mask + 1) * 3 // 4:
            raise RuntimeError("HashIndex over capacity: more ids than the tier was sized for")
        self.keys[:] = EMPTY
        self.vals[:] = -1
        self.tombstones = 0
        # inserted in order of home slot, each id lands at its home or just past the id
        # before it: pos[i] = max(home[i], pos[i-1] + 1) = i + max(home[:i+1] - arange)
        home, order = self._xp.sort(self._home(keys))
        keys, vals = keys[order], vals[order]
        i = self._xp.arange(len(keys))
        pos = self._xp.cummax(home - i) + i
        inside = pos <= self._mask
        self.keys[pos[inside]] = keys[inside]
        self.vals[pos[inside]] = vals[inside]
        self._place(keys[~inside], vals[~inside])  # a run past the table's end wraps to its start
        self.live = len(keys)


class DenseIndex:
    """id -> slot as one int32 array over the whole id space.

    Used only where it costs at most 4x the HashIndex's memory (num_rows <= 32
    x capacity: 128 bytes per slot of capacity): a lookup is then one gather,
    several times faster than hash probing, which matters most for the small
    tiers that prefetch keeps busy.
    """

    def __init__(self, num_rows: int, device: torch.device | str = "cpu"):
        self._xp = _arrays(device)
        self.device = self._xp.device
        self.slots = self._xp.full(num_rows, -1, dtype=self._xp.int32)
        self.live = 0

    def __len__(self) -> int:
        return self.live

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self._xp.tensor(self._xp.int64(self.slots.take(self._xp.array(ids))))

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self.slots[self._xp.array(ids)] = self._xp.array(slots.to(torch.int32))
        self.live += len(ids)

    def remove(self, ids: torch.Tensor) -> None:
        self.slots[self._xp.array(ids)] = -1
        self.live -= len(ids)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._xp.nonzero(self.slots >= 0)
        return self._xp.tensor(ids), self._xp.tensor(self.slots[ids]).long()

    def as_tensor(self) -> torch.Tensor:
        """The map itself (int32, -1 where absent) as a tensor on its device: a view, kept current."""
        return self._xp.tensor(self.slots)


def make_index(capacity: int, num_rows: int | None, device: torch.device | str = "cpu") -> HashIndex | DenseIndex:
    """Dense where that stays within 128 bytes per slot, else hashed: either way
    memory is proportional to tier capacity, never to the id space alone."""
    if num_rows is not None and num_rows <= 32 * capacity:
        return DenseIndex(num_rows, device)
    return HashIndex(capacity, device)
