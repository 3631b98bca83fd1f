"""The row index's files (io.rowindex): each spill writes one, and each holds one level of
runs. A page of header (magic, a JSON line: the level's runs and their CRCs, and the name
and runs of each older level the index reads under it), then each array from a page
boundary: the caller's (the segments' bookkeeping, int64), then the level's runs a block of
FENCE a page, their starts, lengths and places side by side (a lookup reads the one page
the fence names), with room for the runs the merge may yield (the room left over is a
hole: no disk), the level's fence (every FENCE-th start: Runs.fence) and the CRC of each
block. A file is written once, to a temporary name, synced and renamed, and never changed:
a reader that maps it keeps it until it unmaps.

An open checks what it reads into memory whole; of a level it maps, it checks the header,
the file's size (a file cut short), the fence and the blocks' CRCs, and each block of runs
only when a lookup or a merge first reads it (_Blocks): reading every run at open took 2.1 s
for 1.5 GiB of runs, and grew with the index, where a lookup reads a block's page anyway.
A torn or damaged file found at open is not the index, and its caller replays the segments
instead; a damaged block found later raises RowIndexDamagedError (its caller rebuilds the
index from the segments), never a place read from it."""
from __future__ import annotations

import json
import mmap
import os
import zlib
from pathlib import Path

import numpy as np

from .errors import RowIndexDamagedError
from .files import fsync_path
from . import rowindex
from .rowindex import NONE, RUN_BYTES, Paged, RowIndex, Runs

_MAGIC = b"TSIDX6\n"
PAGE = 4096
_SYNC_BYTES = 32 << 20  # written and synced a piece at a time: dirty pages count against a memory cgroup


def _block() -> np.dtype:
    """A page of runs: the starts, lengths and places of FENCE of them (rowindex.FENCE, which
    tests make small)."""
    f = rowindex.FENCE
    return np.dtype([("start", "<i8", (f,)), ("length", "<u4", (f,)), ("loc", "<u4", (f,))])


def _blocks(n: int) -> int:
    return -(-n // rowindex.FENCE)


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


def write_file(index: RowIndex, path: Path, header: dict, arrays: list[np.ndarray], k: int, durable: bool = True) -> dict:
    """Write ``arrays`` (int64) and the level ``index.merging(k)`` makes (a piece at a time) to
    ``path``: a temporary file, synced (where ``durable``: a file LMDB may name; a reader's
    private level is unlinked once mapped, and needs no sync), renamed over it. Returns the
    header written, which names the mapped levels left under it (``index.levels[k:]``)."""
    cap, block = index.capacity(k), _block()
    sizes = [a.nbytes for a in arrays] + [block.itemsize * _blocks(cap), 8 * (_blocks(cap) + 1), 4 * (_blocks(cap) + 1)]
    offsets = _offsets(sizes)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, offsets[-1])
        for a, at in zip(arrays, offsets):
            _pwrite(fd, _bytes(a), at)
        runs, written, crc, dirty, fence, crcs = 0, 0, 0, 0, [], []
        left = Runs()
        pieces = index.merging(k)
        while True:
            piece = next(pieces, None)
            if piece is not None:
                runs += len(piece)
                left = Runs(*(np.concatenate((getattr(left, c), getattr(piece, c))) for c in ("start", "length", "loc")))
            whole = len(left) // rowindex.FENCE * rowindex.FENCE if piece is not None else len(left)
            if whole:
                pages = _pages(left.take(slice(0, whole)), block)
                # a copy: a view would keep each piece's starts alive, 8 bytes a run of the whole level
                fence.append(left.start[:whole:rowindex.FENCE].copy())
                page_bytes = pages.view(np.uint8).reshape(len(pages), -1)
                crcs.append(np.array([zlib.crc32(p) for p in page_bytes], dtype=np.uint32))  # a loop per page, not per run
                data = _bytes(pages)
                _pwrite(fd, data, offsets[len(arrays)] + written * block.itemsize)
                crc = zlib.crc32(data, crc)
                written += len(pages)
                dirty += len(data)
                left = left.take(slice(whole, None))
            if dirty >= _SYNC_BYTES:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dirty = 0
            if piece is None:
                break
        fence = np.concatenate([np.zeros(0, dtype=np.int64), *fence])
        _pwrite(fd, _bytes(fence), offsets[len(arrays) + 1])
        block_crcs = np.concatenate([np.zeros(0, dtype=np.uint32), *crcs])
        _pwrite(fd, _bytes(block_crcs), offsets[len(arrays) + 2])
        levels = [[name, len(level)] for name, level in zip(index.names[k:], index.levels[k:])]
        header = {**header, "runs": runs, "capacity": cap, "offsets": offsets, "counts": [len(a) for a in arrays],
                  "crc": _crc(arrays), "runs_crc": crc, "fence_crc": zlib.crc32(_bytes(fence)),
                  "blocks_crc": zlib.crc32(_bytes(block_crcs)), "levels": levels}
        # a few hundred bytes, and some 60 a level (MAX_LEVELS): a page holds it
        _pwrite(fd, memoryview(_MAGIC + json.dumps(header).encode() + b"\n"), 0)
        if durable:
            os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent)
    return header


def _pages(runs: Runs, block: np.dtype) -> np.ndarray:
    """``runs`` in pages of FENCE (the last one's rest zero)."""
    pages = np.zeros(_blocks(len(runs)), dtype=block)
    for name in ("start", "length", "loc"):
        column = np.zeros(len(pages) * rowindex.FENCE, dtype=pages[name].dtype)
        column[:len(runs)] = getattr(runs, name)
        pages[name] = column.reshape(len(pages), rowindex.FENCE)
    return pages


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
            f.seek(_run_offsets(header)[0])
            pages = np.fromfile(f, dtype=_block(), count=_blocks(n))
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, ValueError):
        return None
    if len(pages) != _blocks(n) or zlib.crc32(_bytes(pages)) != header["runs_crc"]:
        return None
    return Runs(*(pages[name].reshape(-1)[:n].copy() for name in ("start", "length", "loc")))


class _Blocks:
    """Runs.check of a mapped level: each block (page) of its runs checked against its CRC when
    a lookup or a merge first reads it (the page it reads anyway), then remembered as checked."""

    def __init__(self, path: Path, pages: np.ndarray, crcs: np.ndarray):
        self.path, self.pages, self.crcs = path, pages, crcs
        self.checked = np.zeros(len(crcs), dtype=bool)

    @property
    def nbytes(self) -> int:
        return self.crcs.nbytes + self.checked.nbytes

    def __call__(self, blocks: np.ndarray) -> None:
        todo = blocks[~self.checked[blocks]]
        for b in todo.tolist():
            if zlib.crc32(self.pages[b]) != self.crcs[b]:
                raise RowIndexDamagedError(
                    f"the row index file {self.path} is damaged (block {b} of its runs fails its CRC); "
                    "its store rebuilds the index from the row log's segments (or remove the index-*.bin "
                    "files beside data.mdb: the next open rebuilds it)")
        self.checked[todo] = True


def _map_runs(path: Path, header: dict) -> Runs | None:
    """The level of the file at ``path`` mapped, its size, fence and blocks' CRCs checked (None
    where they fail); its runs are checked a block at a time as they are first read (_Blocks).
    Its pages are read at random (no read-ahead: a lookup reads the page its fence names)."""
    n = header["runs"]
    if not n:
        return Runs()
    offsets, blocks = _run_offsets(header), _blocks(n)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offsets[-1]:  # cut short: a mapped page past its end would fault
                return None
            f.seek(offsets[1])
            fence = np.fromfile(f, dtype=np.int64, count=blocks)
            f.seek(offsets[2])
            crcs = np.fromfile(f, dtype=np.uint32, count=blocks)
        if (len(fence) != blocks or zlib.crc32(_bytes(fence)) != header["fence_crc"]
                or len(crcs) != blocks or zlib.crc32(_bytes(crcs)) != header["blocks_crc"]):
            return None
        mapped = np.memmap(path, dtype=_block(), mode="r", offset=offsets[0], shape=(blocks,))
        mapped._mmap.madvise(mmap.MADV_RANDOM)
        pages = mapped.view(np.ndarray)  # a plain array over the map: a memmap's indexing costs 20 us a call more
        raw = pages.view(np.uint8).reshape(blocks, -1)
        columns = (Paged(pages[name], mapped, n) for name in ("start", "length", "loc"))
        return Runs(*columns, fence, _Blocks(path, raw, crcs))
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
