"""The store's file errors. Their base, TierstoreError, lives in tierstore.errors, a
module that imports nothing, so io/ can derive from it."""
from tierstore.errors import TierstoreError


class StoreLockedError(RuntimeError, TierstoreError):
    """Another writer (another process, or another store object in this one) has the store open."""


class StoreCorruptError(RuntimeError, TierstoreError):
    """data.mdb is damaged (truncated, overwritten, emptied) or its metadata is unreadable."""


class RowIndexDamagedError(StoreCorruptError):
    """A block of a row index file fails its CRC when first read: the index is rebuilt from
    the row log's segments, which hold every row (the file is a cache)."""


class BadRowsError(ValueError, TierstoreError):
    """Rows, a dtype or a call the storage cannot take: a width or dtype that does not match
    the table, rows without the last-use steps their table keeps, a copy onto its source."""


class ForeignStoreError(ValueError, TierstoreError):
    """The directory holds an LMDB environment that tierstore did not write, or a format this
    tierstore does not read."""


class StoreNotFoundError(FileNotFoundError, TierstoreError):
    """No store where one must already be (nothing is created there)."""


class StoreExistsError(FileExistsError, TierstoreError):
    """A copy or an export would overwrite something already at its destination."""


class StoreReadonlyError(PermissionError, TierstoreError):
    """A write to a store opened readonly, or LMDB's lock file cannot be written."""


class DiskFullError(OSError, TierstoreError):
    """A write failed for want of disk space (errno ENOSPC); nothing it started is left half done."""


class SystemCallError(OSError, TierstoreError):
    """A system call the storage makes itself (io_uring, madvise) failed; its errno is the call's."""


class SegmentLimitError(RuntimeError, TierstoreError):
    """A log table holds as many segments as its index can; compacting the store frees them."""


class SegmentFormatError(ValueError, TierstoreError):
    """A row log segment's bytes are not a segment (damage): the backend names the file."""
