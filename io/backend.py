"""RowBackend: what the store asks of the storage that holds every row durably.

LmdbBackend (io.lmdb_backend) is the store's; MemoryBackend (io.memory_backend) is a
small reference that keeps rows in this process only. tests/test_backend_conformance.py
holds the behaviours any backend must show; a new backend is one module that passes it
(docs/backends.md).

Ids are int64, sorted ascending and unique wherever a method takes them. Rows are
float32 [n, dim + state_dim]; a table's ``dtype`` is how its weights are stored, so a
row reads back as that dtype rounds it (RowCodec)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from .errors import BadRowsError


@runtime_checkable
class RowBackend(Protocol):
    # rows per write transaction at most: the store sizes it from its memory budget
    txn_rows: int
    # ids deleted (by delete_rows and the sweeps), by table, once the store starts recording
    # them (set to {}); None: not recording. The store takes and resets it (take_changes).
    deleted: dict[str, list[np.ndarray]] | None

    # -- tables and metadata ---------------------------------------------------------
    def open_table(self, name: str, dim: int, state_dim: int = 0, dtype: str = "float32", last_use: bool = False,
                   create: bool = True, num_rows: int | None = None) -> None:
        """Make ``name``'s rows readable and writable. ``last_use``: each row keeps its last-use
        step (ttl_steps). ``create=False``: the table must exist (write_meta created it); one
        missing is damage (StoreCorruptError), never recreated empty. ``num_rows``: its ids are below it."""

    def read_meta(self) -> dict:
        """Every metadata record (name -> JSON value) written so far."""

    def write_meta(self, items: dict, new_tables: dict[str, tuple[bool, int | None]] | None = None) -> None:
        """Write metadata records (JSON values), creating ``new_tables`` (name -> (keeps last-use
        steps, num_rows)) with them, at once."""

    def get_sketch(self, table: str) -> bytes | None:
        """A table's stored admission sketch; None if none was stored."""

    def put_sketches(self, sketches: dict[str, bytes]) -> None:
        """Store tables' admission sketches."""

    def indexed_tables(self, specs) -> list[str]:
        """Names of the tables of ``specs`` (TableSpecs) whose rows' index this backend keeps in
        memory (the store's budget counts index_bytes() for them)."""

    def limit_index(self, limits: dict[str, int], held: dict[str, int] | None = None) -> None:
        """The bytes the index of each table (of indexed_tables()) may hold in memory, given
        before the table opens; past it the index is to go to the backend's files. ``held``:
        bytes each table's index may hold besides, where it is stored dense (io.rowindex.Dense)."""

    # -- rows ---------------------------------------------------------------------------
    def get_rows(self, table: str, ids: np.ndarray, out: np.ndarray | None = None,
                 places: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows of ``ids`` and the mask of those found; into ``out`` (float32,
        C-contiguous [n, width]) when given. Rows not found are left unset. ``places`` (int64
        [n]): filled with a hint of where each row is stored, -1 where the backend keeps none,
        for a later put_rows of the same rows."""

    def put_rows(self, batches: list[tuple[str, np.ndarray, np.ndarray]], meta: dict | None = None,
                 last_use: dict[str, np.ndarray] | None = None, places: dict[str, np.ndarray] | None = None) -> int:
        """Write (table, ids, rows) batches, then the metadata records ``meta``; returns the bytes
        written. ``last_use[table]`` (int64 steps) is required for a table that keeps it.
        ``places[table]``: a hint for each row from this object's get_rows (-1: none), which spares
        the backend finding where the row was; any such hint, stale or not, leaves the rows written
        the same (another object's, of a store reopened since, may not: a writer reopened after a
        crash reuses the sequence numbers of the segments it rolled back). A failure
        may leave some batches written: writing them again rewrites the same values."""

    def delete_rows(self, table: str, ids: np.ndarray) -> int:
        """Delete the rows of ``ids`` (and their last-use steps); returns how many existed."""

    def keeps_last_use(self, table: str) -> bool:
        """Whether ``table``'s rows keep their last-use step."""

    def get_last_use(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The stored last-use step of each id (int64); -1 where there is no such row."""

    def stored_ids(self, table: str) -> np.ndarray:
        """Ids of the rows stored for ``table``, ascending (int64), of one snapshot."""

    def sweep(self, table: str, cutoff: int | None, budget: int, l2_below: float | None = None) -> int:
        """Delete the rows last used at or before step ``cutoff`` and those whose weights' L2 norm
        is below ``l2_below``, among about the next ``budget`` rows, going on where the last sweep
        stopped and starting over after the end (bounded work); returns the rows deleted."""

    def sweep_all(self, table: str, cutoff: int | None, l2_below: float | None = None, chunk: int = 65536) -> int:
        """sweep() over the whole table from its first row: every row the rules delete now is deleted."""

    # -- durability and what readers see ----------------------------------------------------
    def publish(self, meta: dict | None = None, sketches: dict[str, bytes] | None = None) -> None:
        """At the store's flush: write ``meta`` and ``sketches`` and make everything written so far
        visible to readers at once (a publish_at_flush writer's readers see nothing newer)."""

    def sync(self) -> None:
        """Make everything written so far survive a power loss (the store's flush calls it
        after publish): what flush() reported durable survives kill -9 and power loss."""

    def copy_to(self, path: str | os.PathLike, compact: bool = True) -> Path:
        """A consistent copy of the whole store into the new (absent or empty) directory ``path``,
        which opens as a store; writers may go on meanwhile."""

    def compact(self) -> tuple[int, int]:
        """Give back the space of deleted rows, then close; returns the bytes stored before and after."""

    def close(self, save_index: bool = True) -> None:
        """Release the store (``save_index=False``: after a crash, keep no cache of its index)."""

    # -- reporting and tuning -------------------------------------------------------------------
    def table_stats(self) -> dict[str, int]:
        """Rows stored in each table, of one snapshot."""

    def index_bytes(self) -> int:
        """Memory the indexes of indexed_tables() hold."""

    def disk_bytes(self) -> int:
        """Bytes the store takes on disk."""

    def limit_mapped(self, nbytes: int | None) -> None:
        """Keep the file pages this process maps to about ``nbytes`` (None: no limit); a hint."""

    def read_directly(self, on: bool, why: str) -> None:
        """Whether large reads bypass the page cache where the system allows; ``why`` is said by read_path."""

    @property
    def reads_directly(self) -> bool:
        """Whether large reads wait on the disk without holding Python's GIL."""

    @property
    def read_path(self) -> str:
        """How large reads reach the storage, and why (the store's stats)."""


def check_places(batches: list[tuple[str, np.ndarray, np.ndarray]], places: dict[str, np.ndarray] | None) -> None:
    """Refuse, before anything is written, ``places`` that are not one int64 hint a row of their
    table's batch: found wrong after the commit, they would leave the index behind it."""
    sizes = {t: len(ids) for t, ids, _ in batches}
    for t, where in (places or {}).items():
        where = np.asarray(where)
        if t not in sizes or where.shape != (sizes[t],) or where.dtype.kind not in "iu":
            raise BadRowsError(f"places of table {t!r} must be integers, one a row of its batch ({sizes.get(t, 0)} rows; got "
                               f"shape {where.shape} of {where.dtype}): pass what get_rows filled for those ids, or -1 where none")
