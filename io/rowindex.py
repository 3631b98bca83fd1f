"""Where each row of a log table is (io.rowlog): a map from id to place (segment index << 12
| slot), kept as *runs*, so that its memory grows with what was written, not with the ids
a table declares.

A run is ``length`` ids from ``start`` whose rows lie in consecutive slots of one segment
from place ``loc`` (NONE: deleted). A table loaded in id order, or a collection's segment
(it sorts its ids), is a few runs a segment; a row written on its own is a run of one
(16 bytes). A table never written holds nothing. A dense array of 4 bytes a declared id
took 4,016 MiB for a 10^9-row table never written, and 8.45 s to open.

Two levels, both sorted by start with no two runs of a level overlapping: ``recent`` takes
each write (small, so a write costs little), and is merged into ``main`` once it holds
an eighth of main's runs; a lookup asks recent first. Every operation is a few vectorized
passes over the ids asked and the runs they meet (np.searchsorted), never a loop per id.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from .files import fsync_path

NONE = np.uint32(0xFFFFFFFF)
RUN_BYTES = 8 + 4 + 4  # start (int64), length (uint32), place of its first id (uint32)
RECENT_RUNS = 1 << 16
_CHUNK_RUNS = 1 << 20  # main's runs a save merges at a time (16 MiB)  # recent is merged into main past this many runs or an eighth of main's
SLOT_BITS = 12  # a place: segment index << SLOT_BITS | slot
_SLOT_MASK = (1 << SLOT_BITS) - 1  # a run never crosses a segment: its places share their high bits


class Runs:
    """Sorted, non-overlapping runs: the ids ``start[i] .. start[i] + length[i] - 1`` are at
    places ``loc[i] ..`` (all NONE where ``loc[i]`` is NONE)."""

    __slots__ = ("start", "length", "loc")

    def __init__(self, start=None, length=None, loc=None):
        self.start = np.zeros(0, dtype=np.int64) if start is None else start
        self.length = np.zeros(0, dtype=np.uint32) if length is None else length
        self.loc = np.zeros(0, dtype=np.uint32) if loc is None else loc

    def __len__(self) -> int:
        return len(self.start)

    @property
    def nbytes(self) -> int:
        return self.start.nbytes + self.length.nbytes + self.loc.nbytes

    @property
    def end(self) -> np.ndarray:
        return self.start + self.length

    def take(self, which) -> "Runs":
        return Runs(self.start[which], self.length[which], self.loc[which])

    @classmethod
    def of(cls, ids: np.ndarray, places: np.ndarray | None) -> "Runs":
        """The runs of distinct ``ids`` at ``places`` (uint32, one each, NONE: deleted; None: all deleted)."""
        ids = np.asarray(ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        if not len(ids):
            return cls()
        breaks = np.diff(ids) != 1
        if places is not None:  # a run goes on to the next slot of its segment, or is of deleted ids
            places = np.asarray(places, dtype=np.uint32)[order]
            none = places == NONE
            breaks |= ~(((np.diff(places.astype(np.int64)) == 1) & ((places[1:] & _SLOT_MASK) != 0)) | (none[1:] & none[:-1]))
        first = np.concatenate(([0], np.flatnonzero(breaks) + 1))
        length = np.diff(np.append(first, len(ids))).astype(np.uint32)
        loc = np.full(len(first), NONE, dtype=np.uint32) if places is None else places[first]
        return cls(ids[first], length, loc)

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(covered, place) of each of ``ids``: whether a run holds it, and its place there
        (NONE where that run is a deletion, or where none holds it)."""
        if not len(self):
            return np.zeros(len(ids), dtype=bool), np.full(len(ids), NONE, dtype=np.uint32)
        i = np.searchsorted(self.start, ids, side="right") - 1
        i0 = np.maximum(i, 0)
        off = ids - self.start[i0]
        covered = (i >= 0) & (off < self.length[i0])
        base = self.loc[i0]
        loc = np.where(covered & (base != NONE), base + off.astype(np.uint32), NONE).astype(np.uint32)
        return covered, loc

    def _cut(self, other: "Runs") -> tuple[np.ndarray, "Runs"]:
        """(indexes of our runs that ``other``'s meet, ascending; their pieces left on either
        side of each of other's runs, sorted): a few passes over other's runs and the runs
        they meet, none over ours (a write into a level of many runs costs its own runs)."""
        o_end = other.end
        before = np.searchsorted(self.start, other.start, side="right") - 1  # ours starting at or before each of theirs
        b0 = np.maximum(before, 0)
        lo = np.where((before >= 0) & (self.start[b0] + self.length[b0] > other.start), before, before + 1)
        hi = np.searchsorted(self.start, o_end, side="left")  # ours starting before it ends are below hi
        n = np.maximum(hi - lo, 0)
        a = np.repeat(lo, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        if not len(a):
            return a, Runs()
        a = a[np.append(True, a[1:] != a[:-1])]  # ascending: two of theirs meet one of ours only where one ends
        a_start, a_loc = self.start[a], self.loc[a]
        a_end = a_start + self.length[a]
        i0 = np.searchsorted(o_end, a_start, side="right")  # their runs inside run a: i0 .. i1 - 1 (one at least)
        i1 = np.searchsorted(other.start, a_end, side="left")
        pieces = i1 - i0 + 1  # before the first, between each two, after the last
        owner = np.repeat(np.arange(len(a)), pieces)
        m = np.arange(len(owner)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        last = len(other) - 1
        p_start = np.where(m == 0, a_start[owner], o_end[np.clip(i0[owner] + m - 1, 0, last)])
        p_end = np.where(m == pieces[owner] - 1, a_end[owner], other.start[np.clip(i0[owner] + m, 0, last)])
        keep = p_end > p_start
        owner, p_start, p_end = owner[keep], p_start[keep], p_end[keep]
        base = a_loc[owner]
        loc = np.where(base == NONE, NONE, base + (p_start - a_start[owner]).astype(np.uint32)).astype(np.uint32)
        return a, Runs(p_start, (p_end - p_start).astype(np.uint32), loc)

    def under(self, newer: "Runs", bottom: bool = False) -> "Runs":
        """These runs with ``newer``'s over them; at the ``bottom`` level deletions are dropped
        (no level below holds those ids)."""
        if bottom:
            kept = newer.take(newer.loc != NONE)
        else:
            kept = newer
        if not len(self) or not len(newer):
            return kept if not len(self) else _inserted(self, kept)
        cut, pieces = self._cut(newer)
        rest = self if not len(cut) else Runs(np.delete(self.start, cut), np.delete(self.length, cut), np.delete(self.loc, cut))
        return _inserted(rest, _sorted(pieces, kept))

    def ids(self) -> np.ndarray:
        """Every id a run holds a row of, ascending."""
        held = self.take(self.loc != NONE)
        length = held.length.astype(np.int64)
        offsets = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
        return np.repeat(held.start, length) + offsets


def _sorted(a: Runs, b: Runs) -> Runs:
    """The runs of ``a`` and ``b`` (each sorted, none overlapping; few) in one sorted level."""
    if not len(a) or not len(b):
        return b if not len(a) else a
    start = np.concatenate((a.start, b.start))
    order = np.argsort(start, kind="stable")
    return Runs(start[order], np.concatenate((a.length, b.length))[order], np.concatenate((a.loc, b.loc))[order])


def _inserted(level: Runs, new: Runs) -> Runs:
    """``new``'s runs (sorted, meeting none of ``level``'s) put in their places in ``level``:
    a copy of its arrays, the new ones slotted in."""
    if not len(new):
        return level
    at = np.searchsorted(level.start, new.start)
    return Runs(np.insert(level.start, at, new.start), np.insert(level.length, at, new.length), np.insert(level.loc, at, new.loc))


class RowIndex:
    """id -> place of one table: runs in two levels (recent over main).

    ``limit``: the bytes it may hold (None: no limit). Past it, main is written to the
    index file and mapped from it (wants_spill: the writer's backend saves it), and only
    recent is held; the page cache keeps what lookups use of the mapped main, as it keeps
    rows. ``spills``: whether it is a writer's (a reader merges in memory, past its limit)."""

    def __init__(self, num_rows: int, limit: int | None = None, spills: bool = True):
        self.num_rows = num_rows
        self.limit = limit
        self.spills = spills
        self.main = Runs()
        self.recent = Runs()
        self.mapped = False  # main is a map of the index file, not memory
        self.dead: np.ndarray | None = None  # by segment index: rows of a mapped main placed there are gone

    @property
    def nbytes(self) -> int:
        """Memory held: a mapped main is the page cache's."""
        return (0 if self.mapped else self.main.nbytes) + self.recent.nbytes

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The place of each of ``ids`` (uint32), NONE where no row is stored."""
        ids = np.asarray(ids, dtype=np.int64)
        covered, loc = self.recent.find(ids)
        if not covered.all():
            rest = ~covered
            loc[rest] = self._in_main(self.main.find(ids[rest])[1])
        return loc

    def _in_main(self, loc: np.ndarray) -> np.ndarray:
        if self.dead is not None:
            placed = loc != NONE
            loc[placed & self.dead[np.where(placed, loc >> SLOT_BITS, 0)]] = NONE
        return loc

    def put(self, ids: np.ndarray, places: np.ndarray | None) -> None:
        """Rows of distinct ``ids`` now at ``places`` (NONE, or all where None: deleted)."""
        self.recent = self.recent.under(Runs.of(ids, places))
        if len(self.recent) > max(RECENT_RUNS, len(self.main) // 8) and self._settles():
            self.settle()

    def _settles(self) -> bool:
        """Whether recent merges into main in memory: main is not mapped, and the merge's
        copies fit the limit (about three of main and two of recent at once); or recent is
        four times its size, which only a replay at open makes (no spill can run within one),
        and a write costs recent's size: past that a replay of every segment took 177 s for
        a 34M-row table, against seconds merging. The open spills once it is replayed."""
        if not self.spills or len(self.recent) > 4 * max(RECENT_RUNS, len(self.main) // 8):
            return True
        return not self.mapped and (self.limit is None or 3 * self.main.nbytes + 2 * self.recent.nbytes <= self.limit)

    def wants_spill(self) -> bool:
        """Whether the index is past its limit: main is to be written out and mapped."""
        if self.limit is None or not self.spills:
            return False
        if self.mapped:
            return self.recent.nbytes > self.limit // 4
        return not self._settles() and len(self.recent) > max(RECENT_RUNS, len(self.main) // 8) \
            or self.main.nbytes + self.recent.nbytes > self.limit // 2

    def settle(self) -> None:
        """Merge recent into main in memory (a mapped main is read whole: a reader's)."""
        if len(self.recent) or self.dead is not None:
            main = self.main if self.dead is None else self.main.take(self._in_main(self.main.loc.copy()) != NONE)
            self.main, self.recent, self.mapped, self.dead = main.under(self.recent, bottom=True), Runs(), False, None

    def drop(self, dead: np.ndarray) -> None:
        """Rows placed in the segments ``dead`` marks (bool by segment index) are gone. A
        mapped main keeps them, masked, until it is next written: their segment indexes
        must not be reused until then (``held``)."""
        placed = self.recent.loc != NONE
        self.recent.loc[placed & dead[np.where(placed, self.recent.loc >> SLOT_BITS, 0)]] = NONE
        if self.mapped:
            self.dead = dead.copy() if self.dead is None else _padded(self.dead, len(dead)) | _padded(dead, len(self.dead))
        else:
            placed = self.main.loc != NONE
            self.main = self.main.take(~(placed & dead[np.where(placed, self.main.loc >> SLOT_BITS, 0)]))

    def held(self) -> list[int]:
        """Segment indexes a mapped main still names though their segments are gone."""
        return [] if self.dead is None else np.flatnonzero(self.dead).tolist()

    def ids(self) -> np.ndarray:
        """Ids of every row stored, ascending."""
        main = self.main.take(self._in_main(self.main.loc.copy()) != NONE)
        return main.under(self.recent, bottom=True).ids()


    def merged(self):
        """Main with recent over it (and a mapped main's dead rows left out), in pieces of
        _CHUNK_RUNS of main's runs at most: what a save writes, never all of main in memory."""
        main, recent = self.main, self.recent
        n = len(main)
        for lo in range(0, max(n, 1), _CHUNK_RUNS):
            hi = min(lo + _CHUNK_RUNS, n)
            piece = main.take(slice(lo, hi))
            piece = piece.take(self._in_main(np.array(piece.loc)) != NONE)
            # recent's runs within this piece's ids: from its first start (all ids below, for the
            # first) up to the next piece's; a run across the line is cut in two
            first = main.start[lo] if lo else np.iinfo(np.int64).min
            last = main.start[hi] if hi < n else np.iinfo(np.int64).max
            a = np.searchsorted(recent.end, first, side="right")
            b = np.searchsorted(recent.start, last, side="left")
            part = recent.take(slice(a, b))
            start = np.maximum(part.start, first)
            end = np.minimum(part.end, last)
            loc = np.where(part.loc == NONE, NONE, part.loc + (start - part.start).astype(np.uint32)).astype(np.uint32)
            yield piece.under(Runs(start, (end - start).astype(np.uint32), loc), bottom=True)

    def capacity(self) -> int:
        """The most runs merged() yields: each of recent's adds itself and cuts one of main's
        in two, and each piece's line cuts one of recent's."""
        return len(self.main) + 2 * len(self.recent) + len(self.main) // _CHUNK_RUNS + 1


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) >= n else np.concatenate((a, np.zeros(n - len(a), dtype=a.dtype)))


# -- the index file ----------------------------------------------------------------------------
# A page of header (magic, a JSON line), then each array from a page boundary: the caller's
# (the segments' bookkeeping, int64), then main's starts, lengths and places, each with room
# for capacity() runs (the room left over is a hole: no disk). The runs are mapped from the
# file in place when they do not fit the index's limit.
_MAGIC = b"TSIDX2\n"
PAGE = 4096
_SYNC_BYTES = 32 << 20  # written and synced a piece at a time: dirty pages count against a memory cgroup
_RUN_DTYPES = (np.dtype("<i8"), np.dtype("<u4"), np.dtype("<u4"))


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _crc(arrays) -> int:
    crc = 0
    for a in arrays:
        crc = zlib.crc32(_bytes(a), crc)
    return crc


def _pwrite(fd: int, data: memoryview, at: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], PAGE
    for n in sizes:
        out.append(at)
        at += -(-n // PAGE) * PAGE
    return out + [at]


def write_file(index: RowIndex, path: Path, header: dict, arrays: list[np.ndarray]) -> dict:
    """Write ``arrays`` (int64) and ``index``'s runs (recent merged into main, a piece at a
    time) to ``path``: a temporary file, synced, renamed over it. Returns the header written."""
    cap = index.capacity()
    sizes = [a.nbytes for a in arrays] + [d.itemsize * cap for d in _RUN_DTYPES]
    offsets = _offsets(sizes)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, offsets[-1])
        for a, at in zip(arrays, offsets):
            _pwrite(fd, _bytes(a), at)
        runs, crcs, dirty = 0, [0, 0, 0], 0
        for piece in index.merged():
            for k, a in enumerate((piece.start, piece.length, piece.loc)):
                data = _bytes(a)
                _pwrite(fd, data, offsets[len(arrays) + k] + runs * a.itemsize)
                crcs[k] = zlib.crc32(data, crcs[k])
                dirty += len(data)
            runs += len(piece)
            if dirty >= _SYNC_BYTES:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dirty = 0
        header = {**header, "runs": runs, "capacity": cap, "offsets": offsets, "counts": [len(a) for a in arrays],
                  "crc": _crc(arrays), "runs_crc": crcs}
        # a few hundred bytes: a page holds it
        _pwrite(fd, memoryview(_MAGIC + json.dumps(header).encode() + b"\n"), 0)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_path(path.parent)
    return header


def read_file(path: Path, expect: dict) -> tuple[dict, list[np.ndarray]] | None:
    """(header, arrays) of the index file at ``path`` whose header holds ``expect``; None where
    there is none, it holds other values, or its arrays do not read back whole (crc)."""
    try:
        with open(path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                return None
            header = json.loads(f.readline(PAGE))
            if any(header.get(k) != v for k, v in expect.items()):
                return None
            arrays = []
            for at, count in zip(header["offsets"], header["counts"]):
                f.seek(at)
                arrays.append(np.fromfile(f, dtype=np.int64, count=count))
            if [len(a) for a in arrays] != header["counts"] or _crc(arrays) != header["crc"]:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return header, arrays


def load_runs(index: RowIndex, path: Path, header: dict) -> bool:
    """Make the runs of the index file at ``path`` (``header``: read_file's) ``index``'s main:
    read into memory where they fit half its limit (their crc checked: False where it fails),
    else mapped (not read: a table's runs may be GiBs, and an open reads them not)."""
    n, offsets = header["runs"], header["offsets"][len(header["counts"]):]
    if n * RUN_BYTES <= (index.limit // 2 if index.limit is not None else n * RUN_BYTES):
        try:
            with open(path, "rb") as f:
                arrays = []
                for at, dtype in zip(offsets, _RUN_DTYPES):
                    f.seek(at)
                    arrays.append(np.fromfile(f, dtype=dtype, count=n))
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, ValueError):
            return False
        if [len(a) for a in arrays] != [n] * 3 or [zlib.crc32(_bytes(a)) for a in arrays] != header["runs_crc"]:
            return False
        mapped = False
    else:
        arrays = [np.memmap(path, dtype=d, mode="r", offset=at, shape=(n,)) for at, d in zip(offsets, _RUN_DTYPES)]
        mapped = True
    index.main, index.recent, index.mapped, index.dead = Runs(*arrays), Runs(), mapped, None
    return True
