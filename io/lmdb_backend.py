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

import fcntl
import functools
import json
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np

from tierstore.io import rowlog
from tierstore.io.backend import check_places
from tierstore.io.codecs import RowCodec, encode_keys
from tierstore.io.errors import (
    BadRowsError, ForeignStoreError, RowIndexDamagedError, StoreLockedError, StoreNotFoundError,
    StoreReadonlyError)
from tierstore.io.lmdb_env import (
    _OPEN, _OPEN_LOCK, META_DB, _Env, _lock_directory, _shared_env, take_writer_lock)
from tierstore.io.locks import SharedLock
from tierstore.io.lmdb_file import _CORRUPT, _LOW_SPACE, _free_bytes, check_data_file, corrupt, disk_full
from tierstore.io.lmdb_log import STEP, LogTables
from tierstore.io.lmdb_sketches import Sketches
from tierstore.io.lmdb_upkeep import Upkeep

FORMAT_VERSION = 1
_INITIAL_MAP = 1 << 30
_MAX_GROWTH_RETRIES = 16
_READ_CHUNK = 2048  # rows per get-and-copy round of get_rows
# rows per write transaction at most, by default: a transaction mallocs a dirty page for each
# random row it writes, so the store sizes it from its memory budget (tierstore.engine.memory)
WRITE_TXN_ROWS = 65536
# How a new table with num_rows stores its rows: "log" (io.rowlog: segments, written at about
# the rows' own bytes) or "keyed" (a key per row, as every table of an unbounded id space is,
# and as stores written before the log layout are). A table keeps the layout it was created with.
NEW_TABLE_LAYOUT = "log"

class LmdbBackend(LogTables, Upkeep, Sketches):
    def __init__(self, path: str | os.PathLike, readonly: bool = False, map_size: int | None = None,
                 create: bool = True, txn_rows: int = WRITE_TXN_ROWS, publish_at_flush: bool = False,
                 spare: float | None = None):
        """``create=False``: a store must already be at ``path``; nothing is created otherwise.
        ``publish_at_flush``: a writer whose log tables readers see only as publish() leaves
        them (the store's flush); otherwise they see every commit. ``spare``: the dead rows
        each log table keeps at most, as a fraction of its live rows, before the writer copies
        live rows to reclaim their room (io.rowlog.RowLog; None: io.rowlog.SPARE)."""
        self.path = Path(path)
        self.spare = spare
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
        self._index_limits: dict[str, int] = {}  # bytes each log's runs may hold (limit_index)
        self._index_held: dict[str, int] = {}  # bytes of a dense level each log's index may hold (limit_index)
        self._index_named: dict[str, str] = {}  # the token of each log's index file LMDB names (io.lmdb_log)
        self._index_current: dict[str, str] = {}  # ... and of the one its runs come from now
        self._index_named_files: dict[str, set[str]] = {}  # the files (names) of each: it and the older levels it names
        self._index_current_files: dict[str, set[str]] = {}
        self._index_spilled_files: dict[str, set[str]] = {}  # ... and of a level a spill wrote since (mapped, not a save)
        # a log's index against the transaction reading it: lookups share it (io.lmdb_log._log_read),
        # a commit's index update, a spill's take and a rebuild hold it alone
        self._index_lock = SharedLock()
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

    def limit_index(self, limits: dict[str, int], held: dict[str, int] | None = None) -> None:
        """The bytes each log table's runs may hold in memory (io.rowindex.RowIndex.limit),
        given before its table opens; past it a writer spills them to its index file, a reader
        to a private one. ``held``: the bytes of a dense level of its index each table may hold
        in memory besides (RowIndex.hold; a table left out: none, its dense level is mapped)."""
        self._index_limits, self._index_held = dict(limits), dict(held or {})

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
            raise StoreNotFoundError(f"no tierstore at {self.path} (missing data.mdb); {advice}")
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
                raise StoreReadonlyError(
                    f"cannot open the tierstore at {self.path}: LMDB must create or write lock.mdb there, "
                    f"even to read ({e}); make the directory writable for this user, or copy the store"
                ) from None
            except _CORRUPT as e:
                raise corrupt(data, str(e)) from e
            finally:
                os.close(swap)
            try:
                self._check_is_tierstore(env, existing)
                meta = env.open_db(META_DB, create=not self.readonly)
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
            has_meta = txn.get(META_DB) is not None
        foreign = not has_meta and env.stat()["entries"] > 0
        if foreign:
            raise ForeignStoreError(
                f"{self.path} holds an LMDB environment that tierstore did not write (no {META_DB.decode()} "
                "database); choose another directory for the store"
            )

    @property
    def env(self) -> lmdb.Environment:
        return self._shared.env

    @property
    def _resize(self) -> SharedLock:
        return self._shared.resize

    # -- process-level single writer ------------------------------------------------
    def _take_writer_lock(self) -> None:
        self._lock_fd = take_writer_lock(self.path)

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
            with self._resize:  # no transaction of this process is open
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
            if isinstance(e, lmdb.DiskError) or _free_bytes(path) < _LOW_SPACE:
                raise disk_full(path, f"LMDB could not write {path}", e) from e
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
            raise BadRowsError(f"table {name!r} at {self.path} stores its rows in the log layout; open it with its num_rows")

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
            self._logs[name] = self._new_log(name, self._codecs[name], num_rows, last_use)
            self._log_synced[name] = -1
            self._load_index(name)
            self._log_slots(name, np.zeros(0, dtype=np.int64))  # replays the segments into the index
            if self._lock_fd is not None:
                self._start_publishing(name)
                self._remove_index_files(name)  # left by a writer that died
                self._spill_indexes()
            return
        self._dbs[name] = open_db(b"t:" + name.encode())
        if last_use:
            self._last_dbs[name] = open_db(b"u:" + name.encode())

    # -- rows ----------------------------------------------------------------------
    def get_rows(self, table: str, ids: np.ndarray, out: np.ndarray | None = None,
                 places: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows of ``ids`` (sorted ascending) and the mask of those found;
        into ``out`` (C-contiguous) when given. Rows not found are left unset. ``places``:
        filled with a hint of where each row is (io.rowlog.RowLog.hints; -1 where none is
        kept: not found, or a table stored a row a key), for put_rows."""
        codec = self._codecs[table]
        rows = np.empty((len(ids), codec.width), dtype=np.float32) if out is None else out
        if table in self._logs:
            if codec.dtype == "float32" and not self._logs[table].last_use and rows.flags.c_contiguous:
                # the stored bytes are the rows themselves: gathered straight into them
                return rows, self._log_slots(table, ids, rows.view(np.uint8), places)[1]
            slots, found = self._log_slots(table, ids, hints=places)
            rows[found] = codec.unpack(slots[found, : codec.row_bytes])
            return rows, found
        found = np.ones(len(ids), dtype=bool)
        keys = encode_keys(ids)
        if places is not None:
            places[:] = -1
        with self._reading(db=self._dbs[table], buffers=False) as txn:
            get = txn.get
            # Copied out a chunk at a time: the row objects are still in cache and
            # their memory is reused by the next chunk (64k rows at once cost 40%
            # more than the get loop itself).
            for lo in range(0, len(keys), _READ_CHUNK):
                hi = lo + _READ_CHUNK
                found[lo:hi] = codec.decode(list(map(get, keys[lo:hi])), rows[lo:hi])
        return rows, found

    def stored_ids(self, table: str) -> np.ndarray:
        """Ids of the rows stored for ``table``, ascending (int64): its keys, read in one transaction."""
        if table in self._logs:
            return self._log_read(table, lambda log: log.index.ids())
        with self._reading(db=self._dbs[table], buffers=False) as txn:
            keys = b"".join(txn.cursor().iternext(keys=True, values=False))
        return np.frombuffer(keys, dtype=">u8").astype(np.int64)

    def keeps_last_use(self, table: str) -> bool:
        return table in self._last_dbs or table in self._logs and self._logs[table].last_use

    def get_last_use(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Stored last-use step of each of the sorted ``ids``; -1 where none is (no such row)."""
        out = np.full(len(ids), -1, dtype=np.int64)
        if table in self._logs:
            slots, found = self._log_slots(table, ids)
            out[found] = np.ascontiguousarray(slots[found, self._codecs[table].row_bytes:]).view(STEP).ravel()
            return out
        with self._reading(db=self._last_dbs[table], buffers=False) as txn:
            values = list(map(txn.get, encode_keys(ids)))
        stored = np.empty(len(values), dtype=object)
        stored[:] = values
        found = stored != None  # noqa: E711 (elementwise, in C: no Python loop per id)
        if found.any():
            out[found] = np.frombuffer(b"".join(stored[found].tolist()), dtype=STEP)
        return out

    def delete_rows(self, table: str, ids: np.ndarray) -> int:
        """Delete the rows of ``ids`` (and their last-use steps) in one transaction; returns how many existed."""
        self._record_deleted(table, ids)
        if table in self._logs:
            with self._write_lock:  # the writer's index changes only under it
                gone = self._rebuilt_on_damage(table, lambda: ids[self._logs[table].index.get(ids) != rowlog.NONE])
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

    @property
    def txn_bytes(self) -> int:
        """A write transaction's share of dirty bytes: a page for each of its txn_rows rows."""
        return self.txn_rows * rowlog.PAGE

    def put_rows(self, batches: list[tuple[str, np.ndarray, np.ndarray]], meta: dict | None = None,
                 last_use: dict[str, np.ndarray] | None = None, places: dict[str, np.ndarray] | None = None) -> int:
        """Write (table, sorted ids, rows) batches, then meta; returns bytes written.
        ``last_use[table]``, for tables that keep it, is each row's last-use step;
        ``places[table]``, where get_rows found each row (-1: not known): the index is
        asked where a row was only for those whose hint is stale or missing.
        Transactions of at most ``txn_rows`` rows, meta with the last: past LMDB's
        dirty-page limit a transaction spills pages and slows down (1M rows of 512 B
        took 5.3 s in one transaction, 2.3 s in 16). A failure leaves the earlier
        transactions committed; writing the rows again rewrites the same values."""
        last_use = last_use or {}
        for t, ids, _ in batches:
            if self.keeps_last_use(t) and t not in last_use and len(ids):
                raise BadRowsError(f"rows of table {t!r} need their last-use steps (it has ttl_steps)")
        check_places(batches, places)
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
                if size and size + (hi - lo) * self._logs[t].slot_bytes > self.txn_bytes:
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
                hinted = {t: np.concatenate([places[t][lo:hi] for tt, lo, hi in txn_parts if tt == t])
                          for t in segments if places and t in places}
                self._write_log(segments, meta if not batches and i == len(txns) - 1 else None, hints=hinted)
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
                    encoded.append((self._last_dbs[t], keys, np.ascontiguousarray(steps, dtype=STEP).view("V8").ravel().tolist()))
            last = i == len(groups) - 1

            def op(txn, encoded=encoded, last=last):
                for db, keys, values in encoded:
                    with txn.cursor(db=db) as cur:
                        cur.putmulti(zip(keys, values))
                for k, v in (meta or {}).items() if last else ():
                    txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)
            self._write(op, dirties=sum(len(ids) for _, ids, _, _ in group) * rowlog.PAGE)
        return sum(len(ids) * (8 + self._codecs[t].row_bytes) for t, ids, _ in logged + batches)

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
            raise StoreReadonlyError(f"tierstore at {self.path} is open readonly; reopen without readonly=True to write")
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
                            rebuilt = set()
                            if applied is not None:
                                try:
                                    applied(planned)
                                except RowIndexDamagedError:  # the commit stands: the segments hold it
                                    rebuilt = set().union(*map(self._rebuild_log, list(self._logs)))
                            for t in set(self._logs) - rebuilt:
                                self._log_synced[t] = tid
                    self._unsynced += dirties
                    if self._unsynced >= self.txn_bytes:
                        self.sync()
                    self._shared.trim_map()
                    break
                except lmdb.MapFullError:
                    # the transaction aborted; grow the map and replay it
                    with self._resize:
                        self._shared.set_mapsize(self.env.info()["map_size"] * 2)
            else:
                raise lmdb.MapFullError(f"LMDB map at {self.path} still full after growing it {_MAX_GROWTH_RETRIES} times")
            if applied is not None:
                self._spill_indexes()

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


def _new_layout(num_rows: int | None) -> str:
    """The layout a new table takes: the log needs a bounded id space for its dense index."""
    return NEW_TABLE_LAYOUT if num_rows is not None else "keyed"


def _prefixes(layout: str, last_use: bool) -> tuple[bytes, ...]:
    """The databases of a table: "s:" its segments (the log keeps last-use steps in them);
    "t:" its rows by key, and "u:" their last-use steps."""
    return (b"s:",) if layout == "log" else (b"t:", b"u:")[: 1 + bool(last_use)]
