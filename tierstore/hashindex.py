"""Vectorized open-addressing hash map from row id to tier slot, in torch.

Per-id Python dicts run at ~1.5M ids/s; this runs whole batches as a few tensor
ops per probe round, on the tier's own device (GPU for the HBM tier). Memory is
~32 bytes per slot of capacity, independent of the table's id space.
"""
from __future__ import annotations

import torch

EMPTY = -1
TOMBSTONE = -2
PROBE_WINDOW = 8
# Fibonacci hashing multiplier 0x9E3779B97F4A7C15 as a signed int64
_MULT = -7046029254386353131


class HashIndex:
    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = int(capacity)
        self.device = torch.device(device)
        bits = max(4, (2 * max(self.capacity, 1) - 1).bit_length())  # load <= 0.5
        self._bits = bits
        self._mask = (1 << bits) - 1
        self.keys = torch.full((1 << bits,), EMPTY, dtype=torch.int64, device=self.device)
        self.vals = torch.full((1 << bits,), -1, dtype=torch.int64, device=self.device)
        self._mult = torch.tensor(_MULT, dtype=torch.int64, device=self.device)
        self._window = torch.arange(PROBE_WINDOW, dtype=torch.int64, device=self.device)
        self.live = 0
        self.tombstones = 0

    def __len__(self) -> int:
        return self.live

    def _hash(self, ids: torch.Tensor) -> torch.Tensor:
        return ((ids * self._mult) >> (64 - self._bits)) & self._mask

    def _find(self, ids: torch.Tensor) -> torch.Tensor:
        """Table position of each id, or -1.

        After the home slot, probes a window of PROBE_WINDOW slots per round as
        one [n, window] gather: at load <= 0.75 nearly every id ends in the first
        window (a hit, or an EMPTY slot, which ends a linear probe), so a lookup
        is a handful of tensor ops instead of a round of ops per probe.
        """
        h = self._hash(ids)
        # first the home slot alone: at load <= 0.5 it settles most ids (the id, or
        # EMPTY), so only the rest pay for a window's gather and compares
        k = self.keys.index_select(0, h)
        pos = torch.where(k == ids, h, -1)
        todo = torch.nonzero((k != ids) & (k != EMPTY)).squeeze(1)
        if len(todo) == 0:
            return pos
        want, h = ids.index_select(0, todo), (h.index_select(0, todo) + 1) & self._mask
        while True:
            k = self.keys.index_select(0, ((h.unsqueeze(1) + self._window) & self._mask).view(-1)).view(-1, PROBE_WINDOW)
            hit = k == want.unsqueeze(1)
            found = hit.any(1)
            at = torch.where(found, (h + hit.to(torch.uint8).argmax(1)) & self._mask, -1)
            pos[todo] = at
            go_on = torch.nonzero(~found & ~(k == EMPTY).any(1)).squeeze(1)
            if len(go_on) == 0:
                return pos
            todo = todo[go_on]
            want, h = want[go_on], (h[go_on] + PROBE_WINDOW) & self._mask

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id (int64), -1 where absent."""
        pos = self._find(ids)
        found = pos >= 0
        return torch.where(found, self.vals[pos.clamp(min=0)], pos)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ids (unique, none present) mapping to slots."""
        n = len(ids)
        if n == 0:
            return
        if self.live + self.tombstones + n > (self._mask + 1) * 3 // 4:
            self._rebuild(extra=n)
        h = self._hash(ids)
        while len(ids):
            # the first free slot (EMPTY or TOMBSTONE) in each id's next window
            k = self.keys.index_select(0, ((h.unsqueeze(1) + self._window) & self._mask).view(-1)).view(-1, PROBE_WINDOW)
            free = (k == EMPTY) | (k == TOMBSTONE)
            has = free.any(1)
            first = free.to(torch.uint8).argmax(1)
            at = (h + first) & self._mask
            tried = torch.nonzero(has).squeeze(1)
            pos, want = at.index_select(0, tried), ids.index_select(0, tried)
            self.keys[pos] = want
            # ids that chose the same slot race; the id read back is the one that won
            won = self.keys.index_select(0, pos) == want
            self.tombstones -= int((k[tried, first.index_select(0, tried)][won] == TOMBSTONE).sum())
            self.vals[pos[won]] = slots.index_select(0, tried)[won]
            # a loser goes on from the slot it lost (every slot before it is taken); an id
            # whose window was full, from the next window
            again = ~has
            again[tried[~won]] = True
            ids, slots = ids[again], slots[again]
            h = torch.where(has, at, (h + PROBE_WINDOW) & self._mask)[again]
        self.live += n

    def remove(self, ids: torch.Tensor) -> None:
        """Drop ids (all present)."""
        if len(ids) == 0:
            return
        pos = self._find(ids)
        if bool((pos < 0).any()):
            raise KeyError("HashIndex.remove: id not present")
        self.keys[pos] = TOMBSTONE
        self.vals[pos] = -1
        self.live -= len(ids)
        self.tombstones += len(ids)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        at = torch.nonzero(self.keys >= 0).squeeze(1)
        return self.keys.index_select(0, at), self.vals.index_select(0, at)

    def _rebuild(self, extra: int) -> None:
        """Drop the tombstones: the live ids placed afresh in a few whole-table ops
        (inserting them again took ~0.3 s for 0.5M ids, a stalled step)."""
        keys, vals = self.items()
        if len(keys) + extra > (self._mask + 1) * 3 // 4:
            raise RuntimeError("HashIndex over capacity: more ids than the tier was sized for")
        self.keys.fill_(EMPTY)
        self.vals.fill_(-1)
        self.tombstones = 0
        # inserted in order of home slot, each id lands at its home or just past the id
        # before it: pos[i] = max(home[i], pos[i-1] + 1) = i + max(home[:i+1] - arange)
        home, order = torch.sort(self._hash(keys))
        keys, vals = keys.index_select(0, order), vals.index_select(0, order)
        i = torch.arange(len(keys), device=self.device)
        pos = torch.cummax(home - i, 0).values + i
        inside = pos <= self._mask
        self.keys[pos[inside]] = keys[inside]
        self.vals[pos[inside]] = vals[inside]
        self.live = int(inside.sum())
        self.insert(keys[~inside], vals[~inside])  # a run past the table's end wraps to its start


class DenseIndex:
    """id -> slot as one int32 array over the whole id space.

    Used only where it costs at most 4x the HashIndex's memory (num_rows <= 32
    x capacity: 128 bytes per slot of capacity): a lookup is then one gather,
    several times faster than hash probing, which matters most for the small
    tiers that prefetch keeps busy.
    """

    def __init__(self, num_rows: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.slots = torch.full((num_rows,), -1, dtype=torch.int32, device=self.device)
        self.live = 0

    def __len__(self) -> int:
        return self.live

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.slots.index_select(0, ids).long()  # index_select: 2x faster than slots[ids] here

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        self.slots[ids] = slots.to(torch.int32)
        self.live += len(ids)

    def remove(self, ids: torch.Tensor) -> None:
        self.slots[ids] = -1
        self.live -= len(ids)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.nonzero(self.slots >= 0).squeeze(1)
        return ids, self.slots[ids].long()


def make_index(capacity: int, num_rows: int | None, device: torch.device | str = "cpu") -> HashIndex | DenseIndex:
    """Dense where that stays within 128 bytes per slot, else hashed: either way
    memory is proportional to tier capacity, never to the id space alone."""
    if num_rows is not None and num_rows <= 32 * capacity:
        return DenseIndex(num_rows, device)
    return HashIndex(capacity, device)
