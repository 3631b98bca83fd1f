"""Storage on SSD: the LMDB backend, row codecs and the write-back queue."""
from .codecs import RowCodec, encode_keys, find_sorted, unique_ids
from .lmdb_backend import FORMAT_VERSION, WRITE_TXN_ROWS, LmdbBackend, StoreCorruptError, StoreLockedError
from .rowlog import index_bytes_bound
from .writeback import WriteBack, WriteBatch

__all__ = ["FORMAT_VERSION", "WRITE_TXN_ROWS", "RowCodec", "LmdbBackend", "StoreCorruptError", "StoreLockedError", "WriteBack", "WriteBatch", "encode_keys", "find_sorted", "index_bytes_bound", "unique_ids"]
