"""Small file-system steps the io modules share."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from .errors import SystemCallError

_libc = ctypes.CDLL(None, use_errno=True)
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE")


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by its path (a directory: so that a rename in it survives a power loss)."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mapped_file_bytes() -> int:
    """Bytes of file pages (and shared memory) mapped into this process now: its RssFile and
    RssShmem together, the "shared" field of /proc/self/statm (read in a few microseconds)."""
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        return int(os.read(fd, 256).split()[2]) * _PAGE
    finally:
        os.close(fd)


def unmap_pages(address: int, length: int) -> None:
    """Drop this process's page-table entries of ``length`` bytes of a file mapping at
    ``address`` (madvise MADV_DONTNEED): the pages leave its RSS but stay in the page cache,
    and the next access maps them again. Never for private or anonymous memory, whose
    contents it would discard."""
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise SystemCallError(err, f"madvise(MADV_DONTNEED) of {length} bytes at {address:#x}: {os.strerror(err)}")
