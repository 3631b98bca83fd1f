"""LMDB environment holding every row durably, one named database per table.

Commits do not fsync (sync=False): a killed process loses nothing that reached
a commit, because the pages are in the OS page cache. ``sync()`` forces them to
disk; the store's flush() calls it, which is what makes flush() durable against
power loss as well. Integrity never depends on syncing: LMDB stays consistent.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np

from .codecs import RowCodec, encode_keys

FORMAT_VERSION = 1
_META_DB = b"__meta__"
_INITIAL_MAP = 1 << 30
_MAX_GROWTH_RETRIES = 16
_READ_CHUNK = 2048  # rows per get-and-copy round of get_rows
_WRITE_CHUNK = 65536  # rows per write transaction at most


class _ResizeGuard:
    """LMDB may grow its map only while this process has no transaction open;
    reads (from any thread, prefetch workers included) hold this shared."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0

    @contextmanager
    def shared(self):
        with self._cond:
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:  # held throughout: no new reader starts meanwhile
            self._cond.wait_for(lambda: self._readers == 0)
            yield


class StoreLockedError(RuntimeError):
    """Another process has the store open for writing."""


class LmdbBackend:
    def __init__(self, path: str | os.PathLike, readonly: bool = False, map_size: int | None = None):
        self.path = Path(path)
        self.readonly = readonly
        self._lock_fd = None
        if readonly:
            if not (self.path / "data.mdb").exists():
                raise FileNotFoundError(f"no tierstore at {self.path} (missing data.mdb); open it once for writing to create it")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self._take_writer_lock()
        try:
            existing = (self.path / "data.mdb").stat().st_size if (self.path / "data.mdb").exists() else 0
            self.env = lmdb.open(
                str(self.path),
                map_size=max(map_size or _INITIAL_MAP, existing),
                max_dbs=1024,
                readonly=readonly,
                sync=False,
                # Not writemap=True, although it cut a write-back of 3,700 random rows from
                # 12.6 to 4.5 ms here: it makes data.mdb a sparse file of the map's size, and a
                # full disk then kills the process with SIGBUS instead of failing the commit.
                readahead=False,  # random row access: readahead wastes page cache
                max_readers=256,
            )
            self._meta = self.env.open_db(_META_DB, create=not readonly)
        except Exception:
            self._release_writer_lock()
            raise
        self._dbs: dict[str, object] = {}
        self._resize = _ResizeGuard()
        self._codecs: dict[str, RowCodec] = {}

    # -- process-level single writer ------------------------------------------------
    def _take_writer_lock(self) -> None:
        fd = os.open(self.path / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(
                    f"tierstore at {self.path} is open for writing by another process (pid {holder}); "
                    "open it with readonly=True to read while that writer runs"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _release_writer_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    # -- metadata ----------------------------------------------------------------
    def read_meta(self) -> dict:
        with self.env.begin(db=self._meta) as txn:
            return {k.decode(): json.loads(v) for k, v in txn.cursor()}

    def write_meta(self, items: dict) -> None:
        def op(txn):
            for k, v in items.items():
                txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)
        self._write(op)

    def open_table(self, name: str, dim: int, state_dim: int = 0, dtype: str = "float32") -> None:
        self._dbs[name] = self.env.open_db(b"t:" + name.encode(), create=not self.readonly)
        self._codecs[name] = RowCodec(dim, state_dim, dtype)

    # -- rows ----------------------------------------------------------------------
    def get_rows(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows of ``ids`` (sorted ascending) and the mask of those found;
        into ``out`` (C-contiguous) when given. Rows not found are left unset."""
        codec = self._codecs[table]
        rows = np.empty((len(ids), codec.width), dtype=np.float32) if out is None else out
        found = np.ones(len(ids), dtype=bool)
        keys = encode_keys(ids)
        with self._resize.shared(), self.env.begin(db=self._dbs[table], buffers=False) as txn:
            get = txn.get
            # Copied out a chunk at a time: the row objects are still in cache and
            # their memory is reused by the next chunk (64k rows at once cost 40%
            # more than the get loop itself).
            for lo in range(0, len(keys), _READ_CHUNK):
                hi = lo + _READ_CHUNK
                found[lo:hi] = codec.decode(list(map(get, keys[lo:hi])), rows[lo:hi])
        return rows, found

    def put_rows(self, batches: list[tuple[str, np.ndarray, np.ndarray]], meta: dict | None = None) -> int:
        """Write (table, sorted ids, rows) batches, then meta; returns bytes written.
        Transactions of at most _WRITE_CHUNK rows, meta with the last: past LMDB's
        dirty-page limit a transaction spills pages and slows down (1M rows of 512 B
        took 5.3 s in one transaction, 2.3 s in 16). A failure leaves the earlier
        transactions committed; writing the rows again rewrites the same values."""
        parts = [(t, ids[lo: lo + _WRITE_CHUNK], rows[lo: lo + _WRITE_CHUNK])
                 for t, ids, rows in batches for lo in range(0, len(ids), _WRITE_CHUNK)]
        groups, group, size = [], [], 0
        for part in parts:
            if group and size + len(part[1]) > _WRITE_CHUNK:
                groups.append(group)
                group, size = [], 0
            group.append(part)
            size += len(part[1])
        groups.append(group)
        for i, group in enumerate(groups):
            encoded = [(self._dbs[t], encode_keys(ids), self._codecs[t].encode(rows)) for t, ids, rows in group]
            last = i == len(groups) - 1

            def op(txn, encoded=encoded, last=last):
                for db, keys, values in encoded:
                    with txn.cursor(db=db) as cur:
                        cur.putmulti(zip(keys, values))
                for k, v in (meta or {}).items() if last else ():
                    txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)
            self._write(op)
        return sum(len(ids) * (8 + self._codecs[t].row_bytes) for t, ids, _ in batches)

    def _write(self, op) -> None:
        if self.readonly:
            raise PermissionError(f"tierstore at {self.path} is open readonly; reopen without readonly=True to write")
        for _ in range(_MAX_GROWTH_RETRIES):
            try:
                with self.env.begin(write=True) as txn:
                    op(txn)
                return
            except lmdb.MapFullError:
                # the transaction aborted; grow the map and replay it
                with self._resize.exclusive():
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
        raise lmdb.MapFullError(f"LMDB map at {self.path} still full after growing it {_MAX_GROWTH_RETRIES} times")

    def sync(self) -> None:
        self.env.sync(True)

    def table_stats(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {name: txn.stat(db)["entries"] for name, db in self._dbs.items()}

    def disk_bytes(self) -> int:
        return (self.path / "data.mdb").stat().st_size

    def copy_to(self, path: str | os.PathLike, compact: bool = True) -> Path:
        """Copy the environment (one read transaction: a consistent snapshot) into
        the directory ``path``, which must be empty or absent; writers may go on meanwhile."""
        dest = Path(path)
        if dest.resolve() == self.path.resolve():
            raise ValueError(f"cannot copy the store at {self.path} onto itself; choose another directory")
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise FileExistsError(f"{dest} exists and is not an empty directory; choose a new directory for the copy")
        dest.mkdir(parents=True, exist_ok=True)
        self.env.copy(str(dest), compact=compact)
        return dest

    def close(self) -> None:
        try:
            self.env.close()
        finally:
            self._release_writer_lock()
