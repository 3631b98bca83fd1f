"""Reading an LMDB file's pages straight from its memory map (the segments of io.rowlog).

py-lmdb touches every page of a value it returns (its "preload", so that a copy made with the
GIL held does not fault), so a get of a 1 MiB segment reads 1 MiB from disk. Walking the
segments' B-tree ourselves (LMDB 0.9's on-disk structures) finds each segment's bytes in the
map without touching them: replaying the index at open reads only the ids, and a row read
only its own page. The pages a read will touch are asked of the kernel all at once
(will_need), then copied in one vectorized gather."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct

import numpy as np

from .direct import windows
from .errors import SegmentFormatError

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

PAGE = 4096
VALUE_OFFSET = 16  # LMDB stores a large value 16 bytes (its page header) into its first page
_DB_RECORD = struct.Struct("<IHHQQQQQ")  # MDB_db: pad, flags, depth, branch, leaf, overflow pages, entries, root
_PAGE_HEAD = struct.Struct("<QHHHH")  # MDB_page: pgno, pad, flags, lower, upper
_NODE = struct.Struct("<HHHH")  # MDB_node: lo, hi, flags, key size; key and data follow
_P_BRANCH, _P_LEAF, _F_BIGDATA = 0x01, 0x02, 0x01
_NO_PAGE = (1 << 64) - 1


def walk_values(mem, db_record, after: int, page_size: int = PAGE, upto: int | None = None) -> list[tuple[int, int, int]]:
    """(seq, file offset, bytes) of every value of a segments database whose 8-byte key is
    above ``after`` (and at most ``upto``), in key order, read from ``mem`` (the map, from the
    file's first byte) and ``db_record`` (the database's MDB_db, its value in LMDB's main database)."""
    root = _DB_RECORD.unpack_from(db_record)[-1]
    out: list[tuple[int, int, int]] = []
    stack = [] if root == _NO_PAGE else [root]
    while stack:
        page = stack.pop() * page_size
        _, _, flags, lower, _ = _PAGE_HEAD.unpack_from(mem, page)
        ptrs = np.frombuffer(mem, dtype="<u2", count=(lower - _PAGE_HEAD.size) // 2, offset=page + _PAGE_HEAD.size).tolist()
        nodes = [(page + p, *_NODE.unpack_from(mem, page + p)) for p in ptrs]
        if flags & _P_BRANCH:
            # child i holds keys from its own key (the first: none) to the next child's
            keys = [int.from_bytes(mem[at + 8: at + 8 + ks], "big") if ks else -1 for at, _, _, _, ks in nodes]
            children = [lo | hi << 16 | fl << 32 for _, lo, hi, fl, _ in nodes]
            stack.extend(c for c, key, nxt in reversed(list(zip(children, keys, keys[1:] + [None])))
                         if (nxt is None or nxt > after + 1) and (upto is None or key <= upto))
        elif flags & _P_LEAF:
            for at, lo, hi, fl, ks in nodes:
                seq = int.from_bytes(mem[at + 8: at + 8 + ks], "big")
                if seq > after and (upto is None or seq <= upto):
                    data = at + 8 + ks
                    start = int(np.frombuffer(mem, dtype="<u8", count=1, offset=data)[0]) * page_size + VALUE_OFFSET \
                        if fl & _F_BIGDATA else data
                    out.append((seq, start, lo | hi << 16))
        else:
            raise SegmentFormatError(f"page {page // PAGE} of a segments database has flags {flags:#x}")
    return out


def map_view(base: int, size: int) -> np.ndarray:
    """The map (``size`` bytes at ``base``) as uint8; read only from pages of a snapshot."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))


def address_of(value) -> int:
    return np.frombuffer(value, dtype=np.uint8).ctypes.data


def map_base(value) -> int:
    """The address at which this process's LMDB map holds the file's first byte, found from
    ``value`` (a buffer into the map) and the mapping that contains it in /proc/self/maps."""
    addr = address_of(value)
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _perms, offset = line.split()[:3]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return lo - int(offset, 16)
    raise RuntimeError("no mapping of the store's file holds a value LMDB returned")


_PROCESS_MADVISE = 440  # the syscall's number, the same on every Linux architecture
_MADV_WILLNEED = 3
_IOV_MAX = 1024
_advice = {"pid": None, "fd": None}


def will_need(base: int, offsets: np.ndarray, width: int | np.ndarray) -> bool:
    """Ask the kernel to start reading every page that the ``width`` bytes (one for all, or
    one each) at each of ``offsets`` (file offsets, in the map at ``base``) span, all at
    once: process_madvise with MADV_WILLNEED, 1,024 ranges a call. A copy that then faults
    the pages one at a time waits on reads already under way in parallel, instead of
    issuing them one by one (53 us each at queue depth 1 on our disks, against 76k reads a
    second at depth 32). False where the kernel or its policy refuses (before Linux 5.10, a
    seccomp filter)."""
    if not len(offsets):
        return True
    pid = os.getpid()
    if _advice["pid"] != pid:  # a forked child has its own pidfd to open
        try:
            _advice["fd"] = os.pidfd_open(pid)
        except (AttributeError, OSError):
            _advice["fd"] = None
        _advice["pid"] = pid
    if _advice["fd"] is None:
        return False
    starts = (offsets + base) & ~np.int64(PAGE - 1)
    iov = np.empty((len(offsets), 2), dtype=np.uint64)
    iov[:, 0] = starts
    iov[:, 1] = (offsets + base + width - starts + PAGE - 1) & ~np.int64(PAGE - 1)
    for lo in range(0, len(iov), _IOV_MAX):
        part = iov[lo: lo + _IOV_MAX]
        args = (_PROCESS_MADVISE, _advice["fd"], part.ctypes.data, len(part), _MADV_WILLNEED, 0)
        if _libc.syscall(*map(ctypes.c_long, args)) < 0:  # c_long: ctypes passes a bare int as a 32-bit one
            _advice["fd"] = None  # refused: plain faults from now on
            return False
    return True


def gather(base: int, size: int, offsets: np.ndarray, width: int, out: np.ndarray) -> None:
    """Copy ``width`` bytes at each file offset of ``offsets`` into ``out`` [n, width]
    (uint8), from the LMDB map at ``base`` of ``size`` bytes: one vectorized copy."""
    if not len(offsets):
        return
    out[:] = windows(map_view(base, size), width)[offsets]  # not np.take: it copies a strided source whole first

