"""The prefetch daemon's wire format, shared by ``tierstore prefetchd`` and its clients.

A frame is a fixed 32-byte little-endian header followed by three sections:

==========  ==========================  =============================================
section     bytes                       meaning
==========  ==========================  =============================================
text        ``text_len``                UTF-8: a table name, an error message, or
                                        JSON for HELLO / STATS (parsed with json,
                                        never eval'd or unpickled)
ids         ``8 * n_ids``               int64 row ids, raw little-endian
rows        ``4 * n_rows * n_cols``     float32 rows, raw little-endian, C order
==========  ==========================  =============================================

Header (``<4sHBBIQQI``): magic ``b"TSD\\x00"``, protocol version, frame type,
status (0 = OK in replies; in requests, flag bits), text_len, n_ids, n_rows,
n_cols. Every length is checked against :class:`Limits` before anything is
allocated, so a hostile or broken peer cannot make the other side allocate
more than the limits allow. A reply has the request's type; a status other than
OK carries the error message as its text and names the exception to raise.
"""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"TSD\x00"
VERSION = 1
HEADER = struct.Struct("<4sHBBIQQI")

# frame types; ERROR is the reply to a frame whose own type could not be trusted
ERROR, HELLO, READ, WRITE, PREFETCH, FLUSH, STEP, STATS = range(8)
TYPE_NAMES = {ERROR: "ERROR", HELLO: "HELLO", READ: "READ", WRITE: "WRITE", PREFETCH: "PREFETCH", FLUSH: "FLUSH", STEP: "STEP", STATS: "STATS"}

# request flag bits (the status byte of a request)
WITH_STATE = 1

# reply statuses: 0 is OK; the others name the exception the client raises
OK = 0
ERRORS: dict[int, type[Exception]] = {
    1: KeyError, 2: IndexError, 3: ValueError, 4: PermissionError, 5: RuntimeError, 6: TypeError, 7: OSError,
}
STATUS_OF = {cls: code for code, cls in ERRORS.items()}


class ProtocolError(ValueError):
    """A frame that breaks the format: bad magic, version, type or lengths."""


@dataclass(frozen=True)
class Limits:
    """Largest frame sections either side accepts; checked before allocating."""

    max_text: int = 1 << 20
    max_ids: int = 1 << 24
    max_cols: int = 1 << 16
    max_bytes: int = 1 << 31  # ids + rows payload of one frame

    def __post_init__(self):
        for name in ("max_text", "max_ids", "max_cols", "max_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Limits.{name} must be an int >= 1, got {v!r}")


@dataclass
class Frame:
    type: int
    status: int = 0
    text: str = ""
    ids: np.ndarray | None = None  # int64 [n]
    rows: np.ndarray | None = None  # float32 [n, cols]

    def json(self):
        return json.loads(self.text) if self.text else None


def error_status(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return STATUS_OF[RuntimeError]


def error_message(exc: BaseException) -> str:
    # KeyError's str() adds quotes around its argument
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def send_frame(sock: socket.socket, frame: Frame) -> None:
    text = frame.text.encode("utf-8")
    ids = frame.ids
    rows = frame.rows
    n_ids = 0 if ids is None else len(ids)
    n_rows, n_cols = (0, 0) if rows is None else rows.shape
    header = HEADER.pack(MAGIC, VERSION, frame.type, frame.status, len(text), n_ids, n_rows, n_cols)
    # small sections go in one send; the big arrays go straight from their buffers
    head = header + text
    if ids is not None and ids.nbytes <= 65536:
        head += np.ascontiguousarray(ids, dtype="<i8").tobytes()
        ids = None
    sock.sendall(head)
    if ids is not None and n_ids:
        sock.sendall(memoryview(np.ascontiguousarray(ids, dtype="<i8")).cast("B"))
    if rows is not None and rows.size:
        sock.sendall(memoryview(np.ascontiguousarray(rows, dtype="<f4")).cast("B"))


def recv_exact(sock: socket.socket, buf) -> None:
    view = memoryview(buf).cast("B")
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection in the middle of a frame")
        got += k


def recv_frame(sock: socket.socket, limits: Limits, rows_out: np.ndarray | None = None) -> Frame | None:
    """Read one frame; None if the peer closed cleanly between frames.

    Raises ProtocolError on a frame that breaks the format or the limits (the
    caller replies with an error and closes the connection: the stream can no
    longer be trusted to be in step). ``rows_out`` (float32, C-contiguous) is
    used for the rows section when its shape matches, saving an allocation.
    """
    header = bytearray(HEADER.size)
    view = memoryview(header)
    got = 0
    while got < HEADER.size:
        k = sock.recv_into(view[got:], HEADER.size - got)
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError("the peer closed the connection in the middle of a frame header")
        got += k
    magic, version, ftype, status, text_len, n_ids, n_rows, n_cols = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not a tierstore daemon frame")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION}); use the same tierstore version on both sides")
    if ftype not in TYPE_NAMES:
        raise ProtocolError(f"unknown frame type {ftype}")
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
    text = ""
    if text_len:
        raw = bytearray(text_len)
        recv_exact(sock, raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"frame text is not UTF-8: {e}") from None
    ids = None
    if n_ids:
        ids = np.empty(n_ids, dtype="<i8")
        recv_exact(sock, ids)
    rows = None
    if n_rows:
        if rows_out is not None and rows_out.shape == (n_rows, n_cols) and rows_out.flags.c_contiguous and rows_out.dtype == np.float32:
            rows = rows_out
        else:
            rows = np.empty((n_rows, n_cols), dtype="<f4")
        recv_exact(sock, rows)
    return Frame(ftype, status, text, ids, rows)


def raise_for(frame: Frame) -> None:
    """Raise the exception a reply names, with the daemon's message."""
    if frame.status != OK:
        raise ERRORS.get(frame.status, RuntimeError)(frame.text or "the daemon reported an error without a message")
