"""One process's LMDB environment of a store, shared by its backends, and the locks
around it: the map's resize guard, the directory's flock, the writer lock."""
from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path

import lmdb

from tierstore.io import lmdb_map
from tierstore.io.direct import DirectReader, open_reader
from tierstore.io.errors import StoreLockedError
from tierstore.io.locks import SharedLock
from tierstore.io.files import mapped_file_bytes, unmap_pages

META_DB = b"__meta__"


class _Env:
    """One process's LMDB environment of a store, shared by its LmdbBackends: LMDB
    allows an environment to be open once per process (a second open would break
    its locks), so a reader opened beside a writer uses the writer's."""

    def __init__(self, env: lmdb.Environment, meta, key: tuple[int, int]):
        self.env = env
        self.meta = meta  # the __meta__ database's handle
        self.key = key
        self.pid = os.getpid()  # a forked child must not use its parent's environment
        # LMDB may grow its map only while this process has no transaction open: reads (from any
        # thread, prefetch workers included) hold it shared, a read within a read among them
        self.resize = SharedLock(writers_first=False)
        self.users = 0
        self.writer = False
        self.maps = 0  # counts the map's moves (set_mapsize): io.rowlog caches addresses in it
        self.main = env.open_db(None)  # LMDB's main database: the records of the named ones
        self.direct: DirectReader | None = None  # opened when a backend first asks for direct reads
        self.direct_why = "not tried yet"
        self._direct_lock = threading.Lock()
        self.base = (-1, 0, 0)  # (map moves, address of the file's first byte in the map, map size): map_base
        self.mapped_limit: int | None = None  # bytes the map may grow this process's mapped pages by (trim_map)
        self._mapped_at_trim = 0
        self._trim_lock = threading.Lock()

    def map_base(self, txn) -> tuple[int, int, int]:
        """(map moves, address of the file's first byte in this process's map, map size), found
        again after the map moves; ``txn`` reads with buffers."""
        if self.base[0] != self.maps:
            # a value of the main database, in the map: the metadata database's record
            self.base = (self.maps, lmdb_map.map_base(txn.get(META_DB, db=self.main)), self.env.info()["map_size"])
        return self.base

    def trim_map(self) -> None:
        """Unmap this process's pages of data.mdb once the file pages it maps have grown by more
        than mapped_limit since the last trim. A page read through LMDB's map stays mapped, in the
        process's RSS, until the kernel reclaims it, and a read maps the cached pages around it
        too (the kernel's fault-around, 64 KiB by default): a store that trains for long would
        map the whole file. MADV_DONTNEED drops the page-table entries only; the pages stay in
        the page cache. The growth is the process's (/proc/self/statm), measured again after each
        trim: other files mapped meanwhile cost at most an early trim."""
        if self.mapped_limit is None or mapped_file_bytes() - self._mapped_at_trim <= self.mapped_limit:
            return
        if not self._trim_lock.acquire(blocking=False):  # another thread trims
            return
        try:
            with self.resize.shared():  # the map does not move meanwhile: its range is LMDB's alone
                if self.base[0] != self.maps:
                    with self.env.begin(buffers=True) as txn:
                        self.map_base(txn)
                _, base, size = self.base
                unmap_pages(base, size)
            self._mapped_at_trim = mapped_file_bytes()
        except lmdb.MapResizedError:  # another process grew the map: the next read follows it, and trims
            pass
        finally:
            self._trim_lock.release()

    def direct_reader(self, file: Path) -> DirectReader | None:
        """The O_DIRECT reader of data.mdb, opened once; None where the system refuses one."""
        with self._direct_lock:
            if self.direct_why == "not tried yet":
                self.direct, self.direct_why = open_reader(file)
            return self.direct

    def close(self) -> None:
        if self.direct is not None:
            self.direct.close()
            self.direct = None
        self.env.close()

    def set_mapsize(self, size: int) -> None:
        self.env.set_mapsize(size)
        self.maps += 1


_OPEN: dict[tuple[int, int], _Env] = {}  # (st_dev, st_ino) of the store's directory
_OPEN_LOCK = threading.Lock()


def _shared_env(path: Path) -> _Env | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    shared = _OPEN.get((st.st_dev, st.st_ino))
    return shared if shared is not None and shared.pid == os.getpid() else None


def _lock_directory(path: Path, how: int) -> int:
    """flock the store's directory ``path`` (``how``: fcntl.LOCK_SH or LOCK_EX, with
    LOCK_NB or not); returns the descriptor, whose close unlocks it. Every LMDB open
    holds it shared, compact() holds it exclusive while it replaces data.mdb. Without
    it an opener that waited on lock.mdb across the swap joined the lock file as the
    old data.mdb left it (LMDB resets lock.mdb only for an opener with no one else
    there): its transaction id is the old file's, LMDB reads the meta page of the new
    file that the id's parity names, and the compacted copy's page 0 is empty."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd



def take_writer_lock(path: Path) -> int:
    """flock the store's writer.lock at ``path`` (one writer process a store), noting this
    process's pid in it for the next one's error; returns the descriptor, whose close unlocks it."""
    fd = os.open(path / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise StoreLockedError(
                f"tierstore at {path} is open for writing by another process (pid {holder}); "
                "open it with readonly=True to read while that writer runs"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except BaseException:
        os.close(fd)  # drops the flock: a failed open (a full disk) must not keep the store locked
        raise
    return fd
