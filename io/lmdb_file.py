"""data.mdb's checks before LMDB maps it, the error naming a damaged file (corrupt), and
the free-space test that tells a full disk from another failed write."""
from __future__ import annotations

import errno
import mmap
import os
import shutil
import struct
from pathlib import Path

import lmdb
import numpy as np

from tierstore.io import lmdb_map, rowlog
from tierstore.io.errors import DiskFullError, StoreCorruptError


def corrupt(path: Path, what: str) -> StoreCorruptError:
    return StoreCorruptError(
        f"{path} is damaged: {what}. Restore the store from a checkpoint or another copy "
        "(a checkpoint directory opens as a store), or move the directory aside to start afresh"
    )


# LMDB 0.9's file layout (lmdb.h / mdb.c): pages 0 and 1 are meta pages, each a
# 16-byte page header (pgno, pad, flags, ...) then MDB_meta: magic, version,
# address, map size, the free and main databases (MDB_db: pad, flags, depth,
# branch, leaf and overflow page counts, entries, root; the free database's pad
# is the page size), last page number, transaction id.
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_P_META = 0x08
_P_INVALID = (1 << 64) - 1
_PAGE_HEADER = struct.Struct("=QHHI")  # pgno, pad, flags, lower and upper bounds
_DB = "IHHQQQQQ"  # MDB_db: pad, flags, depth, branch, leaf, overflow pages, entries, root
_META = struct.Struct("=IIQQ" + _DB * 2 + "QQ")
_FREE_DB = slice(_PAGE_HEADER.size + struct.calcsize("=IIQQ"), _PAGE_HEADER.size + struct.calcsize("=IIQQ" + _DB))  # in a meta page


def check_data_file(data: Path, tries: int = 3) -> None:
    """Raise StoreCorruptError unless ``data`` (a data.mdb) has LMDB's two meta
    pages and holds every page the newer one names. LMDB maps the file and trusts
    it: touching a page past the end of a truncated file kills the process with
    SIGBUS, which no exception handler can catch, so this runs before lmdb.open.
    Every size is the open file's: compact() may rename another file over ``data``
    meanwhile, and the old file's pages against the new one's size looked truncated.
    A file that looks cut short is read ``tries`` times: a running writer may reuse the
    free-list pages _free_past_end reads (this is no LMDB reader) between two reads."""
    for _ in range(tries):
        cut_short = _check_data_file(data)
        if cut_short is None:
            return
    raise corrupt(data, cut_short)


def _check_data_file(data: Path) -> str | None:
    """check_data_file's one read: raises for damage, or returns what is missing where
    pages the meta page names are past the file's end and not all free."""
    metas = []
    with open(data, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise corrupt(data, "it is empty (0 bytes), so every row it held is gone")
        psize = 0
        for i in range(2):
            f.seek(i * psize)
            page = f.read(_PAGE_HEADER.size + _META.size)
            if len(page) < _PAGE_HEADER.size + _META.size:
                raise corrupt(data, f"it is truncated ({os.fstat(f.fileno()).st_size} bytes, too short for LMDB's meta page {i})")
            flags = _PAGE_HEADER.unpack_from(page)[2]
            m = _META.unpack_from(page, _PAGE_HEADER.size)
            if m[0] != _MAGIC or not flags & _P_META:
                raise corrupt(data, f"meta page {i} is not LMDB's (overwritten, or not an LMDB file)")
            if m[1] != _DATA_VERSION:
                raise corrupt(data, f"meta page {i} has LMDB data version {m[1]}; this LMDB reads version {_DATA_VERSION}")
            if i == 0:
                psize = m[4]
                if psize & (psize - 1) or not 512 <= psize <= 65536:
                    raise corrupt(data, f"meta page 0 names page size {psize}")
            metas.append((m, page[_FREE_DB]))
        # the size after the meta pages were read: a running writer writes a transaction's pages, then
        # the meta page naming them, so the file holds what a meta page names by the time it is read
        size = os.fstat(f.fileno()).st_size
        meta, free_db = metas[metas[0][0][-1] < metas[1][0][-1]]  # LMDB uses the meta page of the newer transaction
        map_size, last_pg = meta[3], meta[-2]
        need = (last_pg + 1) * psize
        if size < need and not _free_past_end(f, psize, free_db, size // psize, last_pg):
            return f"it is truncated ({size} bytes; its last transaction wrote {need})"
    if map_size < need:
        raise corrupt(data, f"its meta page names a map of {map_size} bytes, smaller than its {need} bytes of pages")
    for root in (meta[11], meta[19]):  # the free and main databases' root pages
        if root != _P_INVALID and not 2 <= root <= last_pg:
            raise corrupt(data, f"its meta page names root page {root}, outside its pages 2..{last_pg}")


def _free_past_end(f, psize: int, free_db: bytes, first: int, last: int) -> bool:
    """Whether pages ``first``..``last``, past the end of the file ``f``, are all on LMDB's
    free list. LMDB does not write pages it took and gave back within one commit (as
    its free list's own record, rewritten until it stops changing), so a whole file may
    end before the last page its meta page names; LMDB's own copy stops at the file's
    end. A file cut short loses pages still in use, which this tells apart."""
    try:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mem:
            free = []
            # the free database's keys are transaction ids, never 0: every record is "above -1"
            for _, at, nbytes in lmdb_map.walk_values(mem, free_db, -1, psize):
                ids = np.frombuffer(mem[at: at + nbytes], dtype="=u8")  # a copy: the map closes after
                if len(ids) == 0 or ids[0] != len(ids) - 1:
                    return False
                free.append(ids[1:])
    except (ValueError, IndexError, struct.error, rowlog.SegmentFormatError):  # its own pages cut off, or not a free list
        return False
    free = np.concatenate(free) if free else np.zeros(0, dtype=np.uint64)
    if last - first + 1 > len(free):  # more pages missing than the list holds (a scribbled meta page too)
        return False
    return bool(np.isin(np.arange(first, last + 1, dtype=np.uint64), free).all())


# LMDB errors that mean the file's pages are not what LMDB wrote
_CORRUPT = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError)
_LOW_SPACE = 64 << 20  # free bytes below which a failed write is reported as a full disk


def _free_bytes(path: Path) -> int:
    """Free bytes on the disk ``path`` is (or will be, once its directory is made) on."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_full(path: Path, what: str, cause: BaseException, fix: str = "free disk space") -> DiskFullError:
    """The store's error for a write that found the disk under ``path`` full: ``what`` could
    not be written (``cause``), the free bytes, and ``fix``."""
    return DiskFullError(errno.ENOSPC, f"disk full: {what} ({cause}; {_free_bytes(path)} bytes free); {fix}", str(path))
