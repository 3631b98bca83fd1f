"""What lies below a table's own tiers: a RowSource, the one seam between the step of
tierstore.engine.table (TableStore) and wherever rows live when no tier of the table holds them.

A TableStore asks its source for the rows a step misses (``fetch``), hands it the dirty rows
its tiers let go (``write_back``) and a write's rows no tier holds (``write``). Two sources:

- BackendRows (here), the embedded TieredStore's: rows the prefetcher staged, else those
  queued for LMDB (newest first), else LMDB's; every row written goes through the
  write-back queue (durable at the next flush).
- DaemonRows (tierstore.daemon.client_hbm), a daemon client's: READ and WRITE frames
  (with state) to the ``tierstore prefetchd`` that owns the store's DDR tier and LMDB.

So both run the same step over their tiers, and a new place for rows (another process, a
remote store) is one class with these three calls. tests/test_store_conformance.py checks
both sources against the same model of the rows.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from tierstore.io import RowBackend, WriteBack

if TYPE_CHECKING:
    from tierstore.engine.table import Prefetch, TableStore


@runtime_checkable
class RowSource(Protocol):
    """Where a table's rows are when none of its tiers holds them. Called with the store's lock held."""

    def fetch(self, table: TableStore, ids: torch.Tensor, out: np.ndarray | None,
              places: np.ndarray | None = None) -> torch.Tensor:
        """The rows, with state, of sorted unique ``ids`` (CPU) that no tier of ``table`` holds:
        float32 [len(ids), width] on the CPU, in ``out`` when given; a row never written has
        its initial values. ``places`` (int64, -1s): set, where the source knows it, to where
        its storage found a row (RowBackend.get_rows), for write_back."""
        ...

    def write_back(self, table: TableStore, ids: np.ndarray, rows: np.ndarray, places: np.ndarray | None = None) -> None:
        """Dirty rows (with state, sorted unique ids) leaving the table's tiers: what
        ``fetch`` gives for them from now on. ``places``: what fetch set for them (-1: none)."""
        ...

    def write(self, table: TableStore, ids: torch.Tensor, values: torch.Tensor, cols: int) -> None:
        """A write to rows no tier of ``table`` holds (sorted unique ids, CPU): their first
        ``cols`` columns; a row keeps the rest."""
        ...


@dataclass(eq=False)
class BackendRows:
    """The embedded store's RowSource: prefetch staging, the write-back queue and LMDB.
    The store sets ``prefetcher`` once its tables exist (the prefetcher reads them)."""
    backend: RowBackend
    writeback: WriteBack  # every LMDB row write goes through it: queue_write
    prefetcher: Prefetch | None = None

    def fetch(self, table: TableStore, ids: torch.Tensor, out: np.ndarray | None = None,
              places: np.ndarray | None = None) -> torch.Tensor:
        name = table.spec.name
        ids_np = ids.numpy()
        rows = np.empty((len(ids_np), table.spec.width), dtype=np.float32) if out is None else out
        cold = ~self.prefetcher.take(name, ids, torch.from_numpy(rows), places)  # staged rows are the newest
        if cold.any():
            where = np.flatnonzero(cold)
            queued, queued_rows = self.writeback.lookup(name, ids_np[where])
            if queued_rows is not None:
                rows[where[queued]] = queued_rows
                cold[where[queued]] = False
        cold_ids = ids_np[cold]
        if len(cold_ids):
            mark = time.perf_counter()
            all_cold = len(cold_ids) == len(ids_np)
            stored_at = np.empty(len(cold_ids), dtype=np.int64) if places is not None else None  # get_rows fills it
            cold_rows = table.fill_unwritten(cold_ids, *self.backend.get_rows(name, cold_ids, rows if all_cold else None, stored_at))
            seconds = time.perf_counter() - mark
            table.counters.latency.observe("ssd_read", seconds)
            self.prefetcher.read_time(len(cold_ids), seconds)
            if not all_cold:
                rows[cold] = cold_rows
            if places is not None:
                places[cold] = stored_at
        return torch.from_numpy(rows)

    def write_back(self, table: TableStore, ids: np.ndarray, rows: np.ndarray, places: np.ndarray | None = None) -> None:
        self.queue_write([(table, ids, rows, places)])

    def write(self, table: TableStore, ids: torch.Tensor, values: torch.Tensor, cols: int) -> None:
        # straight to LMDB (durable at the next flush); without state, each row's is kept
        if cols == table.spec.width:
            rows = values
        else:
            rows = table.fetch(ids)
            rows[:, :cols] = values
        self.queue_write([(table, ids.numpy(), rows.numpy(), None)])

    def queue_write(self, batches: Sequence[tuple[TableStore, np.ndarray, np.ndarray, np.ndarray | None]],
                    meta: dict | None = None) -> None:
        """Every LMDB row write starts here, and is counted here: counts do not
        depend on when the writer thread commits. A batch: (table, sorted unique ids, rows,
        where the backend found them or None)."""
        last = {t.spec.name: t.last_use_to_store(ids) for t, ids, *_ in batches if t.life.ttl_steps is not None}
        places = {t.spec.name: where for t, _, _, where in batches if where is not None}
        self.writeback.submit([(t.spec.name, ids, rows) for t, ids, rows, _ in batches], meta, last, places)
        for t, ids, *_ in batches:
            t.counters.ssd.count_writes(len(ids), t.spec.row_bytes)
            self.prefetcher.written(t.spec.name, ids)  # staged copies are older now
