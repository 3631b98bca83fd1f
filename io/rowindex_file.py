"""The row index's files (io.rowindex): each spill writes one, and each holds one level of
runs. A page of header (magic, a JSON line: the level's runs and their CRCs, and the name
and runs of each older level the index reads under it), then each array from a page
boundary: the caller's (the segments' bookkeeping, int64), then the level's starts, and its
lengths and places side by side (a lookup reads one page of them), each with room for the
runs the merge may yield (the room left over is a hole: no disk), the level's fence
(every FENCE-th start: Runs.fence) and the CRC of each block of FENCE runs (their starts,
then their lengths and places). A file is written once, to a temporary name, synced and
renamed, and never changed: a reader that maps it keeps it until it unmaps.

An open checks what it reads into memory whole; of a level it maps, it checks the header,
the file's size (a file cut short), the fence and the blocks' CRCs, and each block of runs
only when a lookup or a merge first reads it (_Blocks): reading every run at open took 2.1 s
for 1.5 GiB of runs, and grew with the index, where a lookup reads a block's two pages
anyway. A torn or damaged file found at open is not the index, and its caller replays the
segments instead; a damaged block found later raises RowIndexDamagedError (its caller
rebuilds the index from the segments), never a place read from it."""
from __future__ import annotations

import json
import mmap
import os
import zlib
from pathlib import Path

import numpy as np

from .errors import RowIndexDamagedError
from .files import fsync_path
from .rowindex import FENCE, NONE, RUN_BYTES, RowIndex, Runs

_MAGIC = b"TSIDX5\n"
PAGE = 4096
_SYNC_BYTES = 32 << 20  # written and synced a piece at a time: dirty pages count against a memory cgroup
_SPAN = np.dtype([("length", "<u4"), ("loc", "<u4")])  # a run's length and place, side by side
_RUN_DTYPES = (np.dtype("<i8"), _SPAN)


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


def write_file(index: RowIndex, path: Path, header: dict, arrays: list[np.ndarray], k: int) -> dict:
    """Write ``arrays`` (int64) and the level ``index.merging(k)`` makes (a piece at a time) to
    ``path``: a temporary file, synced, renamed over it. Returns the header written, which
    names the mapped levels left under it (``index.levels[k:]``)."""
    cap = index.capacity(k)
    sizes = [a.nbytes for a in arrays] + [d.itemsize * cap for d in _RUN_DTYPES] + [8 * (cap // FENCE + 1), 4 * (cap // FENCE + 1)]
    offsets = _offsets(sizes)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, offsets[-1])
        for a, at in zip(arrays, offsets):
            _pwrite(fd, _bytes(a), at)
        runs, crcs, dirty, fence, blocks = 0, [0, 0], 0, [], _BlockCrcs()
        for piece in index.merging(k):
            fence.append(piece.start[(-runs) % FENCE::FENCE])
            span = np.empty(len(piece), dtype=_SPAN)
            span["length"], span["loc"] = piece.length, piece.loc
            blocks.add(piece.start, span)
            for j, a in enumerate((piece.start, span)):
                data = _bytes(a)
                _pwrite(fd, data, offsets[len(arrays) + j] + runs * a.itemsize)
                crcs[j] = zlib.crc32(data, crcs[j])
                dirty += len(data)
            runs += len(piece)
            if dirty >= _SYNC_BYTES:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dirty = 0
        fence = np.concatenate([np.zeros(0, dtype=np.int64), *fence])
        _pwrite(fd, _bytes(fence), offsets[len(arrays) + 2])
        block_crcs = blocks.done()
        _pwrite(fd, _bytes(block_crcs), offsets[len(arrays) + 3])
        levels = [[name, len(level)] for name, level in zip(index.names[k:], index.levels[k:])]
        header = {**header, "runs": runs, "capacity": cap, "offsets": offsets, "counts": [len(a) for a in arrays],
                  "crc": _crc(arrays), "runs_crc": crcs, "fence_crc": zlib.crc32(_bytes(fence)),
                  "blocks_crc": zlib.crc32(_bytes(block_crcs)), "levels": levels}
        # a few hundred bytes, and some 60 a level (MAX_LEVELS): a page holds it
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


def _run_offsets(header: dict) -> list[int]:
    return header["offsets"][len(header["counts"]):]


def _read_runs(path: Path, header: dict) -> Runs | None:
    """The level of the file at ``path`` read into memory; None where it fails its CRCs."""
    n = header["runs"]
    try:
        with open(path, "rb") as f:
            arrays = []
            for at, dtype in zip(_run_offsets(header), _RUN_DTYPES):
                f.seek(at)
                arrays.append(np.fromfile(f, dtype=dtype, count=n))
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, ValueError):
        return None
    if [len(a) for a in arrays] != [n] * 2 or [zlib.crc32(_bytes(a)) for a in arrays] != header["runs_crc"]:
        return None
    start, span = arrays
    return Runs(start, span["length"].copy(), span["loc"].copy())


class _BlockCrcs:
    """The CRC of each block of FENCE runs of a level written a piece at a time (pieces of
    any length): a loop per block (FENCE runs), not per run."""

    def __init__(self):
        self.crcs, self.left = [], (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=_SPAN))

    def add(self, start: np.ndarray, span: np.ndarray) -> None:
        start, span = np.concatenate((self.left[0], start)), np.concatenate((self.left[1], span))
        whole = len(start) // FENCE * FENCE
        self.crcs += [_block_crc(start[i:i + FENCE], span[i:i + FENCE]) for i in range(0, whole, FENCE)]
        self.left = start[whole:], span[whole:]

    def done(self) -> np.ndarray:
        if len(self.left[0]):
            self.crcs.append(_block_crc(*self.left))
        return np.array(self.crcs, dtype=np.uint32)


def _block_crc(start: np.ndarray, span: np.ndarray) -> int:
    return zlib.crc32(_bytes(span), zlib.crc32(_bytes(start)))


class _Blocks:
    """Runs.check of a mapped level: each block of its runs checked against its CRC when a
    lookup or a merge first reads it (the pages it reads anyway), then remembered as checked."""

    def __init__(self, path: Path, start: np.ndarray, span: np.ndarray, crcs: np.ndarray):
        self.path, self.start, self.span, self.crcs = path, start, span, crcs
        self.checked = np.zeros(len(crcs), dtype=bool)

    @property
    def nbytes(self) -> int:
        return self.crcs.nbytes + self.checked.nbytes

    def __call__(self, blocks: np.ndarray) -> None:
        todo = blocks[~self.checked[blocks]]
        for b in todo.tolist():
            lo = b * FENCE
            if _block_crc(self.start[lo:lo + FENCE], self.span[lo:lo + FENCE]) != self.crcs[b]:
                raise RowIndexDamagedError(
                    f"the row index file {self.path} is damaged (block {b} of its runs fails its CRC); "
                    "its store rebuilds the index from the row log's segments (or remove the index-*.bin "
                    "files beside data.mdb: the next open rebuilds it)")
        self.checked[todo] = True


def _map_runs(path: Path, header: dict) -> Runs | None:
    """The level of the file at ``path`` mapped, its size, fence and blocks' CRCs checked (None
    where they fail); its runs are checked a block at a time as they are first read (_Blocks).
    Its pages are read at random (no read-ahead: a lookup reads a page of starts and one of
    lengths and places)."""
    n = header["runs"]
    if not n:
        return Runs()
    offsets = _run_offsets(header)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offsets[-1]:  # cut short: a mapped page past its end would fault
                return None
            f.seek(offsets[2])
            fence = np.fromfile(f, dtype=np.int64, count=-(-n // FENCE))
            f.seek(offsets[3])
            crcs = np.fromfile(f, dtype=np.uint32, count=-(-n // FENCE))
        if (len(fence) != -(-n // FENCE) or zlib.crc32(_bytes(fence)) != header["fence_crc"]
                or len(crcs) != len(fence) or zlib.crc32(_bytes(crcs)) != header["blocks_crc"]):
            return None
        start, span = (np.memmap(path, dtype=d, mode="r", offset=at, shape=(n,)) for at, d in zip(offsets, _RUN_DTYPES))
        for m in (start, span):
            m._mmap.madvise(mmap.MADV_RANDOM)
        return Runs(start, span["length"], span["loc"], fence, _Blocks(path, start, span, crcs))
    except (OSError, ValueError, KeyError):
        return None


def _fits(index: RowIndex, runs: int) -> bool:
    return index.limit is None or runs * RUN_BYTES <= index.limit // 2


def take_runs(index: RowIndex, path: Path, header: dict, k: int) -> bool:
    """After write_file(index, path, ..., k), no index changed between: the level written
    replaces memory's runs and the ``k`` levels merged into it; read back into memory
    (checked) where no mapped level is left and it fits half the limit, else mapped. False,
    the index as it was, where it does not read back."""
    n, full = header["runs"], k == len(index.levels)
    if full and _fits(index, n):
        runs = _read_runs(path, header)
        if runs is None:
            return False
        index.main, index.levels, index.names = runs, [], []
    else:
        runs = _map_runs(path, header)
        if runs is None:
            return False
        keep = [(path.name, runs)] if n else []
        keep += list(zip(index.names[k:], index.levels[k:]))
        index.main, index.names, index.levels = Runs(), [name for name, _ in keep], [level for _, level in keep]
    index.recent = Runs()
    if full:
        index.dead = None
    return True


def load_runs(index: RowIndex, path: Path, header: dict, expect: dict) -> bool:
    """Make the level of the file at ``path`` (``header``: read_file's) and the older ones it
    names (their headers holding ``expect``) ``index``'s: read into memory, merged into main
    (every run checked against its CRCs), where they fit half its limit, else mapped (each
    block checked as it is first read: _map_runs). False, the index left empty, where a file is missing or fails its checks."""
    files = [(path, header)]
    for name, runs in header["levels"]:
        got = read_file(path.parent / name, expect)
        if got is None or got[0]["runs"] != runs:
            return False
        files.append((path.parent / name, got[0]))
    if _fits(index, sum(h["runs"] for _, h in files)):
        main = Runs()
        for p, h in reversed(files):  # the oldest first, each newer over it
            runs = _read_runs(p, h)
            if runs is None:
                return False
            main = main.under(runs)
        index.main, index.levels, index.names = main.take(main.loc != NONE), [], []
    else:
        levels = []
        for p, h in files:
            runs = _map_runs(p, h)
            if runs is None:
                return False
            if len(runs):
                levels.append((p.name, runs))
        index.main, index.names, index.levels = Runs(), [name for name, _ in levels], [level for _, level in levels]
    index.recent, index.dead = Runs(), None
    return True
