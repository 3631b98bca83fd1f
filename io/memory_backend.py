"""MemoryBackend: a RowBackend (io.backend) that keeps every row in this process's memory.

A reference for writing a backend, and a second one the conformance suite runs on. It is
not durable: what it holds lives as long as the process. Backends opened on the same path
in one process share it, so a store closed and opened again (or copied) finds its rows, and
a readonly one reads what the writer published; another process, or a restart, finds
nothing. Each table is sorted id and packed row arrays, replaced (never changed in place) by
each write: a publish keeps the arrays of that moment for readers at no copy."""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tierstore.io.backend import check_places
from tierstore.io.codecs import RowCodec, find_sorted, row_norms_sq
from tierstore.io.errors import (
    BadRowsError, StoreCorruptError, StoreExistsError, StoreLockedError, StoreNotFoundError, StoreReadonlyError)


@dataclass(frozen=True)
class _Table:
    codec: RowCodec
    last_use: bool
    ids: np.ndarray  # int64, ascending
    slots: np.ndarray  # uint8 [n, codec.row_bytes]: the rows as the table's dtype packs them
    steps: np.ndarray  # int64 [n]: last-use steps (zeros where the table keeps none)


@dataclass
class _Store:
    """One path's contents: the writer's, and what its last publish left readers."""
    meta: dict = field(default_factory=dict)
    sketches: dict[str, bytes] = field(default_factory=dict)
    declared: set[str] = field(default_factory=set)  # tables write_meta created
    tables: dict[str, _Table] = field(default_factory=dict)
    published: dict[str, _Table] | None = None  # None: readers see every write
    writer: bool = False


_STORES: dict[Path, _Store] = {}
_LOCK = threading.RLock()  # every change of a store: a write is whole to other threads


def _empty(codec: RowCodec, last_use: bool) -> _Table:
    return _Table(codec, last_use, np.zeros(0, np.int64), np.zeros((0, codec.row_bytes), np.uint8), np.zeros(0, np.int64))


class MemoryBackend:
    def __init__(self, path: str | os.PathLike, readonly: bool = False, create: bool = True,
                 publish_at_flush: bool = False, txn_rows: int = 65536):
        """As LmdbBackend's: ``create=False`` or ``readonly``: a store must already be at ``path``
        (in this process); ``publish_at_flush``: readers see the tables as publish() left them."""
        self.path = Path(path).resolve()
        self.readonly = readonly
        self.txn_rows = txn_rows
        self.deleted: dict[str, list[np.ndarray]] | None = None
        self._sweep_from: dict[str, int] = {}
        self._closed = False
        with _LOCK:
            store = _STORES.get(self.path)
            if store is None:
                if readonly or not create:
                    raise StoreNotFoundError(f"no tierstore at {self.path} in this process's memory; "
                                            "a MemoryBackend holds rows only while its process runs")
                store = _STORES[self.path] = _Store()
            if not readonly:
                if store.writer:
                    raise StoreLockedError(f"tierstore at {self.path} is already open for writing in this process")
                store.writer = True
                store.published = dict(store.tables) if publish_at_flush else None
            self._store = store
        self._open: dict[str, tuple[RowCodec, bool]] = {}

    # -- tables and metadata -----------------------------------------------------------
    def open_table(self, name: str, dim: int, state_dim: int = 0, dtype: str = "float32", last_use: bool = False,
                   create: bool = True, num_rows: int | None = None) -> None:
        codec = RowCodec(dim, state_dim, dtype)
        with _LOCK:
            if name not in self._store.tables:
                if name in self._store.declared or create and not self.readonly:
                    self._store.tables[name] = _empty(codec, last_use)
                elif not create:
                    raise StoreCorruptError(f"{self.path} is damaged: table {name!r} is missing, though the store's "
                                            "metadata names it (its rows are lost)")
        self._open[name] = (codec, last_use)

    def read_meta(self) -> dict:
        with _LOCK:
            return {k: _copy(v) for k, v in self._store.meta.items()}

    def write_meta(self, items: dict, new_tables: dict[str, tuple[bool, int | None]] | None = None) -> None:
        self._writable()
        with _LOCK:
            self._store.declared |= set(new_tables or ())
            self._store.meta.update({k: _copy(v) for k, v in items.items()})

    def get_sketch(self, table: str) -> bytes | None:
        return self._store.sketches.get(table)

    def put_sketches(self, sketches: dict[str, bytes]) -> None:
        self._writable()
        with _LOCK:
            self._store.sketches.update(sketches)

    def indexed_tables(self, specs) -> list[str]:
        return []  # no index apart from the rows themselves

    def limit_index(self, limits: dict[str, int], held: dict[str, int] | None = None) -> None:
        pass  # no index to limit

    # -- rows -------------------------------------------------------------------------------
    def _table(self, name: str) -> _Table:
        """The table as this backend sees it: a reader of a publishing writer sees its last publish."""
        if name not in self._open:
            raise BadRowsError(f"table {name!r} is not open in the MemoryBackend at {self.path}; open_table it first")
        published = self._store.published
        seen = published if self.readonly and published is not None else self._store.tables
        codec, last_use = self._open[name]
        return seen.get(name) or _empty(codec, last_use)

    def get_rows(self, table: str, ids: np.ndarray, out: np.ndarray | None = None,
                 places: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if places is not None:  # it keeps no index worth sparing a lookup of
            places[:] = -1
        t = self._table(table)
        rows = np.empty((len(ids), t.codec.width), dtype=np.float32) if out is None else out
        at, found = find_sorted(t.ids, ids)
        rows[found] = t.codec.unpack(t.slots[at[found]])
        return rows, found

    def put_rows(self, batches: list[tuple[str, np.ndarray, np.ndarray]], meta: dict | None = None,
                 last_use: dict[str, np.ndarray] | None = None, places: dict[str, np.ndarray] | None = None) -> int:
        self._writable()
        last_use = last_use or {}
        for name, ids, _ in batches:
            if self.keeps_last_use(name) and name not in last_use and len(ids):
                raise BadRowsError(f"rows of table {name!r} need their last-use steps (it has ttl_steps)")
        check_places(batches, places)
        written = 0
        with _LOCK:
            for name, ids, rows in batches:
                t = self._table(name)
                ids = np.asarray(ids, dtype=np.int64)
                steps = np.asarray(last_use[name], dtype=np.int64) if t.last_use else np.zeros(len(ids), np.int64)
                kept = ~np.isin(t.ids, ids)
                merged_ids = np.concatenate([t.ids[kept], ids])
                order = np.argsort(merged_ids, kind="stable")
                self._store.tables[name] = replace(
                    t, ids=merged_ids[order], slots=np.concatenate([t.slots[kept], t.codec.pack(np.asarray(rows))])[order],
                    steps=np.concatenate([t.steps[kept], steps])[order])
                written += len(ids) * (8 + t.codec.row_bytes)
            self._store.meta.update({k: _copy(v) for k, v in (meta or {}).items()})
        return written

    def delete_rows(self, table: str, ids: np.ndarray) -> int:
        self._writable()
        with _LOCK:
            t = self._table(table)
            gone = np.isin(t.ids, ids)
            self._record_deleted(table, ids)
            if gone.any():
                self._store.tables[table] = replace(t, ids=t.ids[~gone], slots=t.slots[~gone], steps=t.steps[~gone])
            return int(gone.sum())

    def _record_deleted(self, table: str, ids: np.ndarray) -> None:
        if self.deleted is not None and len(ids):
            self.deleted.setdefault(table, []).append(np.array(ids, dtype=np.int64))

    def keeps_last_use(self, table: str) -> bool:
        return self._table(table).last_use

    def get_last_use(self, table: str, ids: np.ndarray) -> np.ndarray:
        t = self._table(table)
        at, found = find_sorted(t.ids, ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        out[found] = t.steps[at[found]]
        return out

    def stored_ids(self, table: str) -> np.ndarray:
        return self._table(table).ids.copy()

    def sweep(self, table: str, cutoff: int | None, budget: int, l2_below: float | None = None) -> int:
        self._writable()
        with _LOCK:
            t = self._table(table)
            start = int(np.searchsorted(t.ids, self._sweep_from.get(table, 0)))
            lo, hi = (start, start + budget) if start < len(t.ids) else (0, budget)
            ids, dead = t.ids[lo:hi], np.zeros(len(t.ids[lo:hi]), dtype=bool)
            if t.last_use and cutoff is not None:
                dead |= t.steps[lo:hi] <= cutoff
            if l2_below is not None:
                dead |= row_norms_sq(t.codec.unpack(t.slots[lo:hi])[:, : t.codec.dim]) < l2_below ** 2
            self._sweep_from[table] = int(ids[-1]) + 1 if hi < len(t.ids) else 0
            return self.delete_rows(table, ids[dead]) if dead.any() else 0

    def sweep_all(self, table: str, cutoff: int | None, l2_below: float | None = None, chunk: int = 65536) -> int:
        self._sweep_from.pop(table, None)
        return self.sweep(table, cutoff, max(len(self._table(table).ids), 1), l2_below)

    # -- durability and what readers see ----------------------------------------------------------
    def publish(self, meta: dict | None = None, sketches: dict[str, bytes] | None = None) -> None:
        self._writable()
        with _LOCK:
            self._store.meta.update({k: _copy(v) for k, v in (meta or {}).items()})
            self._store.sketches.update(sketches or {})
            if self._store.published is not None:
                self._store.published = dict(self._store.tables)

    def sync(self) -> None:
        """Nothing to do, and nothing it can do: the rows live in this process only."""

    def copy_to(self, path: str | os.PathLike, compact: bool = True) -> Path:
        dest = Path(path).resolve()
        with _LOCK:
            if dest == self.path:
                raise BadRowsError(f"cannot copy the store at {self.path} onto itself; choose another directory")
            if dest in _STORES:
                raise StoreExistsError(f"{dest} holds a store already; choose a new path for the copy")
            _STORES[dest] = _Store(dict(self._store.meta), dict(self._store.sketches), set(self._store.declared),
                                   dict(self._table_snapshot()))
        return dest

    def _table_snapshot(self) -> dict[str, _Table]:
        published = self._store.published
        return published if self.readonly and published is not None else self._store.tables

    def compact(self) -> tuple[int, int]:
        self._writable()
        size = self.disk_bytes()
        self.close()
        return size, size

    def close(self, save_index: bool = True) -> None:
        with _LOCK:
            if not self._closed and not self.readonly:
                self._store.writer = False
            self._closed = True

    # -- reporting and tuning -----------------------------------------------------------------------
    def table_stats(self) -> dict[str, int]:
        with _LOCK:
            return {name: len(t.ids) for name, t in self._table_snapshot().items()}

    def index_bytes(self) -> int:
        return 0

    def disk_bytes(self) -> int:
        return 0  # nothing on disk

    def limit_mapped(self, nbytes: int | None) -> None:
        pass  # maps no file

    def read_directly(self, on: bool, why: str) -> None:
        pass  # reads no disk

    @property
    def reads_directly(self) -> bool:
        return False

    @property
    def read_path(self) -> str:
        return "memory (MemoryBackend: no disk)"

    def _writable(self) -> None:
        if self.readonly:
            raise StoreReadonlyError(f"tierstore at {self.path} is open readonly; reopen without readonly=True to write")
        if self._closed:
            raise BadRowsError(f"the MemoryBackend at {self.path} is closed")


def _copy(value):
    """A JSON value as a store hands it back: never the caller's object."""
    return json.loads(json.dumps(value))


def forget(path: str | os.PathLike) -> None:
    """Drop the store at ``path`` from this process's memory (its rows are gone)."""
    with _LOCK:
        _STORES.pop(Path(path).resolve(), None)
