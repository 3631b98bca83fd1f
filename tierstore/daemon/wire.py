"""The prefetch daemon's wire format, shared by ``tierstore prefetchd`` and its clients.

A frame is a fixed 36-byte little-endian header followed by three sections:

==========  ==========================  =============================================
section     bytes                       meaning
==========  ==========================  =============================================
text        ``text_len``                UTF-8: a table name, an error message, or
                                        JSON for HELLO / STATS (parsed with json,
                                        never eval'd or unpickled)
ids         ``8 * n_ids``               int64 row ids, raw little-endian
rows        ``4 * n_rows * n_cols``     float32 rows, raw little-endian, C order
==========  ==========================  =============================================

Header (``<4sHBBB3xIQQI``): magic ``b"TSD\\x00"``, protocol version, frame
type, status (0 = OK; a reply's error code), flags (:data:`WITH_STATE`,
:data:`IN_SHM`), text_len, n_ids, n_rows, n_cols. Every length is checked
against :class:`Limits` before anything is allocated, so a hostile or broken
peer cannot make the other side allocate more than the limits allow. A reply
has the request's type; a status other than OK carries the error message as
its text and names the exception to raise.

Shared memory (version 2). In the handshake a client may ask for a segment
(``"shm_bytes"`` in its HELLO). The daemon creates it (an anonymous memfd, so
no name exists that another process could open), says its size and the
threshold in its HELLO reply, then passes the file descriptor over the socket
(SCM_RIGHTS, attached to one byte ``b"S"`` that follows the reply frame). The
daemon never maps a file a client names. From then on a frame whose ids+rows
exceed the threshold and fit the segment has :data:`IN_SHM` set: right after
the header come two little-endian u64 offsets (ids, rows) into the segment,
then the text; the arrays themselves are in the segment, not in the stream.
The receiver checks the offsets against the segment's size, alignment and
each other before touching it, and copies ids out before using them, so a
peer rewriting the segment mid-request cannot slip an unchecked id past it.
One request is in flight per connection, so client and daemon take turns
with the segment and need no lock on it.

Tables with admission and TTL (version 3). A trainer's backward asks the
daemon's store, not its own: ADMITTED (ids: sorted unique ids; reply ids: 1
where an update is kept, else 0), REREAD (the rows with state of sorted unique
ids as they are now, not counted as a step; reply rows like READ's) and EVICT
(ids to delete everywhere; the sender must claim them; reply ids: one count,
the rows LMDB held).
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierstore.errors import (ArgumentTypeError, BadIdsError, BadValuesError, FormatError, IdRangeError, PathExistsError,
                              PathNotFoundError, SettingError, StateError, StoreClosedError, TierstoreError, UnknownTableError,
                              UnsupportedError, WriteRefusedError)
from tierstore.validate import check_int

MAGIC = b"TSD\x00"
VERSION = 3
HEADER = struct.Struct("<4sHBBB3xIQQI")
SHM_REF = struct.Struct("<QQ")  # ids offset, rows offset: follows the header when flags & IN_SHM

# frame types; ERROR is the reply to a frame whose own type could not be trusted
ERROR, HELLO, READ, WRITE, PREFETCH, FLUSH, STEP, STATS, ADMITTED, REREAD, EVICT = range(11)
TYPE_NAMES = {ERROR: "ERROR", HELLO: "HELLO", READ: "READ", WRITE: "WRITE", PREFETCH: "PREFETCH", FLUSH: "FLUSH", STEP: "STEP",
              STATS: "STATS", ADMITTED: "ADMITTED", REREAD: "REREAD", EVICT: "EVICT"}

# flag bits
WITH_STATE = 1  # READ/WRITE rows carry the per-row state after the weights
IN_SHM = 2  # the arrays are in the shared-memory segment (offsets follow the header)
_KNOWN_FLAGS = WITH_STATE | IN_SHM

SHM_ALIGN = 64  # array offsets in the segment are cache-line aligned
SHM_FD_BYTE = b"S"  # the byte the segment's descriptor rides on after the HELLO reply


class DaemonConnectionError(ConnectionError, TierstoreError):
    """No daemon answers at the socket, or the daemon or the peer closed the connection."""


class DaemonBusyError(DaemonConnectionError):
    """The daemon cannot take this client now: it serves its maximum of clients
    (``--max-clients``), or its listen queue stayed full while the client retried."""


class ProtocolError(ValueError, TierstoreError):
    """A frame that breaks the format: bad magic, version, type, lengths or offsets."""


# reply statuses: 0 is OK; the others name the exception the client raises: the daemon's
# own error class where it has a status (a client sees the UnknownTableError an embedded
# store raises), else the nearest builtin base (an error of LMDB's or torch's).
# A ConnectionError status means the daemon closed the connection after the reply.
OK = 0
ERRORS: dict[int, type[Exception]] = {
    1: KeyError, 2: IndexError, 3: ValueError, 4: PermissionError, 5: RuntimeError, 6: TypeError, 7: OSError,
    8: ConnectionError, 9: DaemonBusyError,
    10: UnknownTableError, 11: IdRangeError, 12: BadIdsError, 13: BadValuesError, 14: SettingError, 15: ArgumentTypeError,
    16: WriteRefusedError, 17: StateError, 18: StoreClosedError, 19: UnsupportedError, 20: FormatError, 21: ProtocolError,
    22: DaemonConnectionError, 23: PathExistsError, 24: PathNotFoundError,
}
STATUS_OF = {cls: code for code, cls in ERRORS.items()}


@dataclass(frozen=True)
class Limits:
    """Largest frame sections either side accepts; checked before allocating."""

    max_text: int = 1 << 20
    max_ids: int = 1 << 24
    max_cols: int = 1 << 16
    max_bytes: int = 1 << 31  # ids + rows payload of one frame

    def __post_init__(self):
        for name in ("max_text", "max_ids", "max_cols", "max_bytes"):
            check_int(getattr(self, name), f"Limits.{name}", at_least=1)


@dataclass
class Frame:
    type: int
    status: int = 0
    text: str = ""
    ids: np.ndarray | None = None  # int64 [n]
    rows: np.ndarray | None = None  # float32 [n, cols]; a view into the segment when it came through it
    flags: int = 0

    def json(self):
        return json.loads(self.text) if self.text else None


def align(n: int) -> int:
    return -(-n // SHM_ALIGN) * SHM_ALIGN


class Segment:
    """A shared-memory segment mapped read-write: an fd from memfd_create."""

    def __init__(self, fd: int, size: int):
        actual = os.fstat(fd).st_size
        if actual < size:
            os.close(fd)
            raise ProtocolError(f"shared-memory segment is {actual} bytes, the handshake said {size}")
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = np.frombuffer(self.map, dtype=np.uint8)
        self._base = self.buf.ctypes.data

    @classmethod
    def create(cls, size: int) -> "Segment":
        if not hasattr(os, "memfd_create"):
            raise OSError("shared memory needs memfd_create (Linux); frames go through the socket instead")
        fd = os.memfd_create("tierstore-prefetchd", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            raise
        return cls(fd, size)

    def array(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        return self.buf[offset: offset + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    def offset_of(self, arr: np.ndarray) -> int | None:
        """Offset of a C-contiguous array that lies inside the segment, else None."""
        if arr.size == 0 or not arr.flags.c_contiguous:
            return None
        off = arr.ctypes.data - self._base
        return off if 0 <= off and off + arr.nbytes <= self.size else None

    def close(self) -> None:
        self.buf = None
        try:
            self.map.close()
        except BufferError:  # a caller still holds a view; the mapping goes when it does
            pass
        os.close(self.fd)


# -- write claims ------------------------------------------------------------------------
WHOLE = 1 << 63  # ``hi`` of a whole-table claim: every id is below it


def parse_claims(claims) -> list[tuple[str, int, int]]:
    """Normalize ``claim=``: each item a table name (the whole table) or a
    ``(table, lo, hi)`` half-open row range; returns sorted (table, lo, hi).
    A client's own claims may not overlap each other."""
    if isinstance(claims, str):
        claims = [claims]
    if not isinstance(claims, (list, tuple)):
        raise ArgumentTypeError(f"claim must be a list of table names or (table, lo, hi) ranges, got {claims!r}")
    out = []
    for c in claims:
        if isinstance(c, str):
            out.append((c, 0, WHOLE))
            continue
        if (isinstance(c, (list, tuple)) and len(c) == 3 and isinstance(c[0], str)
                and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in c[1:])):
            table, lo, hi = c[0], int(c[1]), int(c[2])
            if 0 <= lo < hi <= WHOLE:
                out.append((table, lo, hi))
                continue
            raise SettingError(f"claim {tuple(c)!r}: a row range (table, lo, hi) is half-open with 0 <= lo < hi")
        raise ArgumentTypeError(f"claim items are table names or (table, lo, hi) row ranges, got {c!r}")
    out.sort()
    for a, b in zip(out, out[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise SettingError(f"claims {describe_claim(a)} and {describe_claim(b)} overlap; claim each row once")
    return out


def describe_claim(c: tuple[str, int, int]) -> str:
    table, lo, hi = c
    return f"table {table!r}" if (lo, hi) == (0, WHOLE) else f"rows [{lo}, {hi}) of table {table!r}"


def range_array(pairs) -> np.ndarray:
    """(lo, hi) pairs as an (n, 2) uint64 array (``hi`` may be WHOLE, past int64)."""
    return np.asarray(pairs, dtype=np.uint64).reshape(-1, 2)


def claimed(ranges, ids: np.ndarray) -> np.ndarray:
    """Mask of the ids inside one of ``ranges`` (sorted, disjoint (lo, hi) pairs, or
    their range_array): one binary search per id, no Python loop over ids or ranges."""
    r = range_array(ranges)
    if not len(r):
        return np.zeros(len(ids), dtype=bool)
    if len(r) == 1 and (int(r[0, 0]), int(r[0, 1])) == (0, WHOLE):
        return np.ones(len(ids), dtype=bool)
    u = ids.astype(np.uint64)
    at = np.searchsorted(r[:, 0], u, side="right") - 1
    return (at >= 0) & (u < r[np.maximum(at, 0), 1])


def describe_ranges(table: str, ranges, limit: int = 8) -> str:
    """Claims of one table for a message: the first ``limit``, then how many more."""
    r = range_array(ranges)
    shown = ", ".join(describe_claim((table, int(lo), int(hi))) for lo, hi in r[:limit]) or "none"
    return shown + (f" and {len(r) - limit} more" if len(r) > limit else "")


def unclaimed(who: str, table: str, ranges, row: int, holder: str = "") -> PermissionError:
    """The error for a write of ``row`` outside ``who``'s claims on ``table``
    (``holder``: who claims it, if anyone), with the fix."""
    held = f"; it is claimed by {holder}" if holder else ""
    return WriteRefusedError(f"{who} has no write claim on row {row} of table {table!r}{held} (its claims on "
                           f"{table!r}: {describe_ranges(table, ranges)}); attach with claim=[{table!r}] or a (table, lo, hi) range covering it")


def error_status(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return STATUS_OF[RuntimeError]


def error_message(exc: BaseException) -> str:
    # KeyError's str() adds quotes around its argument
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def _place(seg: Segment, arr: np.ndarray, offset: int, dtype: str) -> int:
    """Offset of arr in the segment: where it already is (the daemon gathers READ
    rows straight into the segment), else copied to ``offset``."""
    at = seg.offset_of(arr) if arr.dtype == np.dtype(dtype) else None
    if at is not None:
        return at
    np.copyto(seg.array(offset, dtype, arr.shape), arr, casting="same_kind")
    return offset


def send_frame(sock: socket.socket, frame: Frame, shm: Segment | None = None, threshold: int = 1 << 16) -> None:
    text = frame.text.encode("utf-8")
    ids, rows = frame.ids, frame.rows
    n_ids = 0 if ids is None else len(ids)
    n_rows, n_cols = (0, 0) if rows is None else rows.shape
    id_bytes, row_bytes = 8 * n_ids, 4 * n_rows * n_cols
    flags = frame.flags & ~IN_SHM
    ref = b""
    if shm is not None and id_bytes + row_bytes > threshold and align(id_bytes) + row_bytes <= shm.size:
        ids_off = _place(shm, ids, 0, "<i8") if n_ids else 0
        rows_off = _place(shm, rows, align(id_bytes), "<f4") if n_rows else 0
        if n_ids and n_rows and ids_off < rows_off + row_bytes and rows_off < ids_off + id_bytes:
            rows_off = _place(shm, np.array(rows), align(ids_off + id_bytes), "<f4")  # never overlapping
        flags |= IN_SHM
        ref = SHM_REF.pack(ids_off, rows_off)
        ids = rows = None
    header = HEADER.pack(MAGIC, VERSION, frame.type, frame.status, flags, len(text), n_ids, n_rows, n_cols)
    # small sections go in one send; the big arrays go straight from their buffers
    head = header + ref + text
    if ids is not None and ids.nbytes <= 65536:
        head += np.ascontiguousarray(ids, dtype="<i8").tobytes()
        ids = None
    sock.sendall(head)
    if ids is not None and n_ids:
        sock.sendall(memoryview(np.ascontiguousarray(ids, dtype="<i8")).cast("B"))
    if rows is not None and rows.size:
        sock.sendall(memoryview(np.ascontiguousarray(rows, dtype="<f4")).cast("B"))


def recv_exact(sock: socket.socket, buf, deadline: float | None = None) -> None:
    """Fill ``buf`` from the socket; by ``deadline`` (time.monotonic()) if given,
    else raises ProtocolError: a peer that sends part of a frame and stalls."""
    view = memoryview(buf).cast("B")
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(f"the peer sent {got} of {n} bytes of a frame section, then nothing until the frame timeout")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            if deadline is None:
                raise
            continue  # the deadline check above says what happened
        if k == 0:
            raise DaemonConnectionError("the peer closed the connection in the middle of a frame")
        got += k


def _check_shm_ref(shm: Segment | None, ids_off: int, n_ids: int, rows_off: int, row_bytes: int) -> None:
    if shm is None:
        raise ProtocolError("frame points into shared memory, but none was set up in the handshake")
    spans = []
    for what, off, nbytes, unit in (("ids", ids_off, 8 * n_ids, 8), ("rows", rows_off, row_bytes, 4)):
        if not nbytes:
            continue
        if off % unit:
            raise ProtocolError(f"shared-memory {what} offset {off} is not a multiple of {unit}")
        if off + nbytes > shm.size:
            raise ProtocolError(f"shared-memory {what} at offset {off} of {nbytes} bytes run past the "
                                f"{shm.size}-byte segment")
        spans.append((off, off + nbytes))
    if len(spans) == 2 and spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]:
        raise ProtocolError(f"shared-memory ids {spans[0]} and rows {spans[1]} overlap")


def recv_frame(sock: socket.socket, limits: Limits, rows_out: np.ndarray | None = None, shm: Segment | None = None,
               frame_timeout: float | None = None, admit: Callable[[int, int, int], None] | None = None) -> Frame | None:
    """Read one frame; None if the peer closed cleanly between frames.

    The daemon's guards (the client passes neither): ``frame_timeout`` seconds
    for a begun frame to arrive whole (else ProtocolError; the wait for a frame
    to begin is the socket's own timeout), and ``admit(type, n_ids, nbytes)``
    with the frame's text + ids + rows bytes, called once the header passed the
    limits and before anything is allocated for them.

    Raises ProtocolError on a frame that breaks the format or the limits (the
    caller replies with an error and closes the connection: the stream can no
    longer be trusted to be in step). ``rows_out`` (float32, C-contiguous) is
    used for the rows section of a socket frame when its shape matches, saving
    an allocation. Rows that came through ``shm`` are a view into it, valid
    until the next frame on this connection; ids are always a private copy.
    """
    header = bytearray(HEADER.size)
    view = memoryview(header)
    k = sock.recv_into(view, HEADER.size)
    if k == 0:
        return None
    deadline = time.monotonic() + frame_timeout if frame_timeout is not None else None
    recv_exact(sock, view[k:], deadline)
    magic, version, ftype, status, flags, text_len, n_ids, n_rows, n_cols = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not a tierstore daemon frame")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION}); use the same tierstore version on both sides")
    if ftype not in TYPE_NAMES:
        raise ProtocolError(f"unknown frame type {ftype}")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if text_len > limits.max_text:
        raise ProtocolError(f"frame text of {text_len} bytes exceeds the limit of {limits.max_text}")
    if n_ids > limits.max_ids or n_rows > limits.max_ids:
        raise ProtocolError(f"frame of {max(n_ids, n_rows)} ids/rows exceeds the limit of {limits.max_ids} per call; split the call")
    if n_cols > limits.max_cols:
        raise ProtocolError(f"frame rows of {n_cols} columns exceed the limit of {limits.max_cols}")
    if n_rows and not n_cols:
        raise ProtocolError(f"frame has {n_rows} rows of 0 columns")
    payload = 8 * n_ids + 4 * n_rows * n_cols
    if payload > limits.max_bytes:
        raise ProtocolError(f"frame payload of {payload} bytes exceeds the limit of {limits.max_bytes}; split the call")
    if admit is not None:
        admit(ftype, n_ids, text_len + payload)
        if deadline is not None:  # time spent waiting for admission is the daemon's, not the peer's
            deadline = time.monotonic() + frame_timeout
    ids_off = rows_off = 0
    if flags & IN_SHM:
        ref = bytearray(SHM_REF.size)
        recv_exact(sock, ref, deadline)
        ids_off, rows_off = SHM_REF.unpack(ref)
        _check_shm_ref(shm, ids_off, n_ids, rows_off, 4 * n_rows * n_cols)
    text = ""
    if text_len:
        raw = bytearray(text_len)
        recv_exact(sock, raw, deadline)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"frame text is not UTF-8: {e}") from None
    ids = None
    if n_ids:
        if flags & IN_SHM:
            ids = shm.array(ids_off, "<i8", (n_ids,)).copy()
        else:
            ids = np.empty(n_ids, dtype="<i8")
            recv_exact(sock, ids, deadline)
    rows = None
    if n_rows:
        if flags & IN_SHM:
            rows = shm.array(rows_off, "<f4", (n_rows, n_cols))
        else:
            if rows_out is not None and rows_out.shape == (n_rows, n_cols) and rows_out.flags.c_contiguous and rows_out.dtype == np.float32:
                rows = rows_out
            else:
                rows = np.empty((n_rows, n_cols), dtype="<f4")
            recv_exact(sock, rows, deadline)
    return Frame(ftype, status, text, ids, rows, flags)


def send_segment(sock: socket.socket, shm: Segment) -> None:
    """Pass the segment's descriptor to the peer (after the HELLO reply)."""
    socket.send_fds(sock, [SHM_FD_BYTE], [shm.fd])


def recv_segment(sock: socket.socket, size: int) -> Segment:
    """Receive and map the segment the HELLO reply announced."""
    msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if msg != SHM_FD_BYTE or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"expected the shared-memory descriptor after HELLO, got {msg!r} with {len(fds)} descriptors")
    return Segment(fds[0], size)


def raise_for(frame: Frame) -> None:
    """Raise the exception a reply names, with the daemon's message."""
    if frame.status != OK:
        raise ERRORS.get(frame.status, RuntimeError)(frame.text or "the daemon reported an error without a message")
