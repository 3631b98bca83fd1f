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

    def decode(self, values: list, out: np.ndarray) -> np.ndarray:
        """Copy ``values[i]`` (bytes, or None where the row is absent) into
        ``out[i]`` (C-contiguous); returns the mask of rows found. Absent rows
        are left unset."""
        try:
            buf = b"".join(values)
            found = None
        except TypeError:  # some rows absent (None)
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            found = arr != None  # noqa: E711 (elementwise, in C)
            buf = b"".join(arr[found].tolist())
        n_present = len(values) if found is None else int(found.sum())
        if len(buf) != n_present * self.row_bytes:
            raise ValueError(
                f"stored rows are not {self.row_bytes} bytes each: the table's width on disk does not match its spec"
            )
        if found is None:
            memoryview(out).cast("B")[:] = buf  # one memcpy
            return np.ones(len(values), dtype=bool)
        out[found] = np.frombuffer(buf, dtype="<f4").reshape(-1, self.width)
        return found
