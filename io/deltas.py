"""The delta file: rows changed between two versions of a store's tables, whole or refused.

Written by a serving Publisher (tierstore.serving.stream), one file a version, and by
incremental checkpoints (tierstore.engine.chain), one file a link. Files appear whole:
each is written aside, synced and renamed (``write_whole``)."""
from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .errors import StoreCorruptError

MAGIC = b"TSDELTA1"
_LEN = struct.Struct("<I")


class DeltaCorruptError(StoreCorruptError):
    """A published delta file is damaged or truncated; the replica keeps the version it serves."""


def damaged(path: Path, what: str) -> DeltaCorruptError:
    return DeltaCorruptError(f"delta {path} is damaged: {what}; the replica keeps serving its version. "
                             "Publish again from the training store, or compact() to write a new export")


def write_whole(path: Path, data: bytes) -> None:
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(aside, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(aside, path)
    except BaseException:
        aside.unlink(missing_ok=True)  # a disk that filled up keeps no half-written file
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_delta(version: int, published: float, tables: Mapping[str, tuple[str, np.ndarray, np.ndarray, np.ndarray]]) -> bytes:
    """A delta file: MAGIC, a JSON header's length and the header, each table's ids
    (int64), packed rows and deleted ids (int64), then the CRC-32 of all before it.
    ``tables[name]`` is (dtype, sorted ids, packed rows, sorted deleted ids)."""
    header = {"version": version, "time": published,
              "tables": [{"name": n, "dtype": dt, "rows": len(ids), "row_bytes": rows.shape[1], "deleted": len(gone)}
                         for n, (dt, ids, rows, gone) in tables.items()]}
    head = json.dumps(header).encode()
    body = [MAGIC, _LEN.pack(len(head)), head]
    for _, ids, rows, gone in tables.values():
        body += [np.ascontiguousarray(ids, dtype="<i8").tobytes(), np.ascontiguousarray(rows, dtype=np.uint8).tobytes(),
                 np.ascontiguousarray(gone, dtype="<i8").tobytes()]
    data = b"".join(body)
    return data + _LEN.pack(zlib.crc32(data))


def decode_delta(path: Path) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """(header, {table: (ids, packed rows, deleted ids)}) of a delta file; DeltaCorruptError if it is not whole."""
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 2 * _LEN.size or not data.startswith(MAGIC):
        raise damaged(path, "it does not start with a delta's header (truncated or not a delta)")
    if zlib.crc32(data[:-_LEN.size]) != _LEN.unpack_from(data, len(data) - _LEN.size)[0]:
        raise damaged(path, f"its checksum does not match its {len(data)} bytes (truncated or overwritten)")
    at = len(MAGIC) + _LEN.size
    n = _LEN.unpack_from(data, len(MAGIC))[0]
    try:
        header = json.loads(data[at: at + n])
        at += n
        if type(header["version"]) is not int:
            raise TypeError(f"its version is {header['version']!r}, not an integer")
        rows = {}
        for t in header["tables"]:
            count, width, deleted = int(t["rows"]), int(t["row_bytes"]), int(t.get("deleted", 0))
            if min(count, width, deleted) < 0 or t["name"] in rows:
                raise ValueError(f"table {t['name']!r} is listed twice or has a negative count")
            ids = np.frombuffer(data, dtype="<i8", count=count, offset=at).astype(np.int64)
            at += 8 * count
            packed = np.frombuffer(data, dtype=np.uint8, count=count * width, offset=at).reshape(count, width)
            at += count * width
            gone = np.frombuffer(data, dtype="<i8", count=deleted, offset=at).astype(np.int64)
            at += 8 * deleted
            rows[t["name"]] = (ids, packed.copy(), gone)  # writable: tiers take the rows as tensors
    except (ValueError, KeyError, TypeError) as e:
        raise damaged(path, f"its contents do not parse ({type(e).__name__}: {e})") from None
    if at != len(data) - _LEN.size:
        raise damaged(path, f"its tables take {at} bytes of {len(data) - _LEN.size}")
    return header, rows
