"""Row codecs: fixed-width binary rows <-> numpy, and row ids <-> LMDB keys.

Keys are big-endian uint64 so LMDB's byte order is numeric order: sorted
batches become sequential B-tree walks and appends.
"""
from __future__ import annotations

import numpy as np


def encode_keys(ids: np.ndarray) -> list[bytes]:
    # a void view turns into bytes objects in C, with no per-key Python code
    return np.ascontiguousarray(ids, dtype=">u8").view("V8").ravel().tolist()


class Float32RowCodec:
    """Rows of ``width`` float32 values stored as raw little-endian bytes."""

    def __init__(self, width: int):
        self.width = width
        self.row_bytes = 4 * width
        self._void = f"V{self.row_bytes}"

    def encode(self, rows: np.ndarray) -> list[bytes]:
        rows = np.ascontiguousarray(rows, dtype="<f4")
        if rows.shape[1:] != (self.width,):
            raise ValueError(f"expected rows of width {self.width}, got shape {rows.shape}")
        return rows.view(self._void).ravel().tolist()

    def decode(self, values: list[bytes], out: np.ndarray) -> np.ndarray:
        """Fill ``out[i]`` from ``values[i]`` where present (b''); returns the found mask."""
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        found = lengths > 0
        bad = found & (lengths != self.row_bytes)
        if bad.any():
            raise ValueError(
                f"stored row has {int(lengths[bad][0])} bytes, expected {self.row_bytes}: "
                "the table's width on disk does not match its spec"
            )
        if found.any():
            data = np.frombuffer(b"".join(values), dtype="<f4").reshape(-1, self.width)
            if found.all():
                out[:] = data
            else:
                out[found] = data
        return found
