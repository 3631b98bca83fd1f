"""What a TieredStore tells of itself without moving a row: counters and stats, memory, the ids
and rows each tier and LMDB hold, a table's life counts (the StoreInspection mixin), and the
records they return."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tierstore.metrics import MetricsServer
from tierstore.engine.counters import LifeCounters, StoreSnapshot, TableCounters, TableSnapshot, TierFill, add_dicts
from tierstore.engine.memory import MemoryPart, MemorySplit
from tierstore.engine.tensors import as_ids


@dataclass(frozen=True)
class StoredRows:
    """What LMDB holds for some rows (``store.stored_rows``), in the order of the ids asked for."""
    found: np.ndarray  # bool [n]: LMDB holds the row
    rows: np.ndarray  # float32 [n, dim + state_dim]: the stored weights then state; NaN where not found
    last_use: np.ndarray | None  # int64 [n]: the stored last-use step, -1 where none; None unless the table has ttl_steps


@dataclass(frozen=True)
class TableLife:
    """A table's counts that admission, TTL and stochastic rounding go by (``store.life``),
    which flush() makes durable and incremental checkpoints carry."""
    steps: int  # steps the table has counted over its life: its read calls and forwards
    updates: int  # updates keyed for stochastic rounding so far (store.trainer(table).update_key)
    sketch: np.ndarray | None  # uint8 [admit_depth, admit_width]: a copy of the admission counts; None without admit_after


class StoreInspection:
    """TieredStore's inspection calls: they read its tables, counters, backend and lock."""

    def prefetch_stats(self) -> dict:
        """Prefetch state now: fetches in flight, staged rows, announced batches,
        and per table the prefetch counters (effective depth among them)."""
        with self._lock:
            state = self._prefetcher.state()
            state["tables"] = {n: dataclasses.asdict(t.counters.prefetch) for n, t in self._tables.items()}
            return state

    def serve_metrics(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve this store's registry over HTTP at http://addr:port/metrics until
        close(); port=0 binds a free port (the returned server's ``.port``)."""
        self._check_open()
        return self.metrics.serve(port, addr)

    def stats(self, per_table: bool = False) -> dict:
        """Cumulative counts: {"hbm": {hits, misses, evictions, writebacks}, "ddr": {...},
        "ssd": {reads, writes, read_bytes, write_bytes}}; per table with per_table=True.
        Store-wide, "memory" is memory() as a dict: the budget, the limit detected at
        open and what each part may hold and holds now; "read_path", how large reads of
        rows reach the disk (io_uring O_DIRECT reads, or LMDB's map and why)."""
        with self._lock:
            each = {name: t.counters.as_dict() for name, t in self._snapshot_or_raise().tables.items()}
            self._add_row_stats(each)
            memory = self.memory().as_dict()
        if per_table:
            return each
        total = {**TableCounters.new().as_dict(), "rows": {"stored": 0, **dataclasses.asdict(LifeCounters())}}
        for d in each.values():
            total = add_dicts(total, d)
        return {**total, "memory": memory, "read_path": self._backend.read_path}

    def snapshot(self) -> StoreSnapshot | None:
        """The store's counters and tier fill as readers see them (stats(), stage_seconds(),
        the Prometheus collector); None once closed. Reads plain counts without the lock."""
        if self._closed:
            return None
        tables = {name: TableSnapshot(t.counters, {tier: TierFill(cache.capacity, cache.resident)
                                                   for tier, cache in (("hbm", t.hbm), ("ddr", t.ddr)) if cache is not None})
                  for name, t in list(self._tables.items())}
        return StoreSnapshot(tables, self._counters, self._writeback.queued_rows)

    def stage_seconds(self) -> dict[str, float]:
        """Seconds the store's calls spent in each stage since it opened, over every table
        (the sums of ``tierstore_lookup_seconds``: dedupe, hbm, ddr, ssd_read, writeback,
        total) and in flush()."""
        snap = self._snapshot_or_raise()
        out = {"flush": snap.store.flush_latency.sums.get("flush", 0.0)}
        for t in snap.tables.values():
            for stage, (_, seconds) in t.counters.latency.snapshot().items():
                out[stage] = out.get(stage, 0.0) + seconds
        return out

    def _snapshot_or_raise(self) -> StoreSnapshot:
        self._check_open()
        return self.snapshot()

    def memory(self) -> MemorySplit:
        """The store's memory as split at open (tierstore.engine.memory.split_memory,
        docs/memory-budget.md), with what each part holds now: ``used_rows``, the rows resident in the tiers,
        staged, queued for LMDB; ``used_bytes``, their share of the part's bytes. LMDB's dirty
        pages and the page cache are not seen from here (None). Reads plain counts without
        the lock (the metrics collector calls it at scrape time)."""
        m = self._memory
        tables = list(self._tables.values())
        parts = dict(m.parts)
        for name in ("hbm", "ddr"):
            tiers = [tier for t in tables if (tier := getattr(t, name)) is not None]
            parts[name] = self._filled(m.parts[name], sum(tier.resident for tier in tiers))
        parts["staging"] = self._filled(m.parts["staging"], sum(t.counters.prefetch.staged_rows for t in tables))
        parts["writeback"] = self._filled(m.parts["writeback"], self._writeback.queued_rows)
        parts["row_index"] = dataclasses.replace(m.parts["row_index"], used_bytes=self._backend.index_bytes())
        return dataclasses.replace(m, parts=parts)

    @staticmethod
    def _filled(part: MemoryPart, rows: int) -> MemoryPart:
        per_row = part.bytes / part.rows if part.rows else 0
        return dataclasses.replace(part, used_rows=rows, used_bytes=round(rows * per_row))

    def resident_rows(self, table: str) -> dict[str, int]:
        t = self._table(table)
        return {"hbm": t.hbm.resident if t.hbm else 0, "ddr": t.ddr.resident if t.ddr else 0}

    def stored_ids(self, table: str) -> torch.Tensor:
        """Ids of ``table``'s rows in LMDB, ascending (int64, CPU): rows flushed or written
        back; a row still only in the tiers or queued for write-back is not there yet."""
        with self._lock:
            self._check_open()
            self._table(table)
            return torch.from_numpy(self._backend.stored_ids(table))

    def cached_ids(self, table: str) -> dict[str, torch.Tensor]:
        """Ids of ``table``'s rows in each cache tier now, ascending (int64, CPU): {"hbm": ...,
        "ddr": ...}, empty for a tier the table does not have. Tiers are exclusive: no id is in
        both. Nothing moves and nothing is counted."""
        with self._lock:
            self._check_open()
            t = self._table(table)
            return {name: torch.sort(tier.ids[tier.ids >= 0].cpu()).values if tier is not None else torch.empty(0, dtype=torch.int64)
                    for name, tier in (("hbm", t.hbm), ("ddr", t.ddr))}

    def stored_rows(self, table: str, ids) -> StoredRows:
        """What LMDB holds for the rows of ``ids`` (any order, repeats allowed) once the rows
        already queued for it are committed (it waits for them, as drain_writeback): a newer
        value still dirty in a tier is not there yet (read() or peek() give the rows as the
        store serves them). Nothing moves and nothing is counted."""
        with self._lock:
            self._check_open()
            self._reap(drain=True)  # else the answer would depend on how far the writer thread got
            spec = self._table(table).spec
            uid, inverse = np.unique(as_ids(spec, ids).cpu().numpy(), return_inverse=True)
            rows, found = self._backend.get_rows(table, uid)
            rows[~found] = np.nan
            last_use = self._backend.get_last_use(table, uid)[inverse] if spec.ttl_steps is not None else None
            return StoredRows(found[inverse], rows[inverse], last_use)

    def life(self, table: str) -> TableLife:
        """``table``'s step count, update count and admission counts now (TableLife)."""
        with self._lock:
            self._check_open()
            life = self._table(table).life
            sketch = life.sketch.counters.copy() if life.sketch is not None else None
            return TableLife(life.steps, self._updates.get(table, 0), sketch)

    def _add_row_stats(self, each: dict[str, dict]) -> None:
        """stats()'s "rows" of each table: rows in LMDB now (queued writes not yet
        committed excepted), and the admission and eviction counts."""
        stored = self._backend.table_stats() if each else {}
        for name, d in each.items():
            d["rows"] = {"stored": stored[name], **dataclasses.asdict(self._tables[name].counters.life)}
