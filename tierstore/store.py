"""TieredStore: embedding rows in HBM, DDR and LMDB.

Semantics (what the capacity tools predict, to the row):
- A read call is one step. Its unique ids are all used at that step; among
  them, recency follows first position in the call. Each row's use clock is
  ``clock_at_call_start + first_position``; the clock then advances by the
  call's length, so clocks are unique and increase with time.
- The cache is exclusive: HBM rows are not in DDR. A read brings every row it
  uses into HBM; rows HBM evicts are demoted into DDR, where they compete with
  DDR's residents by the same policy; rows DDR evicts leave the cache, written
  back to LMDB only if dirty. So LRU over (HBM, DDR) is one LRU list of
  hbm_rows + ddr_rows whose first hbm_rows entries are in HBM.
- Rows the current call uses are never evicted for it. If a call uses more rows
  than a tier holds, the tier keeps the ones its policy ranks highest and the
  rest go down a tier (or out of the cache) after the call is served.
- Writes do not count as uses: they update the cached copy (marking it dirty)
  or, for rows not cached, go straight to LMDB.

The data path: read() checks the call under the lock, then one table's step
(tierstore/engine/table.py, TableStore): probe -> plan while fetching -> write back ->
commit; read() gathers the rows (outside the lock when all were in the top
tier). The store keeps the API and its checks, the lock, the specs, flush,
checkpoint and close, metrics and stats.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from tierstore.eviction import make_policy
from tierstore.io import LmdbBackend, RowBackend, WriteBack, unique_ids
from tierstore.io.lmdb_file import corrupt
from tierstore.metrics import MetricsConfig, StoreMetrics

from tierstore.engine import chain
from tierstore.engine.counters import StoreCounters, restored_on_error
from tierstore.engine.memory import DEFAULT_WRITEBACK_ROWS
from tierstore.precision import DTYPES
from tierstore.spec import TableSpec
from tierstore.trace import TraceRecorder
from tierstore.engine.embedded import EmbeddedTableTrainer
from tierstore.engine.trainer import TableTrainer
from tierstore.validate import set_fields, with_keywords
from tierstore.engine.prefetch import PrefetchConfig, Prefetcher, PrefetchGroup, PrefetchTicket, StoreParts
from tierstore.engine.source import BackendRows
from tierstore.engine.table import Resident, Shared, TableStore
from tierstore.engine.tiers import CacheTier, last_values
from tierstore.engine.upload import Upload
from tierstore.engine.tensors import as_ids, as_values, check_out, gather_tier, unpicklable
from tierstore.errors import ArgumentTypeError, SettingError, StoreClosedError, UnknownTableError, WriteRefusedError
# StoreConfig, Sizes, StoredRows and TableLife: users import them from here too
from tierstore.config import Sizes, StoreConfig, reconcile_specs, size_memory
from tierstore.inspection import StoredRows, StoreInspection, TableLife  # noqa: F401


def _table_list(tables) -> list[TableSpec] | None:
    """``tables=`` as a list, each a TableSpec (one spec alone, or a list of names, named as such)."""
    if tables is None:
        return None
    listed = list(tables) if isinstance(tables, Iterable) and not isinstance(tables, (str, bytes, Mapping)) else None
    if listed is None or not all(isinstance(t, TableSpec) for t in listed):
        raise ArgumentTypeError("tables must be a list of tierstore.TableSpec (tables=[TableSpec(name, num_rows, dim)]), got "
                                + (f"a list holding {sorted({type(t).__name__ for t in listed})}" if listed is not None else
                                   type(tables).__name__ + (": wrap the one spec in a list" if isinstance(tables, TableSpec) else "")))
    return listed


class TieredStore(StoreInspection):
    """Embedding rows by id, cached in HBM and DDR tiers over LMDB.

    ``TieredStore(path, tables=[TableSpec(...)], hbm_rows=..., ddr_rows=...)``
    creates or opens a store; ``TieredStore(path)`` reopens one with the table
    specs it has stored. ``hbm_rows``/``ddr_rows`` are per table (an int for
    every table or a {table: rows} dict); 0 means no such tier.
    ``memory_budget`` (bytes, or a string such as "1GiB") sizes the store's host
    memory (tierstore.engine.memory.split_memory): the tiers left out, prefetch staging,
    the write-back queue, LMDB's dirty pages and a share for the page cache.
    ``direct_reads``: large reads skip the page cache (tierstore.io.direct); None (the
    default) does so where a memory_budget's page-cache share is smaller than the rows.
    ``spare_space``: the dead rows a table keeps on disk at most, as a fraction of its live
    rows (0.5: its file holds up to 1.5 times its rows; at most 1.0), before its writes also
    copy live rows to reclaim their room: more room, fewer rows copied (docs/out-of-core.md).
    ``config=StoreConfig(...)`` gives these settings whole instead; a keyword also
    given must agree with it.
    ``tierstore.open_store(path, daemon=SOCK, ...)`` attaches to a
    ``tierstore prefetchd`` instead (tierstore.daemon.client.DaemonStore, the same API).
    """

    def __init__(
        self,
        path: str | Path,
        tables: Sequence[TableSpec] | None = None,
        hbm_rows: Sizes | None = None,
        ddr_rows: Sizes | None = None,
        policy: str = "lru",
        device: str | torch.device | None = None,
        readonly: bool = False,
        map_size: int | None = None,
        clock: Callable[[], float] = time.time,
        name: str | None = None,
        registry: CollectorRegistry | None = None,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        eviction: str = "policy",
        prefetch: PrefetchConfig | None = None,
        record_trace: str | Path | None = None,
        writeback_rows: int | None = None,
        writeback_group_rows: int = 32768,
        daemon: None = None,
        claim: Sequence[str] = (),
        memory_budget: int | str | None = None,
        direct_reads: bool | None = None,
        spare_space: float = 0.5,
        config: StoreConfig | None = None,
    ):
        # accepted only to refuse: open_store(path, claim=...) without daemon= lands here, and
        # TieredStore(path, daemon=SOCK) reads like an attach; each gets its fix, not "unexpected keyword"
        if daemon is not None:
            raise ArgumentTypeError(f"TieredStore is the embedded store; attach to the `tierstore prefetchd` at {daemon} with "
                            "tierstore.open_store(path, daemon=SOCK, ...)")
        if claim:
            raise SettingError(f"claim={list(claim)} only applies to a client of `tierstore prefetchd` "
                             "(tierstore.open_store(path, daemon=SOCK, claim=...)); an embedded store is its tables' only writer")
        settings = dict(hbm_rows=hbm_rows, ddr_rows=ddr_rows, policy=policy, device=device, readonly=readonly, map_size=map_size,
                        clock=clock, eviction=eviction, writeback_rows=writeback_rows,
                        writeback_group_rows=writeback_group_rows, memory_budget=memory_budget, direct_reads=direct_reads,
                        spare_space=spare_space)
        self.config = StoreConfig(path, **settings)
        if config is not None:  # taken whole (a copy: opening sets its sizes); a keyword also given must agree
            if not isinstance(config, StoreConfig):
                raise ArgumentTypeError(f"config must be a tierstore.StoreConfig, got {type(config).__name__}")
            passed = set_fields(StoreConfig, settings) + (["path"] if config.path is not None else [])
            self.config = dataclasses.replace(with_keywords(config, self.config, passed, "TieredStore"), path=self.config.path)
        # metrics: exported to registry (default: prometheus_client's global one) under
        # the label name (default: the resolved path); metrics_port starts an endpoint
        metrics_config = MetricsConfig(registry, name, metrics_port, metrics_addr)
        self.path = self.config.path
        self.device = self.config.device
        self.readonly = self.config.readonly
        self._lock = threading.RLock()
        # All-resident reads gather outside the lock, so that several readers
        # (the daemon's clients) gather at once. Whoever overwrites tier rows
        # first waits, holding the lock, until no such gather is in flight;
        # holding it means no new one starts meanwhile. On a GPU a gather is done
        # once queued on its stream: a writer's stream also waits for the last
        # gather queued on each other stream.
        self._gathers = 0
        self._gathers_done = threading.Condition(threading.Lock())
        self._gather_events: dict = {}  # CUDA stream -> event after its last gather
        self._closed = False
        self._change_records: dict[str, dict[str, list[np.ndarray]]] = {}  # take_changes's, by reader
        self._shared: Shared | None = None
        tables = _table_list(tables)
        # without tables= nothing is created: a mistyped path fails, leaving nothing behind
        # readers see its log tables as flush() publishes them (LmdbBackend.publish)
        self._backend: RowBackend = LmdbBackend(self.path, readonly=self.readonly, map_size=self.config.map_size,
                                                create=bool(tables), publish_at_flush=True, spare=self.config.spare_space)
        try:
            specs = reconcile_specs(self._backend, self.path, list(tables or []), self.readonly)
            for name in ("hbm_rows", "ddr_rows"):
                value = getattr(self.config, name)
                if isinstance(value, Mapping) and set(value) - set(specs):
                    raise UnknownTableError(f"{name} names unknown tables {sorted(set(value) - set(specs))}; tables are {sorted(specs)}")
            prefetch = prefetch or PrefetchConfig()
            self._memory = size_memory(self.config, self._backend, specs, prefetch)
            prefetch = dataclasses.replace(prefetch, staged_rows=self._memory.staged_rows)
            # every LMDB row write goes through this queue and its one writer thread
            self._writeback = WriteBack(self._backend, self._lock, self.config.writeback_rows, self.config.writeback_group_rows,
                                        on_swept=self._count_swept)
            # what the tables share, handed to each (tierstore/engine/table.py): none reaches back into the store
            self._rows = BackendRows(self._backend, self._writeback)
            self._shared = Shared(self._rows, self.readonly, self._await_gathers, upload=Upload(self.device))
            if record_trace is not None:
                self._shared.recorder = TraceRecorder(record_trace, specs.values())
            meta = self._backend.read_meta()
            steps = meta.get("steps", {})
            self._tables = {name: self._make_table(spec, steps.get(name, 0)) for name, spec in specs.items()}
            self._evicted_before: dict[str, int] = dict(meta.get("evicted", {}))  # over the store's life, at the last flush
            self._load_sketches()
            self._counters = StoreCounters(last_flush=meta.get("last_flush"))
            self._updates: dict[str, int] = dict(meta.get("updates", {}))  # per table, for trainer(t).update_key
            self._trainers: dict[str, TableTrainer] = {}
            self.metrics = StoreMetrics(self, metrics_config)
            self._prefetcher = Prefetcher(StoreParts(self._tables, self._table, as_ids, self._lock, self._backend,
                                                     self._writeback), prefetch)
            self._shared.prefetcher = self._rows.prefetcher = self._prefetcher
        except BaseException:
            if getattr(self, "metrics", None) is not None:
                self.metrics.close()  # frees the store's label and endpoint
            self._backend.close()
            if self._shared is not None and self._shared.recorder is not None:
                self._shared.recorder.close()
            raise

    # -- opening -------------------------------------------------------------------
    def _make_table(self, spec: TableSpec, steps: int = 0) -> TableStore:
        # created with the metadata naming it (write_meta): a missing database is damage
        self._backend.open_table(spec.name, spec.dim, spec.state_dim, spec.dtype, last_use=spec.ttl_steps is not None,
                                 create=False, num_rows=spec.num_rows)
        tiers = []
        for size_name, tier_name, device in (("hbm_rows", "hbm", self.device), ("ddr_rows", "ddr", torch.device("cpu"))):
            rows = self.config.rows_for(size_name, spec.name)
            if spec.num_rows is not None:
                rows = min(rows, spec.num_rows)
            tier = CacheTier(tier_name, rows, spec.dim, spec.state_dim, device, make_policy(self.config.policy), spec.num_rows,
                             DTYPES[spec.dtype]) if rows else None
            if tier is not None:
                tier.lookahead = self.config.eviction == "lookahead"
            tiers.append(tier)
        return TableStore(spec, *tiers, self._shared, steps)

    # -- public API ------------------------------------------------------------------
    @property
    def tables(self) -> dict[str, TableSpec]:
        return {name: t.spec for name, t in self._tables.items()}

    def read(self, table: str, ids, with_state: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``ids`` as float32 [len(ids), dim] on ``store.device``
        (``[len(ids), dim + state_dim]`` with ``with_state=True``; a table with
        ``state_dim=0`` has an empty state, so that is ``[len(ids), dim]``), written
        into ``out`` when given (reusing a buffer saves an allocation per call)."""
        if not isinstance(with_state, (bool, np.bool_)):
            raise ArgumentTypeError(f"with_state must be True or False, got {with_state!r}")
        with self._lock:
            resident = self._read_locked(table, ids, with_state, out)
            if isinstance(resident, torch.Tensor):
                return resident
            hit, cols, latency, start = resident
            self._gathers += 1  # under the lock: a writer holding it waits for this gather
        try:
            result = self._gather_tier(hit.tier, hit.slots, cols, out)
        finally:
            self._gather_done()
        with self._lock:
            latency.observe("total", time.perf_counter() - start)
        return result

    def _read_locked(self, table: str, ids, with_state: bool, out: torch.Tensor | None):
        """read() under the lock: the rows, or, when every id is in the top tier,
        what the caller needs to gather them outside the lock."""
        t = self._table_to_read(table)
        self._prefetcher.check(table)  # a background failure nobody waited for surfaces here
        start = time.perf_counter()  # stage timings: one observation per call and stage, never per id
        ids = as_ids(t.spec, ids)
        cols = t.spec.width if with_state else t.spec.dim
        n = len(ids)
        check_out(out, n, cols, self.device)
        if n == 0:
            return out if out is not None else torch.empty((0, cols), dtype=torch.float32, device=self.device)
        result = t.read(ids, cols, out, self.device)
        if isinstance(result, Resident):  # every id in the top tier: no dedupe, no step
            return result, cols, t.counters.latency, start
        t.counters.latency.observe("total", time.perf_counter() - start)
        return result

    def _gather_tier(self, tier: CacheTier, slots: torch.Tensor, cols: int, out: torch.Tensor | None) -> torch.Tensor:
        return gather_tier(tier, slots, cols, out, self.device)

    def peek(self, table: str, ids, with_state: bool = False) -> torch.Tensor:
        """Rows of ``ids`` as read() would give them, float32 on the CPU, without a use:
        not a step, nothing moves between tiers, no admission or TTL use is counted
        (checkpoints read whole tables so, tierstore.training.checkpointing)."""
        with self._lock:
            t = self._table_to_read(table)
            uid, inverse = torch.unique(as_ids(t.spec, ids).cpu(), return_inverse=True)
            rows = t.reread(uid)
        return (rows if with_state else rows[:, :t.spec.dim]).index_select(0, inverse)

    def __reduce_ex__(self, protocol):
        raise unpicklable(self, "LMDB files, locks and threads")

    def write(self, table: str, ids, values, with_state: bool = False) -> None:
        """Set rows; for an id repeated in one call the last value wins.

        ``values`` is [len(ids), dim], or [len(ids), dim + state_dim] with
        ``with_state=True``; without it, a row's state is kept.
        """
        with self._lock:
            t = self._table_to_write(table)
            ids = as_ids(t.spec, ids)
            cols = t.spec.width if with_state else t.spec.dim
            values = as_values(t.spec, values, len(ids), cols)
            if len(ids) == 0:
                return
            uid, values = last_values(ids.cpu(), values)
            with restored_on_error([t.counters]):
                t.write(uid, values, cols)

    def evict(self, table: str, ids) -> int:
        """Delete the rows of ``ids`` from every tier and from LMDB: a later read
        gives their initial values. Waits for queued writes first (a queued value
        would bring a row back). Returns how many of them LMDB held. Durable at
        the next flush(); a failure leaves every row as it was."""
        with self._lock:
            t = self._table_to_write(table)
            uid = torch.unique(as_ids(t.spec, ids).cpu())
            if not len(uid):
                return 0
            self._reap(drain=True)
            return t.evict(uid)

    def prefetch(self, table: str, ids) -> PrefetchTicket:
        """Start bringing the rows of ``ids`` up in the background; returns at once.

        The ticket's ``wait()`` raises a failure (a bad id, an LMDB error) as the
        read itself would, naming the batch; ``release()`` unpins rows the batch did not read (a read
        that covers the ticket's ids releases it too). See tierstore/engine/prefetch.py.
        """
        with self._lock:
            self._check_open()
            self._reap()
            return self._prefetcher.prefetch(table, ids)

    def prefetch_batch(self, reads: Mapping[str, torch.Tensor]) -> PrefetchGroup | None:
        """One batch's prefetches, owned by a LookaheadLoader; None (nothing issued)
        while staging lacks room for all of them: a batch is prefetched whole or not yet."""
        with self._lock:
            self._check_open()
            self._reap()
            needs = self._prefetcher.fits(reads)
            if needs is None:
                return None
            group = PrefetchGroup(self._prefetcher.prefetch(t, ids, needs[t]) for t, ids in reads.items())
            for ticket in group.tickets:
                ticket.owned = True
            return group

    def report_step_seconds(self, seconds: float) -> None:
        """A LookaheadLoader's batch took the trainer this long: it sizes the prefetch reads."""
        with self._lock:
            self._prefetcher.trainer_step(seconds)

    def report_prefetch_depth(self, effective_depth: int, shrunk_steps: int) -> None:
        """A LookaheadLoader's depth, for stats and metrics."""
        for t in self._tables.values():
            t.counters.prefetch.effective_depth = effective_depth
            t.counters.prefetch.shrunk_steps = shrunk_steps

    def flush(self) -> None:
        """Return once every dirty row is durable in LMDB (survives kill -9 and power loss) and
        published: readers, and a writer opened after a crash, see this flush whole."""
        with self._lock:
            self._check_open()
            if self.readonly:
                return
            start = time.perf_counter()
            self._writeback.retry()
            # the dirty rows a quarter of the write-back queue at a time: taken whole, a DDR tier's
            # dirty rows were copied out at once; a chunk is copied out, sorted and packed while
            # the queue holds up to its limit (0.5 GiB budget: anonymous memory +208 MiB closing
            # with whole-queue chunks)
            chunk = max(1, (self.config.writeback_rows or DEFAULT_WRITEBACK_ROWS) // 4)
            while batches := [(t, *dirty) for t in self._tables.values() if (dirty := t.take_dirty(chunk)) is not None]:
                self._rows.queue_write(batches)
                self._reap()  # waits while the queue holds more than its limit
            self._reap(drain=True)
            now = self.config.clock()
            life = self._life_meta()
            # one transaction: readers and a writer opened after a crash see the rows, counts and
            # sketches of this flush together, or those of the last one
            self._backend.publish({"last_flush": now, "updates": dict(self._updates), **life}, self._changed_sketches())
            for name, steps in life["steps"].items():  # committed: the sweep may judge rows by them
                self._tables[name].life.durable_steps = steps
            self._backend.sync()
            sc = self._counters
            sc.flushes += 1
            sc.last_flush = now
            sc.flush_latency.observe("flush", time.perf_counter() - start)

    def take_changes(self, reader: str = "serving") -> dict[str, torch.Tensor]:
        """Ids (ascending, CPU) of each table's rows changed in LMDB since ``reader``'s last call:
        written back, flushed or deleted (evict, the TTL and L2 sweeps). Rows a TTL has expired by
        the durable step count are deleted first, by a sweep over each such table's last-use steps.
        A reader's first call starts its record and returns {}. A row may be among them unchanged;
        read it (peek) for its value. Readers: a serving publisher (tierstore.serving.stream) and
        incremental checkpoints, each with its own record."""
        with self._lock:
            self._reap(drain=True)  # no sweep in flight: none records into a taken record
            recording = self._writeback.changed is not None
            for name, t in self._tables.items():
                cutoff = t.life.sweep_cutoff()
                if recording and not self.readonly and cutoff is not None and cutoff >= 0:
                    self._backend.sweep_all(name, cutoff)
            changed, self._writeback.changed = self._writeback.changed or {}, {}
            deleted, self._backend.deleted = self._backend.deleted or {}, {}
            for record in self._change_records.values():
                for t, ids in [*changed.items(), *deleted.items()]:
                    record.setdefault(t, []).extend(ids)
            mine, self._change_records[reader] = self._change_records.get(reader, {}), {}
            return {t: torch.from_numpy(unique_ids(np.concatenate(ids))) for t, ids in mine.items()}

    def return_changes(self, changes: Mapping[str, torch.Tensor], reader: str = "serving") -> None:
        """Hand back what ``take_changes(reader)`` returned, when the reader could not use it
        (its delta or checkpoint link failed to write): the ids go back into its record, and
        its next take_changes returns them again, with whatever changed since."""
        with self._lock:
            record = self._change_records.setdefault(reader, {})
            for t, ids in changes.items():
                record.setdefault(t, []).append(torch.as_tensor(ids, dtype=torch.int64).cpu().numpy())

    def checkpoint(self, path: str | Path, compact: bool = True, incremental: bool = False) -> Path:
        """Flush, then copy the LMDB environment into the new directory ``path``:
        a consistent snapshot that opens as a store (``TieredStore(path)``), which
        is how it is restored. The store stays open; training can go on.

        ``incremental=True``: after this store's last incremental checkpoint, ``path`` holds only
        the rows changed since (weights and optimizer state, and the ids deleted), a link of a
        chain that ``tierstore.restore(path, dst)`` replays; the first is a whole
        copy, the chain's base (docs/serving.md)."""
        with self._lock:
            self.flush()
            if incremental:
                return chain.incremental_checkpoint(self, self._backend, path)
            return self._backend.copy_to(path, compact=compact)

    @staticmethod
    def compact(path: str | Path) -> tuple[int, int]:
        """Rewrite the store at ``path``, closed everywhere, without LMDB's free pages
        (a crash leaves the old file or the new, whole); returns data.mdb's bytes
        before and after. An open store's checkpoint() is compact already."""
        backend = LmdbBackend(path, create=False)
        try:
            return backend.compact()
        finally:
            backend.close()  # closed already unless it failed (a full disk): the store stays openable

    def close(self) -> None:
        """Stop prefetch, flush, then release memory, LMDB and the writer lock. Idempotent."""
        if not self._closed:
            self._prefetcher.close()  # outside the lock: landing fetches take it
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:
                self._await_gathers()
                self._closed = True
                self._writeback.stop()  # after a failed flush this gives up what it could not write
                self._shared.close()
                self._backend.close()
                if self._shared.recorder is not None:
                    self._shared.recorder.close()
                self._tables.clear()
                self.metrics.close()  # leave the registry, stop the endpoints

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TieredStore({str(self.path)!r}, tables={sorted(self._tables)}, policy={self.config.policy!r}, device={str(self.device)!r})"

    # -- what the training modules and the tools use beside the data calls ---------------------
    def trainer(self, table: str) -> TableTrainer:
        """The store's side of training ``table`` (tierstore.engine.trainer.TableTrainer): what
        TieredEmbeddingBag and the sharded module's shard owners use beside read() and
        write(). One per table for the store's life."""
        trainer = self._trainers.get(table)
        if trainer is None:
            with self._lock:
                self._table(table)  # the store's KeyError for an unknown table
                trainer = self._trainers.setdefault(table, EmbeddedTableTrainer(self, table, self._updates))
        return trainer

    def spec(self, table: str) -> TableSpec:
        """``table``'s spec; a KeyError naming the store's tables if it has no such table."""
        return self._table(table).spec

    def drain_writeback(self) -> None:
        """Return once every row already queued for LMDB (dirty rows the tiers evicted,
        writes to rows not cached) is committed; rows still dirty in the tiers stay there
        (flush() writes those too, and makes them durable). Raises a failed write-back as
        the store's calls do."""
        with self._lock:
            self._check_open()
            self._reap(drain=True)

    def _gather_done(self) -> None:
        with self._gathers_done:
            self._gathers -= 1
            self._gathers_done.notify_all()  # a waiter goes on once this block is left
            if self.device.type == "cuda":
                stream = torch.cuda.current_stream(self.device)
                self._gather_events[stream] = stream.record_event()

    def _await_gathers(self) -> None:
        """Called with the lock held before tier rows are overwritten."""
        with self._gathers_done:
            self._gathers_done.wait_for(lambda: self._gathers == 0)
            events = dict(self._gather_events)  # kept: every writer's stream waits for them
        if events:
            writer = torch.cuda.current_stream(self.device)
            for stream, event in events.items():
                if stream != writer:  # one stream runs in order
                    writer.wait_event(event)

    # -- validation --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed")

    def _table_to_read(self, name: str) -> TableStore:
        """The table a read goes to, under the lock, the write-backs done reaped."""
        self._check_open()
        t = self._table(name)
        self._reap()
        return t

    def _table_to_write(self, name: str) -> TableStore:
        """The table a write goes to, under the lock; raises first if none may."""
        self._check_open()
        if self.readonly:
            raise WriteRefusedError(f"store {self.path} is open readonly; reopen without readonly=True to write")
        t = self._table(name)
        self._reap()
        return t

    def _table(self, name: str) -> TableStore:
        try:
            return self._tables[name]
        except KeyError:
            raise UnknownTableError(f"unknown table {name!r}; the store has tables {sorted(self._tables)}") from None

    # -- the write-back queue, and what flush() keeps of admission ---------------------------
    def _reap(self, drain: bool = False) -> None:
        """Account for committed write-backs; raise a failed one (the call then changes nothing)."""
        try:
            if drain:
                self._writeback.drain()
            else:
                self._writeback.reap()
        except Exception as e:
            why = (f"writing rows to {self.path} failed ({e}); nothing was lost: the rows stay queued in memory, "
                   "and flush() retries once the cause (often a full disk) is fixed")
            code = getattr(e, "errno", None)  # a full disk stays ENOSPC
            raise (OSError(code, why) if code else OSError(why)) from e

    def _count_swept(self, table: str, rows: int) -> None:
        t = self._tables.get(table)
        if t is not None:
            t.counters.life.evicted += rows

    def _load_sketches(self) -> None:
        for name, t in self._tables.items():
            blob = self._backend.get_sketch(name) if t.life.sketch is not None else None
            if blob is not None:
                try:
                    t.life.sketch.load(blob)
                except ValueError as e:
                    raise corrupt(self.path / "data.mdb", f"table {name!r}: {e}") from None

    def _changed_sketches(self) -> dict[str, bytes]:
        """Admission counts are durable at flush, with the step counts: those of tables that
        counted steps since the last flush."""
        return {name: t.life.sketch.counters.tobytes() for name, t in self._tables.items()
                if t.life.sketch is not None and t.life.steps != t.life.durable_steps}

    def _life_meta(self) -> dict:
        """What flush() makes durable of admission and eviction, beside the sketches."""
        return {"steps": {name: t.life.steps for name, t in self._tables.items()},
                "evicted": {name: self._evicted_before.get(name, 0) + t.counters.life.evicted for name, t in self._tables.items()}}


def restore(path: str | Path, dst: str | Path) -> Path:
    """Restore the incremental checkpoint ``path`` (``store.checkpoint(path, incremental=True)``)
    into the new directory ``dst``, which then opens as the store was at ``path``: the chain's
    base copied and every link up to ``path`` replayed (tierstore.engine.chain.restore).
    ``CheckpointChainError`` names a link that is damaged, missing or not its parent's."""
    return chain.restore(path, dst, lambda d: TieredStore(d, device="cpu"))
