"""Row reads that bypass the page cache: O_DIRECT page reads submitted through io_uring.

Why: a row read through LMDB's map costs the kernel a read-ahead into the page cache, a
fault to map the page, and, under a memory limit, the reclaim of another page (unmapped
from the process first): 7-10 us of system CPU a row on our machines. Read with O_DIRECT,
a page goes from the disk into a buffer of ours and nothing is cached, mapped or
reclaimed: 4-6 us, at the same disk rate (13.8k random rows of the 34M-row
`tierstore bench scale` table). io_uring takes a whole batch of reads in one system call, set up
from numpy arrays, so there is no Python call per row.

Coherence: an O_DIRECT read writes out the dirty page-cache pages of its range first, so
it returns what LMDB's writer committed through the page cache; the caller reads inside
an LMDB read transaction, whose pages LMDB does not reuse while it is open.

Where the kernel refuses io_uring (before Linux 5.6, or a seccomp filter, as Docker's
default) or the file system refuses O_DIRECT (tmpfs), :func:`open_reader` returns None
and its reason, and the caller reads through the map.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from .errors import BadRowsError, SystemCallError

PAGE = 4096
DEPTH = 256  # reads in flight a thread, at most
BUFFER = DEPTH * 2 * PAGE  # a thread's buffer: DEPTH reads of rows up to a page (2 pages: a row may cross one)
PACKED_CHUNK = 2048  # rows read_packed reads the pages of at once (2 pages a row at most: 16 MiB; about 1 MiB)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427  # the same on every Linux architecture since 5.1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_OP_READ, _OP_READ_FIXED = 22, 4
_SQE_FIXED_FILE = 1 << 8  # sqe.flags (byte 1 of word 0): fd is an index into the registered files
_REGISTER_BUFFERS, _REGISTER_FILES = 0, 2
# completions run when the thread asks for them (it always waits for its batch), not as
# work that interrupts it; Linux 6.1 on, else the ring is set up without them
_SETUP_SINGLE_ISSUER, _SETUP_DEFER_TASKRUN = 1 << 12, 1 << 13
_ENTER_GETEVENTS = 1
_MAP_POPULATE = 0x8000

# struct io_uring_sqe as 8 little-endian u64 words: opcode, flags, ioprio and fd; off; addr;
# len and rw_flags; user_data; padding. struct io_uring_cqe as 4 i32: user_data (2), res, flags.
_SQE_WORDS, _CQE_WORDS = 8, 4
_W_OP, _W_OFF, _W_ADDR, _W_LEN, _W_DATA = 0, 1, 2, 3, 4


class _Params(ctypes.Structure):
    # struct io_uring_params; sq_off: head, tail, ring_mask, ring_entries, flags, dropped, array, resv1, user_addr
    # (u64); cq_off: head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1, user_addr (u64)
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32), ("features", ctypes.c_uint32),
                ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", ctypes.c_uint32 * 10), ("cq_off", ctypes.c_uint32 * 10)]


class _Ring:
    """One io_uring instance and its read buffer: used by one thread at a time.

    The i-th read of a batch always uses SQE i, which reads into the i-th span of the
    buffer and is tagged i: its file and tag are written once, here, its address when the
    span changes, and a batch writes only its offsets and lengths (two column slices) and
    the SQ ring's indexes.
    The work between system calls holds the GIL the trainer wants: with the entries
    copied as structured arrays a read took 3.7 us of user CPU, 1.7 now."""

    def __init__(self, file_fd: int, depth: int, nbytes: int):
        for flags in (_SETUP_SINGLE_ISSUER | _SETUP_DEFER_TASKRUN, 0):
            p = _Params(flags=flags)
            fd = _libc.syscall(_SYS_SETUP, ctypes.c_uint(depth), ctypes.byref(p))
            if fd >= 0:
                break
            err = ctypes.get_errno()
            if err != errno.EINVAL:
                break
        if fd < 0:
            raise SystemCallError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = fd
        try:
            so, co = p.sq_off, p.cq_off
            prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_POPULATE
            self._maps = [mmap.mmap(fd, so[6] + 4 * p.sq_entries, flags, prot, offset=_OFF_SQ_RING),
                          mmap.mmap(fd, co[5] + 4 * _CQE_WORDS * p.cq_entries, flags, prot, offset=_OFF_CQ_RING),
                          mmap.mmap(fd, 8 * _SQE_WORDS * p.sq_entries, flags, prot, offset=_OFF_SQES)]
        except BaseException:
            os.close(fd)
            raise
        sq, cq, sqes = self._maps
        u32 = lambda m, at, n=1: np.frombuffer(m, dtype="<u4", count=n, offset=at)  # noqa: E731
        self.sq_tail, self.sq_mask = u32(sq, so[1]), int(u32(sq, so[2])[0])
        self.sq_array = u32(sq, so[6], p.sq_entries)
        self.cq_head, self.cq_tail, self.cq_mask = u32(cq, co[0]), u32(cq, co[1]), int(u32(cq, co[2])[0])
        self.cqes = np.frombuffer(cq, dtype="<i4", count=_CQE_WORDS * p.cq_entries, offset=co[5]).reshape(-1, _CQE_WORDS)
        self.sqes = np.frombuffer(sqes, dtype="<u8", count=_SQE_WORDS * p.sq_entries).reshape(-1, _SQE_WORDS)
        self.sqes[:] = 0
        self.depth = min(depth, p.sq_entries)
        self.buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
        self.bytes = np.frombuffer(self.buf, dtype=np.uint8)
        self._span = 0
        self._order = np.arange(p.sq_entries, dtype=np.uint32)
        self.sqes[:, _W_DATA] = self._order
        self.fixed = self._register(file_fd)
        self.sqes[:, _W_OP] = (_OP_READ_FIXED | _SQE_FIXED_FILE) if self.fixed else (_OP_READ | (file_fd << 32))

    def _register(self, file_fd: int) -> bool:
        """Register the buffer and the file with the ring, so that a read neither pins its
        buffer's page nor takes a reference to the file: 6.5 -> 5.2 us of system CPU a
        read of 30k random rows of the `tierstore bench scale` table, with the setup flags above. False
        where the kernel refuses (pinned pages count against RLIMIT_MEMLOCK): the SQEs
        then name the file and the address."""
        iov = (ctypes.c_uint64 * 2)(self.bytes.ctypes.data, len(self.bytes))
        fds = (ctypes.c_int32 * 1)(file_fd)
        for op, arg in ((_REGISTER_BUFFERS, iov), (_REGISTER_FILES, fds)):
            if _libc.syscall(_SYS_REGISTER, ctypes.c_uint(self.fd), ctypes.c_uint(op), ctypes.byref(arg), ctypes.c_uint(1)) < 0:
                return False
        return True

    def read(self, starts: np.ndarray, lengths: np.ndarray, span: int) -> None:
        """Read ``lengths[i]`` bytes at file offset ``starts[i]`` into the buffer at ``i * span``, all at once."""
        n = len(starts)
        if span != self._span:
            self.sqes[:, _W_ADDR] = self.bytes.ctypes.data + self._order.astype(np.uint64) * np.uint64(span)
            self._span = span
        self.sqes[:n, _W_OFF] = starts
        self.sqes[:n, _W_LEN] = lengths
        tail = int(self.sq_tail[0])
        first = min(n, self.sq_mask + 1 - (tail & self.sq_mask))  # SQ ring slots up to its end, then from its start
        self.sq_array[tail & self.sq_mask:][:first] = self._order[:first]
        self.sq_array[: n - first] = self._order[first:n]
        self.sq_tail[0] = (tail + n) & 0xFFFFFFFF  # the io_uring_enter below orders it after the entries
        res = np.empty(n, dtype=np.int64)
        submit, done = n, 0
        while done < n:
            got = _libc.syscall(_SYS_ENTER, ctypes.c_uint(self.fd), ctypes.c_uint(submit), ctypes.c_uint(n - done),
                                ctypes.c_uint(_ENTER_GETEVENTS), ctypes.c_void_p(0), ctypes.c_size_t(0))
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise SystemCallError(err, f"io_uring_enter: {os.strerror(err)}")
            submit -= min(submit, got)
            head, end = int(self.cq_head[0]), int(self.cq_tail[0])
            k = (end - head) & 0xFFFFFFFF
            cqe = self.cqes[(head + np.arange(k)) & self.cq_mask]
            res[cqe[:, 0]] = cqe[:, 2]  # the tag's low word: tags are < 2**32
            self.cq_head[0] = end
            done += k
        bad = res != lengths
        if bad.any():
            i = int(np.argmax(bad))
            if res[i] < 0:
                raise SystemCallError(int(-res[i]), f"reading {int(lengths[i])} bytes at offset {int(starts[i])}: {os.strerror(int(-res[i]))}")
            raise SystemCallError(errno.EIO, f"short read: {int(res[i])} of {int(lengths[i])} bytes at offset {int(starts[i])}")

    def close(self) -> None:
        # the arrays over the maps first: a map with views left cannot close
        self.sq_tail = self.sq_array = self.cq_head = self.cq_tail = self.cqes = self.sqes = self.bytes = None
        for m in (*self._maps, self.buf):
            m.close()
        os.close(self.fd)


class DirectReader:
    """Reads byte ranges of one file with O_DIRECT through a ring of each calling thread."""

    def __init__(self, file: Path, depth: int | None = None, nbytes: int | None = None):
        self.file, self.depth, self.nbytes = Path(file), depth or DEPTH, nbytes or BUFFER
        self._fd = os.open(self.file, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        self._local = threading.local()
        self._rings: list[tuple[threading.Thread, _Ring]] = []  # each thread's; a thread that ended leaves its ring
        self._lock = threading.Lock()

    def _ring(self) -> _Ring:
        ring = getattr(self._local, "ring", None)
        if ring is None or getattr(self._local, "pid", None) != os.getpid():  # a forked child makes its own
            ring = _Ring(self._fd, self.depth, self.nbytes)
            self._local.ring, self._local.pid = ring, os.getpid()
            with self._lock:
                ended = [r for t, r in self._rings if not t.is_alive()]
                self._rings = [(t, r) for t, r in self._rings if t.is_alive()] + [(threading.current_thread(), ring)]
            for r in ended:  # a pool's threads come and go: their rings (and buffers) go with them
                r.close()
        return ring

    def fits(self, width: int) -> bool:
        """Whether rows of ``width`` bytes fit the buffer (one at least)."""
        return _span(width) <= self.nbytes

    def read(self, offsets: np.ndarray, width: int, out: np.ndarray) -> None:
        """Copy ``width`` bytes at each file offset of ``offsets`` into ``out`` [n, width] (uint8)."""
        span = _span(width)
        if span > self.nbytes:
            raise BadRowsError(f"rows of {width} bytes do not fit the direct reader's {self.nbytes}-byte buffer")
        ring = self._ring()
        per = min(ring.depth, self.nbytes // span)
        # every run of ``width`` bytes of the buffer; the i-th read's row is the run at i * span
        # plus its offset in its first page (one index array: a gather from [per, span] rows
        # by two took twice as long)
        runs = windows(ring.bytes[: per * span], width)
        first_byte = np.arange(per, dtype=np.int64) * span
        offsets = np.asarray(offsets, dtype=np.int64)
        for lo in range(0, len(offsets), per):  # a loop per DEPTH rows
            at = offsets[lo: lo + per]
            starts = at & ~np.int64(PAGE - 1)
            lengths = (at + width - starts + PAGE - 1) & ~np.int64(PAGE - 1)
            try:
                ring.read(starts, lengths, span)
            except OSError:
                self._local.ring = None  # reads may still be in flight into its buffer: the next call makes another
                raise
            out[lo: lo + len(at)] = runs[first_byte[: len(at)] + (at - starts)]

    def read_packed(self, offsets: np.ndarray, width: int, out: np.ndarray) -> None:
        """read() for rows of a page at most packed many to a page (a log collection's live
        slots): each page read once, not once a row on it, about PACKED_CHUNK rows' pages at a
        time, chunks cut between rows that share no page."""
        order = np.argsort(offsets, kind="stable")
        at = np.asarray(offsets, dtype=np.int64)[order]
        first, last = at // PAGE, (at + width - 1) // PAGE
        cuts = np.flatnonzero(first[1:] > last[:-1]) + 1
        lo = 0
        while lo < len(at):
            j = int(np.searchsorted(cuts, lo + PACKED_CHUNK))
            hi = int(cuts[j]) if j < len(cuts) else len(at)
            pages = np.unique(np.concatenate([first[lo:hi], last[lo:hi]]))  # a row's second page follows its first
            read = np.empty((len(pages), PAGE), dtype=np.uint8)
            self.read(pages * PAGE, PAGE, read)
            out[order[lo:hi]] = windows(read.reshape(-1), width)[np.searchsorted(pages, first[lo:hi]) * PAGE + at[lo:hi] % PAGE]
            lo = hi

    def close(self) -> None:
        with self._lock:
            rings, self._rings = self._rings, []
        for _, ring in rings:
            ring.close()
        os.close(self._fd)


def windows(data: np.ndarray, width: int) -> np.ndarray:
    """Every run of ``width`` bytes of the flat uint8 array ``data``, by its first byte: a view,
    so that rows at any byte offsets are one fancy-indexed copy."""
    return np.lib.stride_tricks.as_strided(data, shape=(len(data) - width + 1, width), strides=(1, 1), writeable=False)


def _span(width: int) -> int:
    """Bytes to read for a row of ``width`` bytes wherever it starts: the pages it may cross."""
    return -(-(width + PAGE - 1) // PAGE) * PAGE


def open_reader(file: Path) -> tuple[DirectReader | None, str]:
    """A DirectReader of ``file`` after one read through it, or None and why not."""
    try:
        reader = DirectReader(file)
    except OSError as e:
        return None, f"O_DIRECT is refused for {file} ({e.strerror})"
    try:
        probe = np.empty((1, 1), dtype=np.uint8)
        reader.read(np.zeros(1, dtype=np.int64), 1, probe)
    except OSError as e:
        reader.close()
        return None, f"io_uring reads of {file} are refused ({e.strerror})"
    return reader, "io_uring O_DIRECT reads"
