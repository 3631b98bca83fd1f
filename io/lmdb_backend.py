"""LMDB environment holding every row durably, one named database per table.

Commits do not fsync (sync=False): a killed process loses nothing that reached
a commit, because the pages are in the OS page cache. ``sync()`` forces them to
disk; the store's flush() calls it, which is what makes flush() durable against
power loss as well. Integrity never depends on syncing: LMDB stays consistent.

A store's writer publishes (``publish``, at each flush): readers read its log tables as the
last publish left them, and the next writer deletes what no publish named, so a flush that
spans many commits is seen whole or not at all (docs/durability.md).
"""
from __future__ import annotations

import collections
import errno
import fcntl
import functools
import itertools
import json
import mmap
import os
import shutil
import struct
import threading
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np

from . import rowlog
from .direct import DirectReader, open_reader
from .codecs import RowCodec, encode_keys, row_norms_sq
from .files import fsync_path, mapped_file_bytes, unmap_pages
from .errors import StoreCorruptError, StoreLockedError

FORMAT_VERSION = 1
_META_DB = b"__meta__"
_INDEX_KEY = b"index:"  # + a log table's name: the token of its saved index (_save_indexes)
# + a log table's name: what readers see of it (publish): {"seq": the newest segment, "dropped": the
# newest tombstone deleted while older copies of its ids went}; a table without one is read as committed
_PUBLISHED_KEY = b"published:"
_ROLLBACK_KEYS = 4096  # segments a roll-back deletes a transaction
_SKETCH_DB = b"__sketch__"  # admission sketches, by table name, as raw counters
_INITIAL_MAP = 1 << 30
_MAX_GROWTH_RETRIES = 16
_READ_CHUNK = 2048  # rows per get-and-copy round of get_rows
# rows per write transaction at most, by default: a transaction mallocs a dirty page for each
# random row it writes, so the store sizes it from its memory budget (tierstore.engine.memory)
WRITE_TXN_ROWS = 65536
_STEP = np.dtype("<i8")  # a row's last-use step, in a table's u: database
# How a new table with num_rows stores its rows: "log" (io.rowlog: segments, written at about
# the rows' own bytes) or "keyed" (a key per row, as every table of an unbounded id space is,
# and as stores written before the log layout are). A table keeps the layout it was created with.
NEW_TABLE_LAYOUT = "log"
_ADVISED_READ = 64  # rows a log read gathers from which it asks for all their pages at once first


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


def corrupt(path: Path, what: str) -> StoreCorruptError:
    return StoreCorruptError(
        f"{path} is damaged: {what}. Restore the store from a checkpoint or another copy "
        "(a checkpoint directory opens as a store), or move the directory aside to start afresh"
    )


# LMDB 0.9's file layout (lmdb.h / mdb.c): pages 0 and 1 are meta pages, each a
# 16-byte page header (pgno, pad, flags, ...) then MDB_meta: magic, version,
# address, map size, the free and main databases (MDB_db: pad, flags, depth,
# branch, leaf and overflow page counts, entries, root; the free database's pad
# is the page size), last page number, transaction id.
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_P_META = 0x08
_P_INVALID = (1 << 64) - 1
_PAGE_HEADER = struct.Struct("=QHHI")  # pgno, pad, flags, lower and upper bounds
_DB = "IHHQQQQQ"  # MDB_db: pad, flags, depth, branch, leaf, overflow pages, entries, root
_META = struct.Struct("=IIQQ" + _DB * 2 + "QQ")
_FREE_DB = slice(_PAGE_HEADER.size + struct.calcsize("=IIQQ"), _PAGE_HEADER.size + struct.calcsize("=IIQQ" + _DB))  # in a meta page


def check_data_file(data: Path, tries: int = 3) -> None:
    """Raise StoreCorruptError unless ``data`` (a data.mdb) has LMDB's two meta
    pages and holds every page the newer one names. LMDB maps the file and trusts
    it: touching a page past the end of a truncated file kills the process with
    SIGBUS, which no exception handler can catch, so this runs before lmdb.open.
    Every size is the open file's: compact() may rename another file over ``data``
    meanwhile, and the old file's pages against the new one's size looked truncated.
    A file that looks cut short is read ``tries`` times: a running writer may reuse the
    free-list pages _free_past_end reads (this is no LMDB reader) between two reads."""
    for _ in range(tries):
        cut_short = _check_data_file(data)
        if cut_short is None:
            return
    raise corrupt(data, cut_short)


def _check_data_file(data: Path) -> str | None:
    """check_data_file's one read: raises for damage, or returns what is missing where
    pages the meta page names are past the file's end and not all free."""
    metas = []
    with open(data, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise corrupt(data, "it is empty (0 bytes), so every row it held is gone")
        psize = 0
        for i in range(2):
            f.seek(i * psize)
            page = f.read(_PAGE_HEADER.size + _META.size)
            if len(page) < _PAGE_HEADER.size + _META.size:
                raise corrupt(data, f"it is truncated ({os.fstat(f.fileno()).st_size} bytes, too short for LMDB's meta page {i})")
            flags = _PAGE_HEADER.unpack_from(page)[2]
            m = _META.unpack_from(page, _PAGE_HEADER.size)
            if m[0] != _MAGIC or not flags & _P_META:
                raise corrupt(data, f"meta page {i} is not LMDB's (overwritten, or not an LMDB file)")
            if m[1] != _DATA_VERSION:
                raise corrupt(data, f"meta page {i} has LMDB data version {m[1]}; this LMDB reads version {_DATA_VERSION}")
            if i == 0:
                psize = m[4]
                if psize & (psize - 1) or not 512 <= psize <= 65536:
                    raise corrupt(data, f"meta page 0 names page size {psize}")
            metas.append((m, page[_FREE_DB]))
        # the size after the meta pages were read: a running writer writes a transaction's pages, then
        # the meta page naming them, so the file holds what a meta page names by the time it is read
        size = os.fstat(f.fileno()).st_size
        meta, free_db = metas[metas[0][0][-1] < metas[1][0][-1]]  # LMDB uses the meta page of the newer transaction
        map_size, last_pg = meta[3], meta[-2]
        need = (last_pg + 1) * psize
        if size < need and not _free_past_end(f, psize, free_db, size // psize, last_pg):
            return f"it is truncated ({size} bytes; its last transaction wrote {need})"
    if map_size < need:
        raise corrupt(data, f"its meta page names a map of {map_size} bytes, smaller than its {need} bytes of pages")
    for root in (meta[11], meta[19]):  # the free and main databases' root pages
        if root != _P_INVALID and not 2 <= root <= last_pg:
            raise corrupt(data, f"its meta page names root page {root}, outside its pages 2..{last_pg}")


def _free_past_end(f, psize: int, free_db: bytes, first: int, last: int) -> bool:
    """Whether pages ``first``..``last``, past the end of the file ``f``, are all on LMDB's
    free list. LMDB does not write pages it took and gave back within one commit (as
    its free list's own record, rewritten until it stops changing), so a whole file may
    end before the last page its meta page names; LMDB's own copy stops at the file's
    end. A file cut short loses pages still in use, which this tells apart."""
    try:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mem:
            free = []
            # the free database's keys are transaction ids, never 0: every record is "above -1"
            for _, at, nbytes in rowlog.walk_values(mem, free_db, -1, psize):
                ids = np.frombuffer(mem[at: at + nbytes], dtype="=u8")  # a copy: the map closes after
                if len(ids) == 0 or ids[0] != len(ids) - 1:
                    return False
                free.append(ids[1:])
    except (ValueError, IndexError, struct.error, rowlog.SegmentFormatError):  # its own pages cut off, or not a free list
        return False
    free = np.concatenate(free) if free else np.zeros(0, dtype=np.uint64)
    if last - first + 1 > len(free):  # more pages missing than the list holds (a scribbled meta page too)
        return False
    return bool(np.isin(np.arange(first, last + 1, dtype=np.uint64), free).all())


# LMDB errors that mean the file's pages are not what LMDB wrote
_CORRUPT = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError)
_LOW_SPACE = 64 << 20  # free bytes below which a failed write is reported as a full disk


def _free_bytes(path: Path) -> int:
    """Free bytes on the disk ``path`` is (or will be, once its directory is made) on."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


class _Env:
    """One process's LMDB environment of a store, shared by its LmdbBackends: LMDB
    allows an environment to be open once per process (a second open would break
    its locks), so a reader opened beside a writer uses the writer's."""

    def __init__(self, env: lmdb.Environment, meta, key: tuple[int, int]):
        self.env = env
        self.meta = meta  # the __meta__ database's handle
        self.key = key
        self.pid = os.getpid()  # a forked child must not use its parent's environment
        self.resize = _ResizeGuard()
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
            self.base = (self.maps, rowlog.map_base(txn.get(_META_DB, db=self.main)), self.env.info()["map_size"])
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


class LmdbBackend:
    def __init__(self, path: str | os.PathLike, readonly: bool = False, map_size: int | None = None,
                 create: bool = True, txn_rows: int = WRITE_TXN_ROWS, publish_at_flush: bool = False):
        """``create=False``: a store must already be at ``path``; nothing is created otherwise.
        ``publish_at_flush``: a writer whose log tables readers see only as publish() leaves
        them (the store's flush); otherwise they see every commit."""
        self.path = Path(path)
        self.readonly = readonly
        self.publish_at_flush = publish_at_flush and not readonly
        # a publishing writer's log tables: the newest segment published, the newest tombstone dropped
        # (published or not), and the segments retired since the last publish, deleted by the next
        self._published: dict[str, int] = {}
        self._dropped: dict[str, int] = {}
        self._retired: dict[str, set[int]] = {}
        self._direct = (False, "not asked for")  # read_directly()
        self.txn_rows = txn_rows  # rows per write transaction at most (put_rows)
        self._lock_fd = None
        self._dbs: dict[str, object] = {}
        self._last_dbs: dict[str, object] = {}  # tables with ttl_steps: row id -> last-use step
        self._sweep_from: dict[str, bytes] = {}  # where each table's sweep goes on
        self.deleted: dict[str, list[np.ndarray]] | None = None  # ids deleted, once recording (TieredStore.take_changes)
        self._sketch_db = None
        self._codecs: dict[str, RowCodec] = {}
        self._logs: dict[str, rowlog.RowLog] = {}  # tables in the log layout, and their segments' databases:
        self._log_dbs: dict[str, object] = {}
        self._log_synced: dict[str, int] = {}  # the transaction id each log's index reflects
        self._index_lock = threading.Lock()  # a log's index against the transaction reading it
        # one write transaction, its commit and index update at a time; held around a read that
        # decides a write (collection, sweep), so no commit comes between
        self._write_lock = threading.RLock()
        self._unsynced = 0  # bytes commits left dirty in the page cache since the last sync (_write)
        with _OPEN_LOCK:
            shared = _shared_env(self.path)
            if shared is not None:
                if not readonly:
                    self._join_as_writer(shared)
            else:
                shared = self._open(map_size, create)
                _OPEN[shared.key] = shared
            shared.users += 1
            self._shared = shared
        self._meta = shared.meta

    def read_directly(self, on: bool, why: str) -> None:
        """Whether a log table's large reads bypass the page cache (io.direct), where the
        system allows; ``why`` is said by read_path."""
        if on:
            self._shared.direct_reader(self.path / "data.mdb")
        self._direct = (on and self._shared.direct is not None, why)

    def limit_mapped(self, nbytes: int | None) -> None:
        """Keep the pages of data.mdb this process maps (reads through LMDB's map) to about
        ``nbytes`` (_Env.trim_map); None: no limit. The process's stores of this path share the
        map: the smallest limit holds."""
        if nbytes is not None:
            limit = self._shared.mapped_limit
            self._shared.mapped_limit = nbytes if limit is None else min(limit, nbytes)

    @property
    def reads_directly(self) -> bool:
        """Whether a log table's large reads bypass the page cache: they then wait on the
        disk in a system call, without Python's GIL (a read through the map waits in a
        page fault of a numpy copy, holding it)."""
        return self._direct[0]

    @property
    def read_path(self) -> str:
        """How a log table's large reads reach the disk, and why."""
        on, why = self._direct
        if on:
            return f"{self._shared.direct_why} ({why})"
        if self._shared.direct is None and self._shared.direct_why != "not tried yet":  # asked, and refused
            why = f"{why}; {self._shared.direct_why}"
        return f"LMDB's map ({why})"

    def _join_as_writer(self, shared: _Env) -> None:
        if shared.writer:
            raise StoreLockedError(
                f"tierstore at {self.path} is already open for writing in this process (pid {os.getpid()}), "
                "by another TieredStore; use that store, close it first, or open this one with readonly=True"
            )
        if shared.env.flags()["readonly"]:
            raise StoreLockedError(
                f"tierstore at {self.path} is open readonly in this process; open the writer first "
                "(readonly stores opened after it share its environment), or close the readonly stores"
            )
        self._take_writer_lock()
        shared.writer = True

    def _open(self, map_size: int | None, create: bool) -> _Env:
        data = self.path / "data.mdb"
        if not data.exists() and (self.readonly or not create):
            # nothing is created: a mistyped path must not become an empty store
            advice = "open it once for writing with tables=[...] to create it" if self.readonly else \
                "pass tables=[tierstore.TableSpec(...)] to create a store there"
            raise FileNotFoundError(f"no tierstore at {self.path} (missing data.mdb); {advice}")
        if data.exists():
            # before anything is created; a running writer only appends pages, then names them
            check_data_file(data)
        if not self.readonly:
            self.path.mkdir(parents=True, exist_ok=True)
            self._take_writer_lock()
            # a killed compaction's copy (compact() holds the writer lock throughout, so none runs now)
            (self.path / "data.mdb.compacting").unlink(missing_ok=True)
        try:
            existing = data.stat().st_size if data.exists() else 0
            swap = _lock_directory(self.path, fcntl.LOCK_SH)  # compact() does not replace data.mdb meanwhile
            try:
                env = lmdb.open(
                    str(self.path),
                    map_size=max(map_size or _INITIAL_MAP, existing),
                    max_dbs=1024,
                    readonly=self.readonly,
                    sync=False,
                    # Not writemap=True: it halves a commit's CPU while the pages are cached, but
                    # a page written through the map is read from disk first when it is not,
                    # where pwrite of a whole page reads nothing (with the page cache dropped, 2-3x
                    # the write-back's CPU a row moved).
                    readahead=False,  # random row access: readahead wastes page cache
                    max_readers=256,
                )
            except lmdb.ReadonlyError as e:
                raise PermissionError(
                    f"cannot open the tierstore at {self.path}: LMDB must create or write lock.mdb there, "
                    f"even to read ({e}); make the directory writable for this user, or copy the store"
                ) from None
            except _CORRUPT as e:
                raise corrupt(data, str(e)) from e
            finally:
                os.close(swap)
            try:
                self._check_is_tierstore(env, existing)
                meta = env.open_db(_META_DB, create=not self.readonly)
            except BaseException:
                env.close()
                raise
        except BaseException:
            self._release_writer_lock()
            raise
        st = self.path.stat()
        shared = _Env(env, meta, (st.st_dev, st.st_ino))
        shared.writer = not self.readonly
        return shared

    def _check_is_tierstore(self, env: lmdb.Environment, existing: int) -> None:
        """Refuse, before writing anything, an LMDB environment that another program
        wrote: it has databases or keys, but not tierstore's metadata."""
        if not existing:
            return
        with env.begin() as txn:
            has_meta = txn.get(_META_DB) is not None
        foreign = not has_meta and env.stat()["entries"] > 0
        if foreign:
            raise ValueError(
                f"{self.path} holds an LMDB environment that tierstore did not write (no {_META_DB.decode()} "
                "database); choose another directory for the store"
            )

    @property
    def env(self) -> lmdb.Environment:
        return self._shared.env

    @property
    def _resize(self) -> "_ResizeGuard":
        return self._shared.resize

    # -- process-level single writer ------------------------------------------------
    def _take_writer_lock(self) -> None:
        fd = os.open(self.path / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise StoreLockedError(
                    f"tierstore at {self.path} is open for writing by another process (pid {holder}); "
                    "open it with readonly=True to read while that writer runs"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except BaseException:
            os.close(fd)  # drops the flock: a failed open (a full disk) must not keep the store locked
            raise
        self._lock_fd = fd

    def _release_writer_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    # -- metadata ----------------------------------------------------------------
    def read_meta(self) -> dict:
        with self._reading(db=self._meta) as txn:
            items = list(txn.cursor())
        try:
            return {k.decode(): json.loads(v) for k, v in items}
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError among them
            raise corrupt(self.path / "data.mdb", f"its metadata record is unreadable ({e})") from None

    @contextmanager
    def _reading(self, **kwargs) -> Iterator[lmdb.Transaction]:
        """A read transaction that follows the map's growth: when another process's
        writer has grown the file past this process's map, LMDB refuses every new
        transaction (MDB_MAP_RESIZED) until the map adopts the new size."""
        for _ in range(_MAX_GROWTH_RETRIES):
            with self._resize.shared():
                try:
                    txn = self.env.begin(**kwargs)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    with self._named_errors(), txn:
                        yield txn
                    self._shared.trim_map()
                    return
            with self._resize.exclusive():  # no transaction of this process is open
                self._shared.set_mapsize(0)  # 0: the size the writer has set
        raise lmdb.MapResizedError(f"LMDB map at {self.path} kept growing while this process read it")

    @contextmanager
    def _named_errors(self, writes: Path | None = None) -> Iterator[None]:
        """Around every LMDB call: its errors for a damaged file and for a full disk
        become the store's named ones. ``writes``: the file the call writes."""
        try:
            yield
        except _CORRUPT as e:
            raise corrupt(self.path / "data.mdb", f"LMDB found a damaged page ({e})") from e
        except lmdb.Error as e:
            # DiskError is ENOSPC; LMDB reports a commit cut short by a full disk as EIO
            # ("Input/output error"). MapFullError is the map, not the disk: _write grows it.
            if isinstance(e, lmdb.MapFullError) or (writes is None and not isinstance(e, lmdb.DiskError)):
                raise
            path = writes or self.path / "data.mdb"
            free = _free_bytes(path)
            if isinstance(e, lmdb.DiskError) or free < _LOW_SPACE:
                raise OSError(errno.ENOSPC, f"disk full: LMDB could not write {path} ({e}; {free} bytes free); "
                              "free disk space", str(path)) from e
            raise

    def write_meta(self, items: dict, new_tables: dict[str, tuple[bool, int | None]] | None = None) -> None:
        """Write metadata records, creating the databases of ``new_tables`` (name -> (keeps
        last-use steps, num_rows)) in the same transaction: a table the metadata names has its
        databases, so open_table(create=False) finds one missing only if it was lost."""
        def op(txn):
            for name, (last_use, num_rows) in (new_tables or {}).items():
                for prefix in _prefixes(_new_layout(num_rows), last_use):
                    self.env.open_db(prefix + name.encode(), txn=txn)
            for k, v in items.items():
                txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)
        self._write(op)

    def open_table(self, name: str, dim: int, state_dim: int = 0, dtype: str = "float32", last_use: bool = False,
                   create: bool = True, num_rows: int | None = None) -> None:
        """``last_use``: the table keeps each row's last-use step beside it (ttl_steps).
        ``create=False``: the table's databases must exist (the store's tables were
        created by write_meta); one missing is damage, never recreated empty.
        ``num_rows``: the table's ids are below it; a new table then takes the log layout
        (NEW_TABLE_LAYOUT), and a table in that layout needs it to size its index."""
        with self._reading() as txn:  # a table keeps the layout it has; one that has none takes today's
            log = txn.get(b"s:" + name.encode()) is not None or (
                txn.get(b"t:" + name.encode()) is None and _new_layout(num_rows) == "log")
        if log and num_rows is None:
            raise ValueError(f"table {name!r} at {self.path} stores its rows in the log layout; open it with its num_rows")

        def open_db(key: bytes):
            try:
                with self._named_errors():
                    return self.env.open_db(key, create=create and not self.readonly)
            except lmdb.NotFoundError:
                raise corrupt(self.path / "data.mdb", f"the database {key.decode()!r} of table {name!r} is missing, "
                              "though the store's metadata names the table (its rows are lost)") from None
        self._codecs[name] = RowCodec(dim, state_dim, dtype)
        if log:
            self._log_dbs[name] = open_db(b"s:" + name.encode())
            if self._lock_fd is not None:
                self._roll_back(name)
            self._logs[name] = rowlog.RowLog(self._codecs[name], num_rows, last_use)
            self._log_synced[name] = -1
            self._load_index(name)
            self._log_slots(name, np.zeros(0, dtype=np.int64))  # replays the segments into the index
            if self._lock_fd is not None:
                self._start_publishing(name)
            return
        self._dbs[name] = open_db(b"t:" + name.encode())
        if last_use:
            self._last_dbs[name] = open_db(b"u:" + name.encode())

    # -- the log layout (io.rowlog) ------------------------------------------------------
    def _index_file(self, table: str) -> Path:
        return self.path / f"index-{table.encode().hex()}.bin"

    def _load_index(self, table: str) -> None:
        """Start ``table``'s index from the one its writer saved at close (io.rowlog.save_index),
        where LMDB names that file: then only the segments written since are replayed (up to
        the published one: _sync_log)."""
        with self._reading(buffers=True) as txn:
            saved = txn.get(_INDEX_KEY + table.encode(), db=self._meta)
            log = self._logs[table]
            if saved is None or not rowlog.load_index(self._index_file(table), log, json.loads(bytes(saved))["token"]):
                return
            published = self._published_in(txn, table)
            if published is not None and log.applied > published[0]:  # saved past what was published: not this history
                self._logs[table] = rowlog.RowLog(log.codec, len(log.loc), log.last_use)
                return
            _, base, size = self._map_base(txn)
            mem = rowlog.map_view(base, size)
            try:
                newer = log.adopt(rowlog.walk_values(mem, txn.get(b"s:" + table.encode(), db=self._shared.main), 0))
                log.replay(mem, newer if published is None else [v for v in newer if v[0] <= published[0]])
            except rowlog.SegmentFormatError as e:
                raise corrupt(self.path / "data.mdb", f"table {table!r} holds a damaged segment ({e})") from None
            if self._lock_fd is None:
                log.free_emptied()
            self._log_synced[table] = txn.id()

    def _save_indexes(self) -> None:
        """Save each log table's index beside data.mdb, then name it in LMDB (a new token each
        time): an index written but not named, or named by another copy of the file, is ignored.
        Not while a publishing writer holds segments it has not published: the next writer rolls
        those back, and the index would place rows in them."""
        if self.publish_at_flush and self._unpublished():
            return
        for table, log in self._logs.items():
            token = os.urandom(16).hex()
            rowlog.save_index(log, self._index_file(table), token)

            def op(txn, table=table, token=token):
                txn.put(_INDEX_KEY + table.encode(), json.dumps({"token": token}).encode(), db=self._meta)
            self._write(op)

    # -- what readers see of the log tables: the last publish ---------------------------------
    def _published_in(self, txn, table: str) -> tuple[int, int] | None:
        """(newest segment, newest tombstone dropped) of what readers see of log ``table`` in
        ``txn``'s snapshot; None where they see every commit (no publishing writer wrote it)."""
        value = txn.get(_PUBLISHED_KEY + table.encode(), db=self._meta)
        if value is None:
            return None
        try:
            record = json.loads(bytes(value))
            return int(record["seq"]), int(record["dropped"])
        except (ValueError, KeyError, TypeError) as e:
            raise corrupt(self.path / "data.mdb", f"table {table!r}'s published record is unreadable ({e})") from None

    @staticmethod
    def _published_record(seq: int, dropped: int) -> bytes:
        return json.dumps({"seq": seq, "dropped": dropped}).encode()

    def _roll_back(self, table: str) -> None:
        """A writer's open: delete the segments of ``table`` that no publish named (a writer died
        before its flush published them), so the table is as its last flush left it."""
        with self._reading(buffers=True) as txn:
            published = self._published_in(txn, table)
            if published is None:
                return
            _, base, size = self._map_base(txn)
            record = txn.get(b"s:" + table.encode(), db=self._shared.main)
            try:
                seqs = [seq for seq, _, _ in rowlog.walk_values(rowlog.map_view(base, size), record, published[0])]
            except rowlog.SegmentFormatError as e:
                raise corrupt(self.path / "data.mdb", f"table {table!r} holds a damaged segment ({e})") from None
        for lo in range(0, len(seqs), _ROLLBACK_KEYS):
            def op(txn, part=seqs[lo: lo + _ROLLBACK_KEYS]):
                for seq in part:
                    txn.delete(rowlog.seq_key(seq), db=self._log_dbs[table])
            self._write(op)

    def _start_publishing(self, table: str) -> None:
        """A writer's open, its index replayed: a publishing writer names what readers see of
        ``table`` (all of it) where nothing does yet; any other writer removes that record, for
        readers to see each of its commits."""
        with self._reading() as txn:
            published = self._published_in(txn, table)
        key = _PUBLISHED_KEY + table.encode()
        if not self.publish_at_flush:
            if published is not None:
                self._write(lambda txn: txn.delete(key, db=self._meta))
            return
        if published is None:
            # a reader behind this store's last commit may have missed a dropped tombstone: it rebuilds
            applied = self._logs[table].applied
            published = (applied, applied)
            self._write(lambda txn: txn.put(key, self._published_record(*published), db=self._meta))
        self._published[table], self._dropped[table] = published
        self._retired[table] = set()

    def _unpublished(self) -> bool:
        """Whether a publishing writer has committed segments, or retired some, since its last publish."""
        return any(self._retired.get(t) or log.applied != self._published.get(t) for t, log in self._logs.items())

    def publish(self, meta: dict | None = None, sketches: dict[str, bytes] | None = None) -> None:
        """One transaction that makes what this writer committed visible to readers whole: the
        metadata records ``meta``, the admission ``sketches``, and, of each log table, the
        segments written since the last publish; it deletes the segments retired since (their
        rows live on in newer ones), which readers of the last publish still read. A writer that
        is not publish_at_flush has published each commit already: this writes meta and sketches."""
        opened = [None]

        def op(txn, _):
            self._put_sketches(txn, sketches or {}, opened)
            for k, v in (meta or {}).items():
                txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)
            if not self.publish_at_flush:
                return
            for t, log in self._logs.items():
                for seq in self._retired[t]:
                    txn.delete(rowlog.seq_key(seq), db=self._log_dbs[t])
                txn.put(_PUBLISHED_KEY + t.encode(), self._published_record(log.applied, self._dropped[t]), db=self._meta)

        def applied(_):
            self._sketch_db = opened[0] or self._sketch_db
            for t, log in self._logs.items() if self.publish_at_flush else ():
                self._published[t] = log.applied
                self._retired[t].clear()
        self._write(op, applied, plan=lambda: None)

    def _log_read(self, table: str, under_lock, after=None):
        """``under_lock(log)`` with ``table``'s index brought to a read snapshot, then
        ``after(txn, its result)`` in that snapshot with the index free again (a
        commit may update it meanwhile: what under_lock took still names this snapshot)."""
        while True:
            with self._reading(db=self._log_dbs[table], buffers=True) as txn:
                with self._index_lock:
                    if not self._sync_log(table, txn):
                        continue  # the index moved past this snapshot (a commit meanwhile): take a newer one
                    got = under_lock(self._logs[table])
                return after(txn, got) if after is not None else got

    def _log_slots(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The stored slots (row bytes, then the last-use step where kept) of ``ids`` and the
        mask of those found, all of one snapshot; into ``out`` (uint8 [n, slot bytes]) when given."""
        def places(log):
            segs, slots, found = log.places(ids)
            return log.slot_bytes, log.offset[segs] + slots * log.slot_bytes, found

        def read(txn, got):
            width, offsets, found = got
            slots = np.empty((len(ids), width), dtype=np.uint8) if out is None else out
            if len(offsets):
                every = len(offsets) == len(ids)
                picked = slots if every else np.empty((len(offsets), width), dtype=np.uint8)
                self._read_at(txn, offsets, width, picked)
                if not every:
                    slots[found] = picked
            return slots, found
        return self._log_read(table, places, read)

    def _read_at(self, txn, offsets: np.ndarray, width: int, out: np.ndarray, direct: bool = True) -> None:
        """``width`` bytes at each file offset of ``offsets`` into ``out``, in ``txn``'s snapshot
        (LMDB reuses none of its pages while it is open): directly (io.direct) when asked and
        worth it, else from the map, all pages asked for at once first. ``direct=False`` for
        rows packed many to a page: a direct read reads a page for each row."""
        reader = self._shared.direct if direct and self.reads_directly and len(offsets) >= _ADVISED_READ else None
        if reader is not None and reader.fits(width):
            reader.read(offsets, width, out)
            return
        _, base, size = self._map_base(txn)
        if len(offsets) >= _ADVISED_READ:
            rowlog.will_need(base, offsets, width)
        rowlog.gather(base, size, offsets, width, out)

    def _sync_log(self, table: str, txn) -> bool:
        """Bring ``table``'s index to ``txn``'s snapshot (under the index lock); False when
        the index already reflects a later commit than the snapshot. Another process's
        commits are replayed; a sequence number missing among them is a segment that came
        and went unseen (a dropped tombstone, maybe), and the index is rebuilt from all."""
        tid, synced = txn.id(), self._log_synced[table]
        if tid <= synced:
            return tid == synced
        log = self._logs[table]
        # a reader sees a published table as its last publish left it: segments up to the one
        # named; none it still needs is deleted before a later publish names the newer copies
        published = self._published_in(txn, table) if self._lock_fd is None else None
        if published is not None and published[0] == log.applied >= published[1]:  # nothing published since
            self._log_synced[table] = tid
            return True
        _, base, size = self._map_base(txn)
        mem = rowlog.map_view(base, size)
        record = txn.get(b"s:" + table.encode(), db=self._shared.main)
        upto = published[0] if published is not None else None
        try:
            newer = rowlog.walk_values(mem, record, log.applied, upto=upto)
            if published is not None:
                # segments that came and went unseen held only rows that newer segments hold, or are
                # tombstones: a merged one's ids are in the merge, a dropped one's are not (rebuild)
                stale = published[1] > log.applied
            else:  # a sequence number missing is a segment that came and went unseen, a dropped tombstone maybe
                seqs = [seq for seq, _, _ in newer]
                stale = seqs and seqs[-1] - seqs[0] + 1 != len(seqs) or seqs[:1] not in ([], [log.applied + 1])
            if stale:
                log = self._logs[table] = rowlog.RowLog(log.codec, len(log.loc), log.last_use)
                newer = rowlog.walk_values(mem, record, 0, upto=upto)
            log.replay(mem, newer)
        except rowlog.SegmentFormatError as e:
            raise corrupt(self.path / "data.mdb", f"table {table!r} holds a damaged segment ({e})") from None
        if self._lock_fd is None:  # a reader: segments left behind are gone from its snapshots
            log.free_emptied()
        self._log_synced[table] = tid
        return True

    def _map_base(self, txn) -> tuple[int, int, int]:
        return self._shared.map_base(txn)

    # -- rows ----------------------------------------------------------------------
    def get_rows(self, table: str, ids: np.ndarray, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows of ``ids`` (sorted ascending) and the mask of those found;
        into ``out`` (C-contiguous) when given. Rows not found are left unset."""
        codec = self._codecs[table]
        rows = np.empty((len(ids), codec.width), dtype=np.float32) if out is None else out
        if table in self._logs:
            if codec.dtype == "float32" and not self._logs[table].last_use and rows.flags.c_contiguous:
                # the stored bytes are the rows themselves: gathered straight into them
                return rows, self._log_slots(table, ids, rows.view(np.uint8))[1]
            slots, found = self._log_slots(table, ids)
            rows[found] = codec.unpack(slots[found, : codec.row_bytes])
            return rows, found
        found = np.ones(len(ids), dtype=bool)
        keys = encode_keys(ids)
        with self._reading(db=self._dbs[table], buffers=False) as txn:
            get = txn.get
            # Copied out a chunk at a time: the row objects are still in cache and
            # their memory is reused by the next chunk (64k rows at once cost 40%
            # more than the get loop itself).
            for lo in range(0, len(keys), _READ_CHUNK):
                hi = lo + _READ_CHUNK
                found[lo:hi] = codec.decode(list(map(get, keys[lo:hi])), rows[lo:hi])
        return rows, found

    def put_sketches(self, sketches: dict[str, bytes]) -> None:
        """Store tables' admission sketches (one transaction)."""
        opened = [None]
        self._write(lambda txn: self._put_sketches(txn, sketches, opened))
        self._sketch_db = opened[0]

    def _put_sketches(self, txn, sketches: dict[str, bytes], opened: list) -> None:
        if not sketches:
            return
        # opened in this transaction: env.open_db alone begins a write transaction
        # holding the GIL, which waits forever for the writer thread's transaction;
        # kept (opened[0]) only once committed (a replayed op's first handle died with its abort)
        opened[0] = self._sketch_db or self.env.open_db(_SKETCH_DB, txn=txn)
        for table, blob in sketches.items():
            txn.put(table.encode(), blob, db=opened[0])

    def stored_ids(self, table: str) -> np.ndarray:
        """Ids of the rows stored for ``table``, ascending (int64): its keys, read in one transaction."""
        if table in self._logs:
            return self._log_read(table, lambda log: np.flatnonzero(log.loc != rowlog.NONE).astype(np.int64))
        with self._reading(db=self._dbs[table], buffers=False) as txn:
            keys = b"".join(txn.cursor().iternext(keys=True, values=False))
        return np.frombuffer(keys, dtype=">u8").astype(np.int64)

    def get_sketch(self, table: str) -> bytes | None:
        """A table's stored admission sketch; None if none was stored."""
        with self._reading() as txn:
            if txn.get(_SKETCH_DB) is None:  # never created: a readonly environment cannot create it
                return None
            return txn.get(table.encode(), db=self.env.open_db(_SKETCH_DB, txn=txn, create=False))

    def keeps_last_use(self, table: str) -> bool:
        return table in self._last_dbs or table in self._logs and self._logs[table].last_use

    def get_last_use(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Stored last-use step of each of the sorted ``ids``; -1 where none is (no such row)."""
        out = np.full(len(ids), -1, dtype=np.int64)
        if table in self._logs:
            slots, found = self._log_slots(table, ids)
            out[found] = np.ascontiguousarray(slots[found, self._codecs[table].row_bytes:]).view(_STEP).ravel()
            return out
        with self._reading(db=self._last_dbs[table], buffers=False) as txn:
            values = list(map(txn.get, encode_keys(ids)))
        stored = np.empty(len(values), dtype=object)
        stored[:] = values
        found = stored != None  # noqa: E711 (elementwise, in C: no Python loop per id)
        if found.any():
            out[found] = np.frombuffer(b"".join(stored[found].tolist()), dtype=_STEP)
        return out

    def delete_rows(self, table: str, ids: np.ndarray) -> int:
        """Delete the rows of ``ids`` (and their last-use steps) in one transaction; returns how many existed."""
        self._record_deleted(table, ids)
        if table in self._logs:
            with self._write_lock:  # the writer's index changes only under it
                gone = ids[self._logs[table].loc[ids] != rowlog.NONE]
                if len(gone):
                    self._write_log({table: [(gone, None)]})
            return len(gone)
        keys = encode_keys(ids)
        deleted = [0]

        def op(txn):
            deleted[0] = self._delete(txn, table, keys)
        self._write(op)
        return deleted[0]

    def _record_deleted(self, table: str, ids: np.ndarray) -> None:
        # recorded before the commit: a delete that then fails leaves ids that did not change
        # among the recorded ones, which a reader of the record reads back as they are
        if self.deleted is not None and len(ids):
            self.deleted.setdefault(table, []).append(np.array(ids, dtype=np.int64))

    def sweep_all(self, table: str, cutoff: int | None, l2_below: float | None = None, chunk: int = 65536) -> int:
        """sweep() over the whole table from its first row, a transaction a ``chunk`` of rows:
        every row the rules delete now is deleted. Returns the rows deleted."""
        self._sweep_from.pop(table, None)
        deleted = self.sweep(table, cutoff, chunk, l2_below)
        while self._sweep_from.get(table):
            deleted += self.sweep(table, cutoff, chunk, l2_below)
        return deleted

    def _delete(self, txn, table: str, keys: list[bytes]) -> int:
        # map: the per-key calls run in C, as get_rows's gets
        found = sum(map(functools.partial(txn.delete, db=self._dbs[table]), keys))
        if table in self._last_dbs:
            collections.deque(map(functools.partial(txn.delete, db=self._last_dbs[table]), keys), maxlen=0)
        return found

    def sweep(self, table: str, cutoff: int | None, budget: int, l2_below: float | None = None) -> int:
        """Delete the rows last used at or before step ``cutoff``, and those whose
        weights' L2 norm is below ``l2_below``, among the next ``budget`` rows of the
        table (of its last-use database where it keeps one), going on where the last
        sweep stopped and starting over after the end; returns the rows deleted.
        Bounded work: one transaction of ``budget`` cursor steps at most."""
        if table in self._logs:
            return self._log_sweep(table, cutoff, budget, l2_below)
        by_age = table in self._last_dbs
        deleted, resume = [0], [b""]

        def op(txn):
            deleted[0], resume[0] = 0, b""
            with txn.cursor(db=self._last_dbs[table] if by_age else self._dbs[table]) as cur:
                if not cur.set_range(self._sweep_from.get(table, b"")) and not cur.first():
                    return  # no rows
                items = list(itertools.islice(cur.iternext(), budget))
            keys = [k for k, _ in items]
            dead = np.zeros(len(keys), dtype=bool)
            if by_age and cutoff is not None:
                dead |= np.frombuffer(b"".join(v for _, v in items), dtype=_STEP) <= cutoff
            if l2_below is not None:
                codec = self._codecs[table]
                values = list(map(functools.partial(txn.get, db=self._dbs[table]), keys)) if by_age else [v for _, v in items]
                rows = np.empty((len(keys), codec.width), dtype=np.float32)
                found = codec.decode(values, rows)
                dead[found] |= row_norms_sq(rows[found, : codec.dim]) < l2_below ** 2
            dead_keys = [keys[i] for i in np.flatnonzero(dead)]
            self._record_deleted(table, np.frombuffer(b"".join(dead_keys), dtype=">u8").astype(np.int64))
            deleted[0] = self._delete(txn, table, dead_keys)
            # the next sweep starts after the last key seen (keys are 8-byte big-endian ids < 2**63)
            last = int.from_bytes(keys[-1], "big")
            resume[0] = (last + 1).to_bytes(8, "big") if len(items) == budget else b""
        self._write(op)
        # moved on only once committed: _write replays op after growing the map, and a failed
        # sweep must look at the same rows again
        self._sweep_from[table] = resume[0]
        return deleted[0]

    def put_rows(self, batches: list[tuple[str, np.ndarray, np.ndarray]], meta: dict | None = None,
                 last_use: dict[str, np.ndarray] | None = None) -> int:
        """Write (table, sorted ids, rows) batches, then meta; returns bytes written.
        ``last_use[table]``, for tables that keep it, is each row's last-use step.
        Transactions of at most ``txn_rows`` rows, meta with the last: past LMDB's
        dirty-page limit a transaction spills pages and slows down (1M rows of 512 B
        took 5.3 s in one transaction, 2.3 s in 16). A failure leaves the earlier
        transactions committed; writing the rows again rewrites the same values."""
        last_use = last_use or {}
        for t, ids, _ in batches:
            if self.keeps_last_use(t) and t not in last_use and len(ids):
                raise ValueError(f"rows of table {t!r} need their last-use steps (it has ttl_steps)")
        logged = [(t, ids, rows) for t, ids, rows in batches if t in self._logs]
        if logged:
            batches = [b for b in batches if b[0] not in self._logs]
            # transactions of at most txn_rows pages of dirty bytes (the rows' own bytes here),
            # each one's slots packed only when it is written
            parts = [(t, lo, min(lo + self._logs[t].per_segment, len(ids))) for t, ids, _ in logged
                     for lo in range(0, len(ids), self._logs[t].per_segment)]
            by_table = {t: (ids, rows) for t, ids, rows in logged}
            txns, size = [[]], 0
            for t, lo, hi in parts:
                if size and size + (hi - lo) * self._logs[t].slot_bytes > self.txn_rows * rowlog.PAGE:
                    txns.append([])
                    size = 0
                txns[-1].append((t, lo, hi))
                size += (hi - lo) * self._logs[t].slot_bytes
            for i, txn_parts in enumerate(txns):
                segments: dict[str, list] = {}
                for t, lo, hi in txn_parts:
                    ids, rows = by_table[t]
                    log = self._logs[t]
                    segments.setdefault(t, []).append(
                        # packed inside the transaction, a segment at a time: packed here, a whole
                        # transaction's rows were copied once more beside LMDB's own dirty pages
                        (ids[lo:hi], functools.partial(log.slots_of, rows[lo:hi], last_use[t][lo:hi] if log.last_use else None)))
                self._write_log(segments, meta if not batches and i == len(txns) - 1 else None)
                for t in segments:
                    self._collect(t, sum(len(ids) for ids, _ in segments[t]))
            if not batches:
                return sum(len(ids) * (8 + self._codecs[t].row_bytes) for t, ids, _ in logged)
        n = self.txn_rows
        parts = [(t, ids[lo: lo + n], rows[lo: lo + n], last_use[t][lo: lo + n] if t in last_use else None)
                 for t, ids, rows in batches for lo in range(0, len(ids), n)]
        groups, group, size = [], [], 0
        for part in parts:
            if group and size + len(part[1]) > n:
                groups.append(group)
                group, size = [], 0
            group.append(part)
            size += len(part[1])
        groups.append(group)
        for i, group in enumerate(groups):
            encoded = []
            for t, ids, rows, steps in group:
                keys = encode_keys(ids)
                encoded.append((self._dbs[t], keys, self._codecs[t].encode(rows)))
                if steps is not None:
                    encoded.append((self._last_dbs[t], keys, np.ascontiguousarray(steps, dtype=_STEP).view("V8").ravel().tolist()))
            last = i == len(groups) - 1

            def op(txn, encoded=encoded, last=last):
                for db, keys, values in encoded:
                    with txn.cursor(db=db) as cur:
                        cur.putmulti(zip(keys, values))
                for k, v in (meta or {}).items() if last else ():
                    txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)
            self._write(op, dirties=sum(len(ids) for _, ids, _, _ in group) * rowlog.PAGE)
        return sum(len(ids) * (8 + self._codecs[t].row_bytes) for t, ids, _ in logged + batches)

    def _write_log(self, segments: dict[str, list[tuple[np.ndarray, np.ndarray | None]]], meta: dict | None = None,
                   deleting: dict[str, list[int]] | None = None, dropping: dict[str, list[int]] | None = None) -> None:
        """Append segments (ids, slots or a function making them; tombstones where slots is None) to log tables, retire
        the segments ``deleting`` names (``dropping``: the tombstones among them no older copy
        of their ids outlives) and those left without a live row, then meta: one transaction;
        the index follows once it has committed. Retired segments go in the same transaction,
        or, for a publish_at_flush writer, with the next publish: readers of the last one may
        still read them."""
        def plan():
            out, gone = [], {}
            for t in set(segments) | set(deleting or ()):
                log = self._logs[t]
                gone[t] = set(log.emptied) | set((deleting or {}).get(t, ()))
                seq = log.applied
                for ids, slots in segments.get(t, ()):
                    if len(ids):
                        seq += 1
                        out.append((t, seq, ids, slots))
            return out, gone

        def op(txn, planned):
            new, gone = planned
            for t, seq, ids, slots in new:
                blob = rowlog.encode_segment(ids, slots() if callable(slots) else slots, self._logs[t].slot_bytes)
                txn.put(rowlog.seq_key(seq), blob, db=self._log_dbs[t], append=True)
            for t, seqs in gone.items() if not self.publish_at_flush else ():
                for seq in seqs:
                    txn.delete(rowlog.seq_key(seq), db=self._log_dbs[t])
            for k, v in (meta or {}).items():
                txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)

        def applied(planned):
            new, gone = planned
            for t, seq, ids, slots in new:
                self._logs[t].apply(seq, rowlog.TOMBSTONES if slots is None else rowlog.ROWS, ids)
            for t, seqs in gone.items():
                log = self._logs[t]
                for seq in seqs:
                    log.forget(seq)
                log.emptied = [q for q in log.emptied if q not in seqs]
                if self.publish_at_flush:
                    self._retired[t] |= seqs
                    self._dropped[t] = max([self._dropped[t], *(dropping or {}).get(t, ())])
            if any(slots is not None for *_, slots in new):
                # where the new segments' slots are in the file: their B-tree walked in a snapshot,
                # as a replay finds them (this process's own map never moves under it: only its
                # writer grows the map)
                with self._reading(buffers=True) as txn:
                    _, base, size = self._map_base(txn)
                    mem = rowlog.map_view(base, size)
                    for t in {t for t, *_ in new}:
                        first = min(seq for table, seq, *_ in new if table == t)
                        record = txn.get(b"s:" + t.encode(), db=self._shared.main)
                        for seq, at, _ in rowlog.walk_values(mem, record, first - 1):
                            self._logs[t].note_offset(seq, at)
        self._write(op, applied, plan, dirties=sum(len(ids) * self._logs[t].slot_bytes for t, parts in segments.items()
                                                   for ids, slots in parts if slots is not None))

    def _collect(self, table: str, written: int) -> None:
        """Clean ``table``'s log after ``written`` rows were appended (io.rowlog): copy the live
        slots of its emptiest segments into one new segment, drop tombstones no longer needed,
        merge the rest when they are many; one transaction."""
        with self._write_lock:
            self._collect_locked(table, written)

    def _collect_locked(self, table: str, written: int) -> None:
        log = self._logs[table]
        victims = log.victims(written)
        dropped = log.droppable_tombstones()
        merged = sorted(set(log.tombstones) - set(dropped)) if len(log.tombstones) > rowlog.MAX_TOMBSTONE_SEGMENTS else []
        if not victims and not dropped and not merged:
            return
        with self._reading(db=self._log_dbs[table], buffers=True) as txn:
            kept_ids, kept_at, still_deleted = [], [], []
            _, base, size = self._map_base(txn)
            mem = rowlog.map_view(base, size)
            # each victim's header and ids, then its live slots, their pages asked for all at once
            # (not a fault a page); never txn.get, which faults in a whole 1 MiB value
            spans = np.array([log.id_span(seq) for seq in victims], dtype=np.int64).reshape(-1, 3)
            rowlog.will_need(base, spans[:, 0], spans[:, 1])
            for seq, (at, length, first) in zip(victims, spans.tolist()):
                try:
                    ids = log.ids_at(seq, mem[at: at + length])
                except rowlog.SegmentFormatError as e:
                    raise corrupt(self.path / "data.mdb", f"table {table!r} holds a damaged segment ({e})") from None
                live = np.flatnonzero(log.live_of(seq, ids))
                kept_ids.append(ids[live])
                kept_at.append(first + live * log.slot_bytes)
            kept_slots = np.empty((sum(map(len, kept_at)), log.slot_bytes), dtype=np.uint8)
            if kept_at:
                self._read_at(txn, np.concatenate(kept_at), log.slot_bytes, kept_slots, direct=False)
            for seq in merged:
                ids = rowlog.parse_header(txn.get(rowlog.seq_key(seq)))[1]
                still_deleted.append(ids[log.loc[ids] == rowlog.NONE])
        parts = []
        if kept_ids:
            ids = np.concatenate(kept_ids)
            order = np.argsort(ids, kind="stable")
            slots = kept_slots[order]
            ids = ids[order]
            parts += [(ids[lo: lo + log.per_segment], slots[lo: lo + log.per_segment]) for lo in range(0, len(ids), log.per_segment)]
        if still_deleted:
            parts.append((np.unique(np.concatenate(still_deleted)), None))
        self._write_log({table: parts}, deleting={table: victims + dropped + merged}, dropping={table: dropped})

    def _log_sweep(self, table: str, cutoff: int | None, budget: int, l2_below: float | None) -> int:
        """sweep() of a log table: the live rows of its next segments, ``budget`` slots or so."""
        with self._write_lock:
            return self._log_sweep_locked(table, cutoff, budget, l2_below)

    def _log_sweep_locked(self, table: str, cutoff: int | None, budget: int, l2_below: float | None) -> int:
        log, db, codec = self._logs[table], self._log_dbs[table], self._codecs[table]
        seqs = np.sort(log.seq[log.seq > 0])
        start = int(self._sweep_from.get(table, 0) or 0)
        seqs = seqs[seqs >= start]
        dead, examined, last = [], 0, None
        with self._reading(db=db) as txn:
            for seq in seqs.tolist():
                value = txn.get(rowlog.seq_key(seq))
                kind, ids, offset = rowlog.parse_header(value)
                slots = np.frombuffer(value, dtype=np.uint8, count=len(ids) * log.slot_bytes, offset=offset)
                slots = slots.reshape(len(ids), log.slot_bytes)
                live = log.live_of(seq, ids)
                gone = np.zeros(len(ids), dtype=bool)
                if log.last_use and cutoff is not None:
                    gone |= np.ascontiguousarray(slots[:, codec.row_bytes:]).view(_STEP).ravel() <= cutoff
                if l2_below is not None:
                    gone |= row_norms_sq(codec.unpack(slots[:, : codec.row_bytes])[:, : codec.dim]) < l2_below ** 2
                dead.append(ids[live & gone])
                examined += len(ids)
                last = seq
                if examined >= budget:
                    break
        self._sweep_from[table] = last + 1 if examined >= budget and last is not None else 0
        doomed = np.concatenate(dead) if dead else np.zeros(0, dtype=np.int64)
        return self.delete_rows(table, np.sort(doomed)) if len(doomed) else 0

    def _write(self, op, applied=None, plan=None, dirties: int = 0) -> None:
        """Run ``op(txn)`` in a write transaction and commit it, growing the map and replaying
        it when full. With ``plan``, ``op(txn, plan())`` and then ``applied(plan())`` right
        after the commit, before any reader of a log's index sees the new snapshot.
        ``dirties``: about the bytes the commit leaves dirty in the page cache. Once commits
        since the last sync left a transaction's share of them (txn_rows pages), they are
        synced: under a memory cgroup, dirty pages of the file count against the limit and
        cannot be reclaimed until written, and cgroup v1 does not throttle a writer for them
        (a bulk write-back was OOM-killed so)."""
        if self.readonly:
            raise PermissionError(f"tierstore at {self.path} is open readonly; reopen without readonly=True to write")
        with self._write_lock:
            planned = plan() if plan is not None else None
            for _ in range(_MAX_GROWTH_RETRIES):
                try:
                    with self._named_errors(self.path / "data.mdb"):
                        txn = self.env.begin(write=True)
                        try:
                            op(txn) if plan is None else op(txn, planned)
                        except BaseException:
                            txn.abort()
                            raise
                        with self._index_lock:
                            txn.commit()
                            # the snapshot readers now get: a transaction that changed nothing (a sweep
                            # finding no idle row) commits none, and keeps the last one's id
                            tid = self.env.info()["last_txnid"]
                            if applied is not None:
                                applied(planned)
                            for t in self._logs:
                                self._log_synced[t] = tid
                    self._unsynced += dirties
                    if self._unsynced >= self.txn_rows * rowlog.PAGE:
                        self.sync()
                    self._shared.trim_map()
                    return
                except lmdb.MapFullError:
                    # the transaction aborted; grow the map and replay it
                    with self._resize.exclusive():
                        self._shared.set_mapsize(self.env.info()["map_size"] * 2)
        raise lmdb.MapFullError(f"LMDB map at {self.path} still full after growing it {_MAX_GROWTH_RETRIES} times")

    def sync(self) -> None:
        self.env.sync(True)
        self._unsynced = 0

    def table_stats(self) -> dict[str, int]:
        """Rows stored in each table, of one snapshot."""
        while True:
            with self._reading(buffers=True) as txn, self._index_lock:
                if all(self._sync_log(t, txn) for t in self._logs):
                    logged = {name: log.live_rows for name, log in self._logs.items()}
                    return {**{name: txn.stat(db)["entries"] for name, db in self._dbs.items()}, **logged}

    def indexed_tables(self, specs) -> list[str]:
        """Names of the tables of ``specs`` (TableSpecs) that keep a row index in memory: those
        in the log layout, or that take it when created (a keyed table has none)."""
        with self._reading() as txn:
            return [s.name for s in specs if txn.get(b"s:" + s.name.encode(), db=self._shared.main) is not None or (
                txn.get(b"t:" + s.name.encode(), db=self._shared.main) is None and _new_layout(s.num_rows) == "log")]

    def index_bytes(self) -> int:
        """Memory the log layout's indexes hold (io.rowlog)."""
        return sum(log.index_bytes() for log in self._logs.values())

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
        # Written aside, synced, then renamed: a copy cut short (a kill, a full disk)
        # never appears under dest's name, where it would open as a damaged store.
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.partial"
        partial.mkdir()
        try:
            with self._named_errors(dest / "data.mdb"):
                self.env.copy(str(partial), compact=compact)
            fsync_path(partial / "data.mdb")
            fsync_path(partial)
            os.rename(partial, dest)  # replaces dest if it is an empty directory
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        fsync_path(dest.parent)
        return dest

    def close(self, save_index: bool = True) -> None:
        """Release LMDB and the writer lock; a writer first saves its log tables' indexes
        (``save_index=False``: not, as after a crash)."""
        if save_index and self._shared is not None and self._lock_fd is not None and self._logs:
            try:
                with self._write_lock:
                    self._save_indexes()
            except OSError as e:  # a cache: the next open replays the segments instead
                warnings.warn(f"could not save the row index at {self.path} ({e}); the next open replays it", stacklevel=2)
        with _OPEN_LOCK:
            shared, self._shared = self._shared, None
            if shared is None:
                return
            try:
                shared.users -= 1
                if self._lock_fd is not None:
                    shared.writer = False
                if shared.users == 0:
                    del _OPEN[shared.key]
                    shared.close()
            finally:
                self._release_writer_lock()

    def compact(self) -> tuple[int, int]:
        """Rewrite data.mdb without LMDB's free pages, then close this backend; returns
        data.mdb's bytes before and after. Needs this writer to be the store's only
        user: no other store of it open in this process, no process reading it (a
        reader would go on reading the old file). The compacted copy is written aside,
        synced, and renamed over data.mdb while LMDB's own lock keeps every open
        environment out and the directory's flock every opener (_lock_directory): a
        reader opening meanwhile waits, then reads the new file; a kill at any point
        leaves one whole data.mdb, the old or the new."""
        if self._lock_fd is None:
            raise PermissionError(f"tierstore at {self.path} is open readonly; compacting needs it open for writing")
        if self._shared.users > 1:
            raise StoreLockedError(f"tierstore at {self.path} is also open readonly in this process; close those stores, then compact")
        data, aside = self.path / "data.mdb", self.path / "data.mdb.compacting"
        before = data.stat().st_size
        try:
            fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # a killed compaction's leftover is reused
            try:
                with self._named_errors(aside):
                    self.env.copyfd(fd, compact=True)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:  # a full disk: the store stays as it was
            aside.unlink(missing_ok=True)
            raise
        writer_lock, self._lock_fd = self._lock_fd, None  # held until data.mdb is swapped: no writer opens meanwhile
        try:
            self.close()
            with _OPEN_LOCK:  # nothing in this process opens the store meanwhile
                others = _shared_env(self.path)
                try:  # nor another process: one opening now refuses the compaction, as one open does
                    swap = _lock_directory(self.path, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    swap, others = None, True
                # Every open environment holds LMDB's lock byte (0 of lock.mdb) shared; an opener waits on it.
                # Opening lock.mdb here is safe only while this process has no environment of it open:
                # closing any descriptor of a file drops all of this process's fcntl locks on it.
                lock = None if others else os.open(self.path / "lock.mdb", os.O_RDWR)
                try:
                    if lock is not None:
                        try:
                            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
                        except OSError as e:
                            if e.errno not in (errno.EAGAIN, errno.EACCES):
                                raise
                            others = True
                    if others:
                        aside.unlink()
                        raise StoreLockedError(
                            f"tierstore at {self.path} is open in another process (a reader: tierstore stats, a readonly "
                            "store, prefetchd); close it, then compact; nothing changed")
                    os.rename(aside, data)
                    fsync_path(self.path)  # the rename itself survives a power loss
                finally:
                    if lock is not None:
                        os.close(lock)  # before the directory: an opener let in must find lock.mdb free, and reset it
                    if swap is not None:
                        os.close(swap)
        finally:
            os.close(writer_lock)
        return before, data.stat().st_size


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


def _new_layout(num_rows: int | None) -> str:
    """The layout a new table takes: the log needs a bounded id space for its dense index."""
    return NEW_TABLE_LAYOUT if num_rows is not None else "keyed"


def _prefixes(layout: str, last_use: bool) -> tuple[bytes, ...]:
    """The databases of a table: "s:" its segments (the log keeps last-use steps in them);
    "t:" its rows by key, and "u:" their last-use steps."""
    return (b"s:",) if layout == "log" else (b"t:", b"u:")[: 1 + bool(last_use)]
