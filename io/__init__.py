"""Storage on SSD: the backend protocol (RowBackend), the LMDB backend, row codecs and the write-back queue.

The names load on first use (PEP 562): the errors module alone is light, and the
command line imports it without numpy or LMDB."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tierstore.lazy import exports

from .errors import (
    BadRowsError, DiskFullError, ForeignStoreError, SegmentLimitError, StoreCorruptError, StoreExistsError, StoreLockedError,
    StoreNotFoundError, StoreReadonlyError, SystemCallError)

# public name -> the module of this package that defines it
_LAZY = {
    "RowCodec": "codecs", "encode_keys": "codecs", "find_sorted": "codecs", "unique_ids": "codecs",
    "FORMAT_VERSION": "lmdb_backend", "WRITE_TXN_ROWS": "lmdb_backend", "LmdbBackend": "lmdb_backend",
    "MemoryBackend": "memory_backend", "RowBackend": "backend", "dense_bytes": "rowlog", "index_bytes_bound": "rowlog",
    "mapped_bytes_bound": "rowlog", "runs_bytes_bound": "rowlog",
    "WriteBack": "writeback", "WriteBatch": "writeback",
}

if TYPE_CHECKING:
    from .codecs import RowCodec, encode_keys, find_sorted, unique_ids
    from .backend import RowBackend
    from .lmdb_backend import FORMAT_VERSION, WRITE_TXN_ROWS, LmdbBackend
    from .memory_backend import MemoryBackend
    from .rowlog import dense_bytes, index_bytes_bound, mapped_bytes_bound, runs_bytes_bound
    from .writeback import WriteBack, WriteBatch

__all__ = ["BadRowsError", "DiskFullError", "ForeignStoreError", "SegmentLimitError", "StoreCorruptError", "StoreExistsError",
           "StoreLockedError", "StoreNotFoundError", "StoreReadonlyError", "SystemCallError", *_LAZY]

__getattr__, __dir__ = exports(globals(), _LAZY)
