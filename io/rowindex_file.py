"""The row index's files (io.rowindex): each spill writes one, and each holds one level of
runs. A page of header (magic, a JSON line: the level's runs and their CRCs, and the name
and runs of each older level the index reads under it), then each array from a page
boundary: the caller's (a save's: the segments' bookkeeping, int64; none for a spill's level
alone: io.rowlog.write_index), then the level's runs a block of FENCE a page, their starts,
lengths and places side by side (a lookup reads the one page the fence names), with room
for the runs the merge may yield (the room left over is a hole: no disk), the level's fence
(every FENCE-th start: Runs.fence), the CRC of each block, each block's filter
(rowindex.Filter, a sixteenth of a page each) and the CRC of each page of them (a file
written before filters has none: its lookups ask every block). A file is written once, to
a temporary name, synced and renamed, and never changed: a reader that maps it keeps it
until it unmaps.

An open checks what it reads into memory whole; of a level it maps, it checks the header,
the file's size (a file cut short), the fence and the blocks' CRCs, and each block of runs
only when a lookup or a merge first reads it (_Blocks): reading every run at open took 2.1 s
for 1.5 GiB of runs, and grew with the index, where a lookup reads a block's page anyway.
A dense level (io.rowindex.Dense: a spill's choice where the level would hold more than a
quarter as many runs as the table declares ids and can be held in memory, or, mapped, most
ids: _dense) holds every id's value instead of runs, a
page of rowindex.DENSE_IDS at a time, a CRC a page, and no fence; the pages no row reaches
are holes of the file. Where the index may hold it in memory (RowIndex.room), a dense level is
read whole, each page checked, instead of mapped; one a merge wrote from a held level is that
level, its values updated in place (RowIndex.dense_merging), and is not read again.

A torn or damaged file found at open is not the index, nor is one whose older level's file
holds the bytes of another (each file is named by the token its header holds), and its
caller replays the segments instead; a damaged block found later raises
RowIndexDamagedError (its caller rebuilds the index from the segments), never a place read
from it."""
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
from .rowindex import NONE, RUN_BYTES, Dense, Paged, RowIndex, Runs

_MAGIC = b"TSIDX7\n"  # 7: dense levels (a file of 6 is an older tierstore's: replayed)
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
    if _dense(index, k):
        pages = rowindex.dense_page_count(index.num_rows)
        sizes, level = [4 * rowindex.DENSE_IDS * pages, 4 * pages], _write_dense
    else:
        cap = index.capacity(k)
        filter_pages = _filter_pages(_blocks(cap))
        sizes = [_block().itemsize * _blocks(cap), 8 * (_blocks(cap) + 1), 4 * (_blocks(cap) + 1), PAGE * filter_pages, 4 * filter_pages]
        level = _write_runs
    offsets = _offsets([a.nbytes for a in arrays] + sizes)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, offsets[-1])
        for a, at in zip(arrays, offsets):
            _pwrite(fd, _bytes(a), at)
        written = level(index, k, _Writer(fd), offsets[len(arrays):])
        levels = [[name, len(level)] for name, level in zip(index.names[k:], index.levels[k:])]
        header = {**header, **written, "offsets": offsets, "counts": [len(a) for a in arrays], "crc": _crc(arrays), "levels": levels}
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


class _Writer:
    """Writes a level's pages, synced and dropped from the page cache every _SYNC_BYTES: dirty
    pages count against a memory cgroup."""

    def __init__(self, fd: int):
        self.fd, self.dirty = fd, 0

    def __call__(self, data: memoryview, at: int) -> None:
        _pwrite(self.fd, data, at)
        self.dirty += len(data)
        if self.dirty >= _SYNC_BYTES:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self.dirty = 0


def _write_runs(index: RowIndex, k: int, write: _Writer, offsets: list[int]) -> dict:
    """The runs of ``index.merging(k)`` in blocks of FENCE a page, their fence, CRCs and
    filters (rowindex.Filter) at ``offsets``; returns the header's fields for them."""
    block = _block()
    runs, ids, written, crc, fence, crcs = 0, 0, 0, 0, [], []
    filters = _FilterWriter(write, offsets[3])
    left = Runs()
    pieces = index.merging(k)
    while True:
        piece = next(pieces, None)
        if piece is not None:
            runs += len(piece)
            ids += int(piece.length.sum(dtype=np.int64))
            left = Runs(*(np.concatenate((getattr(left, c), getattr(piece, c))) for c in ("start", "length", "loc")))
        whole = len(left) // rowindex.FENCE * rowindex.FENCE if piece is not None else len(left)
        if whole:
            pages = _pages(left.take(slice(0, whole)), block)
            filters.add(rowindex.block_filters(left.take(slice(0, whole))))
            # a copy: a view would keep each piece's starts alive, 8 bytes a run of the whole level
            fence.append(left.start[:whole:rowindex.FENCE].copy())
            crcs.append(_page_crcs(pages.view(np.uint8).reshape(len(pages), -1)))
            data = _bytes(pages)
            write(data, offsets[0] + written * block.itemsize)
            crc = zlib.crc32(data, crc)
            written += len(pages)
            left = left.take(slice(whole, None))
        if piece is None:
            break
    fence = np.concatenate([np.zeros(0, dtype=np.int64), *fence])
    write(_bytes(fence), offsets[1])
    block_crcs = np.concatenate([np.zeros(0, dtype=np.uint32), *crcs])
    write(_bytes(block_crcs), offsets[2])
    filter_crcs = filters.close()
    write(_bytes(filter_crcs), offsets[4])
    return {"runs": runs, "ids": ids, "runs_crc": crc, "fence_crc": zlib.crc32(_bytes(fence)),
            "blocks_crc": zlib.crc32(_bytes(block_crcs)), "filter_crc": zlib.crc32(_bytes(filter_crcs))}


class _FilterWriter:
    """Writes the blocks' filters a page (rowindex.filter_blocks() of them) at a time, as the
    blocks come, from the file offset ``at``; close() writes the last page and returns every
    page's CRC."""

    def __init__(self, write: _Writer, at: int):
        self.write, self.at, self.pages, self.crcs = write, at, 0, []
        self.left = np.zeros((0, rowindex.filter_words()), dtype=np.uint64)

    def add(self, filters: np.ndarray, last: bool = False) -> None:
        left = np.concatenate((self.left, filters))
        per = rowindex.filter_blocks()
        whole = len(left) // per * per if not last else -(-len(left) // per) * per
        if whole:
            pages = np.zeros((whole, left.shape[1]), dtype=np.uint64)
            pages[:min(whole, len(left))] = left[:whole]
            raw = pages.view(np.uint8).reshape(-1, PAGE)
            self.write(_bytes(raw), self.at + self.pages * PAGE)
            self.crcs.append(_page_crcs(raw))
            self.pages += len(raw)
        self.left = left[whole:]

    def close(self) -> np.ndarray:
        self.add(self.left[:0], last=True)
        return np.concatenate([np.zeros(0, dtype=np.uint32), *self.crcs])


def _filter_pages(blocks: int) -> int:
    """The pages of the filters of ``blocks`` blocks of runs."""
    return -(-blocks // rowindex.filter_blocks())


def _dense(index: RowIndex, k: int) -> bool:
    """Whether the next spill (merging ``k`` levels) writes a dense level: where its runs (at
    most those it merges) would take more than its ids' values (4 bytes each of the table's),
    and would be mapped (a full merge that fits half the limit is read back into memory); and
    where the index cannot hold the dense level (RowIndex.room), only where its runs would
    cover most ids (rowindex.MAPPED_DENSE_RUNS): mapped, it costs every lookup a page."""
    runs = len(index.recent) + len(index.main) + sum(len(level) for level in index.levels[:k])
    if runs * RUN_BYTES <= 4 * index.num_rows or (k == len(index.levels) and _fits(index, runs)):
        return False
    return rowindex.dense_bytes(index.num_rows) <= index.room(k) or runs >= rowindex.MAPPED_DENSE_RUNS * index.num_rows


def _page_crcs(pages: np.ndarray) -> np.ndarray:
    return np.array([zlib.crc32(p) for p in pages], dtype=np.uint32)  # a loop per page, not per run or id


def _write_dense(index: RowIndex, k: int, write: _Writer, offsets: list[int]) -> dict:
    """The values of ``index.merging(k)`` over the table's ids (rowindex.dense_pages), a CRC a
    page, at ``offsets``; returns the header's fields for them."""
    page = 4 * rowindex.DENSE_IDS
    crcs = np.full(rowindex.dense_page_count(index.num_rows), zlib.crc32(bytes(page)), dtype=np.uint32)  # a hole's
    covered = 0
    dense_under = k and isinstance(index.levels[k - 1], Dense)
    parts = index.dense_merging(k) if dense_under else rowindex.dense_pages(index.merging(k), index.num_rows)
    for first, values in parts:
        write(_bytes(values), offsets[0] + first * page)
        crcs[first: first + len(values) // rowindex.DENSE_IDS] = _page_crcs(values.view(np.uint8).reshape(-1, page))
        covered += int(np.count_nonzero(values))
    write(_bytes(crcs), offsets[1])
    return {"dense": True, "runs": covered, "pages": len(crcs), "blocks_crc": zlib.crc32(_bytes(crcs))}


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
    if header.get("dense"):
        level = _map_dense(path, header)
        return None if level is None else _checked(level.window, 0, len(level.values))
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
    a lookup or a merge first reads it (the page it reads anyway), then remembered as checked,
    a bit a block. ``crcs`` is mapped from the file, as the runs are: the page cache's."""

    def __init__(self, path: Path, pages: np.ndarray, crcs: np.ndarray, what: str = "block"):
        self.path, self.pages, self.crcs, self.what = path, pages, crcs, what
        self.bits = np.zeros(-(-len(crcs) // 8), dtype=np.uint8)

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    @property
    def checked(self) -> np.ndarray:
        """Whether each block was checked (bool a block)."""
        return np.unpackbits(self.bits, count=len(self.crcs), bitorder="little").view(bool)

    def __call__(self, blocks: np.ndarray) -> None:
        todo = np.unique(blocks[(self.bits[blocks >> 3] >> (blocks & 7) & 1) == 0])
        for b in todo.tolist():
            if zlib.crc32(self.pages[b]) != self.crcs[b]:
                raise RowIndexDamagedError(
                    f"the row index file {self.path} is damaged ({self.what} {b} of its level fails its CRC); "
                    "its store rebuilds the index from the row log's segments (or remove the index-*.bin "
                    "files beside data.mdb: the next open rebuilds it)")
        np.bitwise_or.at(self.bits, todo >> 3, (1 << (todo & 7)).astype(np.uint8))


def _mapped(path: Path, dtype, offset: int, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` from ``offset`` of the file at ``path``, mapped read-only: a
    mapped level's fence and CRCs are the page cache's, as its runs are, not memory the index
    holds (read into memory, 12 bytes a block of FENCE runs: 7 MB for a level of 150M runs,
    which a table of 200M ids may map, and not bounded by the index's limit)."""
    if not count:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,)).view(np.ndarray)


def _checked(read, *args):
    """``read(*args)``, None where a block it reads fails its CRC."""
    try:
        return read(*args)
    except RowIndexDamagedError:
        return None


def _map_dense(path: Path, header: dict, hold: bool = False) -> Dense | None:
    """The dense level of the file at ``path`` mapped, or where ``hold``, read into memory
    (every page checked), its size and pages' CRCs checked (None where they fail); a mapped
    level's pages are checked as they are first read (_Blocks)."""
    offsets, page = _run_offsets(header), 4 * rowindex.DENSE_IDS
    try:
        pages = header["pages"]
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offsets[-1]:
                return None
            crcs = _mapped(path, np.uint32, offsets[1], pages)
            if zlib.crc32(_bytes(crcs)) != header["blocks_crc"]:
                return None
            if hold:
                f.seek(offsets[0])
                values = np.fromfile(f, dtype=np.uint32, count=pages * rowindex.DENSE_IDS)
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                if len(values) != pages * rowindex.DENSE_IDS or not np.array_equal(
                        _page_crcs(values.view(np.uint8).reshape(pages, page)), crcs):
                    return None
                return Dense(values, None, header["runs"])
        mapped = np.memmap(path, dtype=np.uint32, mode="r", offset=offsets[0], shape=(pages * rowindex.DENSE_IDS,))
        mapped._mmap.madvise(mmap.MADV_RANDOM)
        values = mapped.view(np.ndarray)
        return Dense(values, mapped, header["runs"], _Blocks(path, values.view(np.uint8).reshape(pages, page), crcs))
    except (OSError, ValueError, KeyError):
        return None


def _map_runs(path: Path, header: dict, room: int = 0, declared: int | None = None) -> Runs | Dense | None:
    """The level of the file at ``path`` mapped, its size, fence and blocks' CRCs checked (None
    where they fail); its runs are checked a block at a time as they are first read (_Blocks).
    Its pages are read at random (no read-ahead: a lookup reads the page its fence names). A
    dense level of ``room`` bytes or less is held in memory instead, and a level whose runs
    cover more than rowindex.FILTERED_IDS of the ``declared`` ids is mapped without its filter."""
    n = header["runs"]
    if not n:
        return Runs()
    if header.get("dense"):
        return _map_dense(path, header, hold=4 * rowindex.DENSE_IDS * header["pages"] <= room)
    offsets, blocks = _run_offsets(header), _blocks(n)
    try:
        if os.stat(path).st_size < offsets[-1]:  # cut short: a mapped page past its end would fault
            return None
        fence, crcs = _mapped(path, np.int64, offsets[1], blocks), _mapped(path, np.uint32, offsets[2], blocks)
        if zlib.crc32(_bytes(fence)) != header["fence_crc"] or zlib.crc32(_bytes(crcs)) != header["blocks_crc"]:
            return None
        filtered = None
        if "filter_crc" in header and not (declared and header.get("ids", 0) > rowindex.FILTERED_IDS * declared):
            filtered = _map_filter(path, header, offsets, blocks)
        if filtered is False:
            return None
        mapped = np.memmap(path, dtype=_block(), mode="r", offset=offsets[0], shape=(blocks,))
        mapped._mmap.madvise(mmap.MADV_RANDOM)
        pages = mapped.view(np.ndarray)  # a plain array over the map: a memmap's indexing costs 20 us a call more
        raw = pages.view(np.uint8).reshape(blocks, -1)
        columns = (Paged(pages[name], mapped, n) for name in ("start", "length", "loc"))
        return Runs(*columns, fence, _Blocks(path, raw, crcs), filtered, header.get("ids"))
    except (OSError, ValueError, KeyError):
        return None


def _map_filter(path: Path, header: dict, offsets: list[int], blocks: int) -> rowindex.Filter | bool:
    """The filters of a mapped level's ``blocks`` blocks (rowindex.Filter), their pages' CRCs
    checked (False where they fail); each page is checked as it is first read."""
    pages = _filter_pages(blocks)
    crcs = _mapped(path, np.uint32, offsets[4], pages)
    if zlib.crc32(_bytes(crcs)) != header["filter_crc"]:
        return False
    mapped = np.memmap(path, dtype=np.uint64, mode="r", offset=offsets[3], shape=(pages * PAGE // 8,))
    mapped._mmap.madvise(mmap.MADV_RANDOM)
    words = mapped.view(np.ndarray)
    return rowindex.Filter(words.reshape(-1, rowindex.filter_words()), _Blocks(path, words.view(np.uint8).reshape(pages, PAGE), crcs, "filter page"))


def _fits(index: RowIndex, runs: int) -> bool:
    return index.limit is None or runs * RUN_BYTES <= index.limit // 2


def take_runs(index: RowIndex, path: Path, header: dict, k: int) -> bool:
    """After write_file(index, path, ..., k), no index changed between: the level written
    replaces memory's runs and the ``k`` levels merged into it; read back into memory
    (checked) where no mapped level is left and it fits half the limit, else mapped. False,
    the index as it was, where it does not read back."""
    n, full = header["runs"], k == len(index.levels)
    if full and _fits(index, n) and not header.get("dense"):  # a dense level was written to be mapped (_dense)
        runs = _read_runs(path, header)
        if runs is None:
            return False
        index.main, index.levels, index.names = runs, [], []
    else:
        merged = index.levels[k - 1] if k else None
        if header.get("dense") and rowindex.in_memory(merged):
            runs = Dense(merged.values, None, n)  # merged into in place (RowIndex.dense_merging)
        else:
            runs = _map_runs(path, header, index.room(k), index.num_rows)
            if runs is None:
                return False
        keep = [(path.name, runs)] if n else []
        keep += list(zip(index.names[k:], index.levels[k:]))
        index.main, index.names, index.levels = Runs(), [name for name, _ in keep], [level for _, level in keep]
    index.recent = Runs()
    if full:
        index.dead = None
    if not any(level is index.current for level in index.levels):
        index.make_current()
    return True


def file_name(stem: str, token: str) -> str:
    """The name of a writer's index file saved under ``token`` (its header holds it)."""
    return f"{stem}-{token}.bin"


def _named_by(name: str, header: dict) -> bool:
    """Whether the file ``name`` is the one whose ``header`` it holds (file_name). Checked for
    the older levels a header names, whose names and runs alone let another index file's bytes
    copied over one pass for it (a store restored in part from an older copy of its directory)."""
    return not header.get("token") or name.endswith(file_name("", header["token"]))


def load_runs(index: RowIndex, path: Path, header: dict, expect: dict) -> bool:
    """Make the level of the file at ``path`` (``header``: read_file's) and the older ones it
    names (their headers holding ``expect``) ``index``'s: read into memory, merged into main
    (every run checked against its CRCs), where they fit half its limit, else mapped (each
    block checked as it is first read: _map_runs). False, the index left empty, where a file is missing or fails its checks."""
    files = [(path, header)]
    for name, runs in header["levels"]:
        got = read_file(path.parent / name, expect)
        if got is None or got[0]["runs"] != runs or not _named_by(name, got[0]):
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
        levels, room = [], index.hold
        for p, h in files:
            runs = _map_runs(p, h, room, index.num_rows)
            if runs is None:
                return False
            if rowindex.in_memory(runs):
                room -= runs.values.nbytes
            if len(runs):
                levels.append((p.name, runs))
        index.main, index.names, index.levels = Runs(), [name for name, _ in levels], [level for _, level in levels]
    index.recent, index.dead = Runs(), None
    try:
        index.make_current()  # reads every block of the levels over a held one
    except RowIndexDamagedError:  # not the index: its caller replays the segments
        index.main, index.levels, index.names, index.current = Runs(), [], [], None
        return False
    return True
