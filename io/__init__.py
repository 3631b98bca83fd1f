"""Storage on SSD: the LMDB backend and row codecs."""
from .codecs import Float32RowCodec, encode_keys
from .lmdb_backend import FORMAT_VERSION, LmdbBackend, StoreLockedError

__all__ = ["FORMAT_VERSION", "Float32RowCodec", "LmdbBackend", "StoreLockedError", "encode_keys"]
