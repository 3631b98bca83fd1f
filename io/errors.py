"""The base class of tierstore's own errors, and the store's file errors.

It lives in io/, the lowest layer, because io/ defines errors too and imports
nothing above itself; tierstore.errors re-exports it as the public name."""


class TierstoreError(Exception):
    """An error tierstore raises on purpose: bad input, a damaged or busy store, a peer
    that failed. Each subclass also keeps a builtin base (ValueError, RuntimeError,
    OSError, ...), so ``except ValueError`` and the like catch it as before; ``except
    tierstore.TierstoreError`` catches all of them."""


class StoreLockedError(RuntimeError, TierstoreError):
    """Another writer (another process, or another store object in this one) has the store open."""


class StoreCorruptError(RuntimeError, TierstoreError):
    """data.mdb is damaged (truncated, overwritten, emptied) or its metadata is unreadable."""
