"""The store's file errors. Their base, TierstoreError, lives in tierstore.errors, a
module that imports nothing, so io/ can derive from it."""
from tierstore.errors import TierstoreError


class StoreLockedError(RuntimeError, TierstoreError):
    """Another writer (another process, or another store object in this one) has the store open."""


class StoreCorruptError(RuntimeError, TierstoreError):
    """data.mdb is damaged (truncated, overwritten, emptied) or its metadata is unreadable."""
