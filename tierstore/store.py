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
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from tierstore.eviction import make_policy
from tierstore.io import FORMAT_VERSION, LmdbBackend, WriteBack
from tierstore.io.lmdb_backend import corrupt
from tierstore.metrics import MetricsConfig, MetricsServer, StoreMetrics

from .admission import RowLife
from .counters import LifeCounters, StoreCounters, TableCounters, add_dicts, restored_on_error
from .precision import DTYPES, round_nearest, update_key
from .spec import MAX_ID, TableSpec, initial_rows
from .trace import TraceRecorder
from .prefetch import PrefetchConfig, Prefetcher, PrefetchGroup, PrefetchTicket
from .tiers import CacheTier, by_id, first_uses, last_values

Sizes = int | Mapping[str, int]
_SCRATCH_BYTES = 64 << 20
# misses above which a read plans on a helper thread while it fetches: a handoff
# costs ~0.1 ms, reading 4096 rows from LMDB ~4 ms
_PLAN_ASIDE_ROWS = 4096


@dataclass
class StoreConfig:
    path: Path
    hbm_rows: Sizes = 0
    ddr_rows: Sizes = 0
    policy: str = "lru"
    device: torch.device | None = None
    readonly: bool = False
    map_size: int | None = None
    clock: Callable[[], float] = field(default=time.time)
    eviction: str = "policy"
    writeback_rows: int = 65536
    writeback_group_rows: int = 32768

    def __post_init__(self):
        self.path = Path(self.path)
        for name, meaning in (("writeback_rows", "rows queued for LMDB before a call waits; 0 = wait for every write"),
                              ("writeback_group_rows", "rows the writer gathers into one LMDB commit, at most writeback_rows // 2; 0 = commit each write at once")):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 ({meaning}), got {value!r}")
        if self.eviction not in ("policy", "lookahead"):
            raise ValueError(f"eviction must be 'policy' or 'lookahead' (next use in the prefetch window first), got {self.eviction!r}")
        for name in ("hbm_rows", "ddr_rows"):
            value = getattr(self, name)
            items = value.items() if isinstance(value, Mapping) else [("every table", value)]
            for table, rows in items:
                if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or rows < 0:
                    raise ValueError(f"{name} for {table} must be an int >= 0 (0 = no such tier), got {rows!r}")
        make_policy(self.policy)  # raises on unknown names
        if self.device is None:
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; pass device='cpu'")

    def rows_for(self, name: str, table: str) -> int:
        value = getattr(self, name)
        return int(value.get(table, 0)) if isinstance(value, Mapping) else int(value)


class Resident(NamedTuple):
    """Where the rows of a call are when every one is in a table's top tier."""
    tier: CacheTier
    slots: torch.Tensor  # of each id of the call, on the tier's device
    generation: int  # the tier's, when the slots were taken


class _Plan(NamedTuple):
    """One step of both levels, decided before anything changes (masks over the call's rows)."""
    old_dirty: torch.Tensor  # each call row's dirty bit where cached
    new_freq: torch.Tensor  # its step count after this call
    keep_h: torch.Tensor  # call rows the HBM tier holds after the call
    keep_d: torch.Tensor  # call rows the DDR tier holds after the call
    demote: torch.Tensor  # HBM slots of other rows going down
    e_ids: torch.Tensor  # the demoted rows' ids, use clocks, step counts and dirty bits
    e_last: torch.Tensor
    e_freq: torch.Tensor
    e_dirty: torch.Tensor
    e_drop: torch.Tensor  # positions into the demoted rows that leave the cache
    resident_drop: torch.Tensor  # DDR slots of other rows leaving the cache


def _check_has_values(t: torch.Tensor, what: str, spec: TableSpec) -> None:
    if t.device.type == "meta":
        raise ValueError(f"{what} for table {spec.name!r} are a tensor on the meta device, which holds no values; "
                         "pass a tensor on the CPU or a GPU")


def _where(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rows[mask] (mask on the CPU), without copying when every row is selected."""
    return rows if bool(mask.all()) else rows[mask.to(rows.device)]


class _Table:
    def __init__(self, spec: TableSpec, hbm: CacheTier | None, ddr: CacheTier | None, steps: int = 0):
        self.spec = spec
        self.hbm = hbm
        self.ddr = ddr
        self.counters = TableCounters.new()
        self.life = RowLife(spec.admit_after, spec.admit_width, spec.admit_depth, spec.ttl_steps, steps, spec.evict_l2_below)
        self._scratch = np.empty((0, spec.width), dtype=np.float32)

    def scratch(self, n: int) -> np.ndarray | None:
        """A buffer for the rows one read fetches from LMDB, reused by the next
        read: a fresh one page-faults on every call (10-20 ms per 32 MiB here).
        None above _SCRATCH_BYTES, so one huge call does not pin its size."""
        if n * self.spec.width * 4 > _SCRATCH_BYTES:
            return None
        if len(self._scratch) < n:
            self._scratch = np.empty((n, self.spec.width), dtype=np.float32)
        return self._scratch[:n]


class TieredStore:
    """Embedding rows by id, cached in HBM and DDR tiers over LMDB.

    ``TieredStore(path, tables=[TableSpec(...)], hbm_rows=..., ddr_rows=...)``
    creates or opens a store; ``TieredStore(path)`` reopens one with the table
    specs it has stored. ``hbm_rows``/``ddr_rows`` are per table (an int for
    every table or a {table: rows} dict); 0 means no such tier.
    ``tierstore.open_store(path, daemon=SOCK, ...)`` attaches to a
    ``tierstore prefetchd`` instead (tierstore.client.DaemonStore, the same API).
    """

    def __init__(
        self,
        path: str | Path,
        tables: Sequence[TableSpec] | None = None,
        hbm_rows: Sizes = 0,
        ddr_rows: Sizes = 0,
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
        writeback_rows: int = 65536,
        writeback_group_rows: int = 32768,
        daemon: None = None,
        claim: Sequence[str] = (),
    ):
        if daemon is not None:
            raise TypeError(f"TieredStore is the embedded store; attach to the `tierstore prefetchd` at {daemon} with "
                            "tierstore.open_store(path, daemon=SOCK, ...)")
        if claim:
            raise ValueError(f"claim={list(claim)} only applies to a client of `tierstore prefetchd` "
                             "(tierstore.open_store(path, daemon=SOCK, claim=...)); an embedded store is its tables' only writer")
        self.config = StoreConfig(path, hbm_rows, ddr_rows, policy, device, readonly, map_size, clock, eviction, writeback_rows, writeback_group_rows)
        # metrics: exported to registry (default: prometheus_client's global one) under
        # the label name (default: the resolved path); metrics_port starts an endpoint
        metrics_config = MetricsConfig(registry, name, metrics_port, metrics_addr)
        self.path = self.config.path
        self.device = self.config.device
        self.readonly = readonly
        self._lock = threading.RLock()
        # All-resident reads gather outside the lock, so that several readers
        # (the daemon's clients) gather at once. Whoever overwrites tier rows
        # first waits, holding the lock, until no such gather is in flight;
        # holding it means no new one starts meanwhile.
        self._gathers = 0
        self._gathers_done = threading.Condition(threading.Lock())
        self._use_clock = 0
        self._closed = False
        # without tables= nothing is created: a mistyped path fails, leaving nothing behind
        self._backend = LmdbBackend(self.path, readonly=readonly, map_size=map_size, create=bool(tables))
        # every LMDB row write goes through this queue and its one writer thread
        self._writeback = WriteBack(self._backend, self._lock, self.config.writeback_rows, self.config.writeback_group_rows,
                                    on_swept=self._count_swept)
        self._plan_pool: futures.ThreadPoolExecutor | None = None
        self._recorder = None  # record_trace: every read call goes to a trace (tierstore.trace)
        try:
            specs = self._reconcile_specs(list(tables or []))
            if record_trace is not None:
                self._recorder = TraceRecorder(record_trace, specs.values())
            for name in ("hbm_rows", "ddr_rows"):
                value = getattr(self.config, name)
                if isinstance(value, Mapping) and set(value) - set(specs):
                    raise KeyError(f"{name} names unknown tables {sorted(set(value) - set(specs))}; tables are {sorted(specs)}")
            meta = self._backend.read_meta()
            steps = meta.get("steps", {})
            self._tables = {name: self._make_table(spec, steps.get(name, 0)) for name, spec in specs.items()}
            self._evicted_before: dict[str, int] = dict(meta.get("evicted", {}))  # over the store's life, at the last flush
            self._load_sketches()
            self._counters = StoreCounters(last_flush=meta.get("last_flush"))
            self._updates: dict[str, int] = dict(meta.get("updates", {}))  # per table, for _update_key
            self.metrics = StoreMetrics(self, metrics_config)
            self._prefetcher = Prefetcher(self, prefetch or PrefetchConfig())
        except BaseException:
            if getattr(self, "metrics", None) is not None:
                self.metrics.close()  # frees the store's label and endpoint
            self._backend.close()
            if self._recorder is not None:
                self._recorder.close()
            raise

    # -- opening -------------------------------------------------------------------
    def _reconcile_specs(self, given: list[TableSpec]) -> dict[str, TableSpec]:
        meta = self._backend.read_meta()
        if meta and meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{self.path} has store format {meta.get('format')}, this tierstore reads {FORMAT_VERSION}")
        try:
            stored = {d["name"]: TableSpec.from_json(d) for d in meta.get("tables", [])}
        except (TypeError, KeyError, ValueError) as e:
            raise corrupt(self.path / "data.mdb", f"its table specs are unreadable ({type(e).__name__}: {e})") from None
        names = [s.name for s in given]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in tables=: {names}")
        for spec in given:
            old = stored.get(spec.name)
            if old is None:
                continue
            for f in dataclasses.fields(TableSpec):
                if getattr(old, f.name) != getattr(spec, f.name):
                    raise ValueError(
                        f"table {spec.name!r}: {f.name}={getattr(spec, f.name)!r} contradicts the stored "
                        f"{f.name}={getattr(old, f.name)!r}; open without tables= to use the stored specs"
                    )
        new = [s for s in given if s.name not in stored]
        if new and self.readonly:
            raise ValueError(f"tables {[s.name for s in new]} are not in the store and it is open readonly")
        specs = {**stored, **{s.name: s for s in new}}
        if not specs:
            raise ValueError(f"{self.path} holds no tables; pass tables=[tierstore.TableSpec(...)] to create them")
        if not meta or new:
            self._backend.write_meta({"format": FORMAT_VERSION, "tables": [s.to_json() for s in specs.values()]})
        return specs

    def _make_table(self, spec: TableSpec, steps: int = 0) -> _Table:
        self._backend.open_table(spec.name, spec.dim, spec.state_dim, spec.dtype, last_use=spec.ttl_steps is not None)
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
        return _Table(spec, *tiers, steps=steps)

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
            raise TypeError(f"with_state must be True or False, got {with_state!r}")
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

    @contextlib.contextmanager
    def _resident(self, table: str, ids: torch.Tensor, admit: bool = False) -> Iterator[Resident | None]:
        """A module's forward: when every id (int64, in range) is in the top tier,
        or, with ``admit``, once the use has brought them all there (unless the
        call has more rows than the tier holds), count the use exactly as
        ``read(table, ids)`` would and yield where the rows are, held steady
        (calls that would overwrite tier rows wait) while the caller computes
        from ``hit.tier.weights``; else yield None, having changed nothing, and
        the caller reads."""
        with self._lock:
            self._check_open()
            t = self._table(table)
            self._reap()
            self._prefetcher.check(table)
            hit = None
            if len(ids):
                hit = self._use_top_tier(t, ids) or (self._admit(t, ids) if admit else None)
            if hit is not None:
                self._gathers += 1
        if hit is None:
            yield None
            return
        try:
            yield hit
        finally:
            self._gather_done()

    def _update_resident(self, table: str, slots: torch.Tensor, generation: int, update: Callable[[CacheTier], None]) -> bool:
        """A module's backward: ``update(top tier)`` changes the rows at ``slots`` in
        place (their weights and state), which are then dirty, as after a
        ``write(..., with_state=True)`` of the updated rows, if no slot of the tier
        changed owner since ``generation``. Returns False, having changed nothing,
        if a slot did."""
        with self._lock:
            t = self._table_to_write(table)
            top = t.hbm or t.ddr
            if top is None or top.generation != generation:
                return False
            self._await_gathers()
            update(top)
            top.dirty.index_fill_(0, slots, True)  # slots may repeat: cheaper than index_put
            return True

    def _update_key(self, table: str) -> int:
        """Key of the next update of a table's rows (tierstore.precision): counts
        the table's updates, a count that flush() makes durable."""
        count = self._updates.get(table, 0)
        self._updates[table] = count + 1
        return update_key(table, count)

    def _admit(self, t: _Table, ids: torch.Tensor) -> Resident | None:
        """A read of ids through the tiers that leaves every row in the top tier,
        returning where they are; None, having changed nothing, when the call has
        more rows than the top tier holds. The step and its bookkeeping are the
        read's; only the rows are not copied out (the caller computes in place,
        and its backward updates them there)."""
        start = time.perf_counter()
        top = t.hbm or t.ddr
        if top is None:
            return None
        uid, inverse, first = first_uses(ids.cpu())
        if len(uid) > top.capacity:
            return None
        t.counters.latency.observe("dedupe", time.perf_counter() - start)
        source, slots, _ = self._step(t, ids, uid, first)
        if source is not top:
            slots = top.lookup(uid)
        t.counters.latency.observe("total", time.perf_counter() - start)
        return Resident(top, slots.index_select(0, inverse.to(slots.device)), top.generation)

    def _step(self, t: _Table, ids: torch.Tensor, uid: torch.Tensor, first: torch.Tensor):
        """A read's step through the tiers for ids (sorted unique ``uid``, each at
        its ``first`` position in the call): traced, counted, clocked; _access's result."""
        if self._recorder is not None:
            self._recorder.record(t.spec.name, ids)
        if t.life.active:
            result = self._lived_access(t, uid, first + self._use_clock)
        else:
            with restored_on_error([t.counters]):
                result = self._access(t, uid, first + self._use_clock)
        self._use_clock += len(ids)
        self._prefetcher.consumed(t.spec.name, uid, sorted_unique=True)
        return result

    def _use_top_tier(self, t: _Table, ids: torch.Tensor) -> Resident | None:
        """When every id is in the top tier: count the use (ids in call order, a
        repeated row at its first position) and return where the rows are."""
        top = t.hbm or t.ddr
        if top is None or t.life.active:  # admission and TTL work on the step's unique ids: _step
            return None
        slots = top.lookup(ids)
        if not bool((slots >= 0).all()):
            return None
        if self._recorder is not None:
            self._recorder.record(t.spec.name, ids)
        (t.counters.hbm if top is t.hbm else t.counters.ddr).hits += top.use_resident(slots, self._use_clock)
        self._use_clock += len(ids)
        self._prefetcher.consumed(t.spec.name, ids)
        return Resident(top, slots, top.generation)

    def _gather_done(self) -> None:
        with self._gathers_done:
            self._gathers -= 1
            self._gathers_done.notify_all()

    def _await_gathers(self) -> None:
        """Called with the lock held before tier rows are overwritten."""
        with self._gathers_done:
            self._gathers_done.wait_for(lambda: self._gathers == 0)

    def _read_locked(self, table: str, ids, with_state: bool, out: torch.Tensor | None):
        """read() under the lock: the rows, or, when every id is in the top tier,
        what the caller needs to gather them outside the lock."""
        self._check_open()
        t = self._table(table)
        self._reap()
        self._prefetcher.check(table)  # a background failure nobody waited for surfaces here
        start = time.perf_counter()  # stage timings: one observation per call and stage, never per id
        ids = self._as_ids(t.spec, ids)
        cols = t.spec.width if with_state else t.spec.dim
        n = len(ids)
        self._check_out(out, n, cols)
        if n == 0:
            return out if out is not None else torch.empty((0, cols), dtype=torch.float32, device=self.device)
        hit = self._use_top_tier(t, ids)  # fast path: no dedupe is needed
        if hit is not None:
            return hit, cols, t.counters.latency, start
        mark = time.perf_counter()
        uid, inverse, first = first_uses(ids.cpu())
        t.counters.latency.observe("dedupe", time.perf_counter() - mark)
        source, slots, rows = self._step(t, ids, uid, first)
        if source is not None:  # every row in one tier
            result = self._gather_tier(source, slots.index_select(0, inverse.to(slots.device)), cols, out)
        else:
            result = self._gather(rows, inverse.to(rows.device), cols, out)
        t.counters.latency.observe("total", time.perf_counter() - start)
        return result

    def _check_out(self, out: torch.Tensor | None, n: int, cols: int) -> None:
        if out is not None and (tuple(out.shape) != (n, cols) or out.dtype != torch.float32 or out.device != self.device):
            raise ValueError(f"out must be a float32 tensor of shape ({n}, {cols}) on {self.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")

    def _gather_tier(self, tier: CacheTier, slots: torch.Tensor, cols: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return tier.gather(slots, cols).to(self.device, non_blocking=True)
        if out.device != tier.device:
            return out.copy_(tier.gather(slots, cols), non_blocking=True)
        return tier.gather(slots, cols, out)

    def _gather(self, rows: torch.Tensor, index: torch.Tensor, cols: int, out: torch.Tensor | None) -> torch.Tensor:
        src = rows if cols == rows.shape[1] else rows[:, :cols]
        if out is None:
            return src.index_select(0, index).to(self.device, non_blocking=True)
        if src.device == out.device:
            return torch.index_select(src, 0, index, out=out)
        return out.copy_(src.index_select(0, index), non_blocking=True)

    def write(self, table: str, ids, values, with_state: bool = False) -> None:
        """Set rows; for an id repeated in one call the last value wins.

        ``values`` is [len(ids), dim], or [len(ids), dim + state_dim] with
        ``with_state=True``; without it, a row's state is kept.
        """
        with self._lock:
            t = self._table_to_write(table)
            ids = self._as_ids(t.spec, ids)
            cols = t.spec.width if with_state else t.spec.dim
            values = self._as_values(t.spec, values, len(ids), cols)
            if len(ids) == 0:
                return
            uid, values = last_values(ids.cpu(), values)
            with restored_on_error([t.counters]):
                self._write_unique(t, uid, values, cols)

    def prefetch(self, table: str, ids) -> PrefetchTicket:
        """Start bringing the rows of ``ids`` up in the background; returns at once.

        The ticket's ``wait()`` raises a failure (a bad id, an LMDB error) as the
        read itself would, naming the batch; ``release()`` unpins rows the batch did not read (a read
        that covers the ticket's ids releases it too). See tierstore/prefetch.py.
        """
        with self._lock:
            self._check_open()
            self._reap()
            return self._prefetcher.prefetch(table, ids)

    def _prefetch_batch(self, reads: Mapping[str, torch.Tensor]) -> PrefetchGroup | None:
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

    def _report_step(self, seconds: float) -> None:
        """A LookaheadLoader's batch took the trainer this long: it sizes the prefetch reads."""
        with self._lock:
            self._prefetcher.trainer_step(seconds)

    def _report_depth(self, effective_depth: int, shrunk_steps: int) -> None:
        """A LookaheadLoader's depth, for stats and metrics."""
        for t in self._tables.values():
            t.counters.prefetch.effective_depth = effective_depth
            t.counters.prefetch.shrunk_steps = shrunk_steps

    def prefetch_stats(self) -> dict:
        """Prefetch state now: fetches in flight, staged rows, announced batches,
        and per table the prefetch counters (effective depth among them)."""
        with self._lock:
            state = self._prefetcher.state()
            state["tables"] = {n: dataclasses.asdict(t.counters.prefetch) for n, t in self._tables.items()}
            return state

    def flush(self) -> None:
        """Return once every dirty row is durable in LMDB (survives kill -9 and power loss)."""
        with self._lock:
            self._check_open()
            if self.readonly:
                return
            start = time.perf_counter()
            self._writeback.retry()
            batches = []
            for name, t in self._tables.items():
                ids, rows = [], []
                for tier in (t.hbm, t.ddr):
                    if tier is None:
                        continue
                    slots = tier.dirty_slots()
                    if len(slots):
                        ids.append(tier.ids[slots].cpu())
                        rows.append(tier.gather(slots).cpu())
                        tier.dirty[slots] = False  # the queue holds their values now, and keeps them until committed
                if ids:
                    batches.append((name, *by_id(torch.cat(ids), torch.cat(rows))))
            now = self.config.clock()
            self._queue_write(batches, meta={"last_flush": now, "updates": dict(self._updates), **self._life_meta()})
            self._reap(drain=True)
            self._store_sketches()
            self._backend.sync()
            sc = self._counters
            sc.flushes += 1
            sc.last_flush = now
            sc.flush_latency.observe("flush", time.perf_counter() - start)

    def checkpoint(self, path: str | Path, compact: bool = True) -> Path:
        """Flush, then copy the LMDB environment into the new directory ``path``:
        a consistent snapshot that opens as a store (``TieredStore(path)``), which
        is how it is restored. The store stays open; training can go on."""
        with self._lock:
            self.flush()
            return self._backend.copy_to(path, compact=compact)

    @staticmethod
    def compact(path: str | Path) -> tuple[int, int]:
        """Rewrite the store at ``path``, closed everywhere, without LMDB's free pages
        (a crash leaves the old file or the new, whole); returns data.mdb's bytes
        before and after. An open store's checkpoint() is compact already."""
        return LmdbBackend(path, create=False).compact()

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
                if self._plan_pool is not None:
                    self._plan_pool.shutdown()
                self._backend.close()
                if self._recorder is not None:
                    self._recorder.close()
                self._tables.clear()
                self.metrics.close()  # leave the registry, stop the endpoints

    def serve_metrics(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve this store's registry over HTTP at http://addr:port/metrics until
        close(); port=0 binds a free port (the returned server's ``.port``)."""
        self._check_open()
        return self.metrics.serve(port, addr)

    def stats(self, per_table: bool = False) -> dict:
        """Cumulative counts: {"hbm": {hits, misses, evictions, writebacks}, "ddr": {...},
        "ssd": {reads, writes, read_bytes, write_bytes}}; per table with per_table=True."""
        with self._lock:
            each = {name: t.counters.as_dict() for name, t in self._tables.items()}
            self._add_row_stats(each)
        if per_table:
            return each
        total = {**TableCounters.new().as_dict(), "rows": {"stored": 0, **dataclasses.asdict(LifeCounters())}}
        for d in each.values():
            total = add_dicts(total, d)
        return total

    def resident_rows(self, table: str) -> dict[str, int]:
        t = self._table(table)
        return {"hbm": t.hbm.resident if t.hbm else 0, "ddr": t.ddr.resident if t.ddr else 0}

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TieredStore({str(self.path)!r}, tables={sorted(self._tables)}, policy={self.config.policy!r}, device={str(self.device)!r})"

    # -- validation --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"store {self.path} is closed")

    def _table_to_write(self, name: str) -> _Table:
        """The table a write goes to, under the lock; raises first if none may."""
        self._check_open()
        if self.readonly:
            raise PermissionError(f"store {self.path} is open readonly; reopen without readonly=True to write")
        t = self._table(name)
        self._reap()
        return t

    def _table(self, name: str) -> _Table:
        try:
            return self._tables[name]
        except KeyError:
            raise KeyError(f"unknown table {name!r}; the store has tables {sorted(self._tables)}") from None

    @staticmethod
    def _as_ids(spec: TableSpec, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise TypeError(f"ids for table {spec.name!r} must be integers, got a tensor of {ids.dtype}")
            _check_has_values(ids, "ids", spec)
            t = ids.detach()
            if t.dtype == torch.uint64 and t.numel():  # torch casts ids >= 2**63 to negative int64s
                wrapped = t.view(torch.int64)
                if bool((wrapped < 0).any()):
                    big = int(wrapped[wrapped < 0].max()) + (1 << 64)
                    raise IndexError(f"id {big} out of range for table {spec.name!r} (ids are < 2**63)")
        else:
            arr = np.asarray(ids)
            if arr.size == 0:
                arr = arr.astype(np.int64)
            if arr.dtype.kind not in "iu":
                raise TypeError(f"ids for table {spec.name!r} must be integers, got {arr.dtype}")
            if arr.dtype == np.uint64 and arr.size and arr.max() > MAX_ID:
                raise IndexError(f"id {int(arr.max())} out of range for table {spec.name!r} (ids are < 2**63)")
            # a read-only array (a memory-mapped trace, np.frombuffer) is copied: torch tensors
            # are always writable, and torch warns when it must share an array that is not
            t = torch.from_numpy(arr.astype(np.int64, copy=not arr.flags.writeable))
        if t.dim() != 1:
            raise ValueError(f"ids for table {spec.name!r} must be 1-D, got shape {tuple(t.shape)}")
        t = t.to(dtype=torch.int64)  # stays on its device: on CUDA the HBM probe runs there
        if len(t):
            lo, hi = int(t.min()), int(t.max())
            if lo < 0:
                raise IndexError(f"id {lo} is negative for table {spec.name!r}; ids must be >= 0")
            if spec.num_rows is not None and hi >= spec.num_rows:
                raise IndexError(f"id {hi} out of range for table {spec.name!r} with num_rows={spec.num_rows}")
        return t

    @staticmethod
    def _as_values(spec: TableSpec, values, n: int, cols: int) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            _check_has_values(values, "values", spec)
            v = values.detach()
        else:
            arr = np.asarray(values)
            if arr.dtype.kind not in "fiu":
                raise TypeError(f"values for table {spec.name!r} must be floating point, got {arr.dtype}")
            v = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # as ids above
        if v.dtype.is_complex or not (v.dtype.is_floating_point or v.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"values for table {spec.name!r} must be floating point, got {v.dtype}")
        if tuple(v.shape) != (n, cols):
            raise ValueError(f"values for table {spec.name!r} must have shape ({n}, {cols}), got {tuple(v.shape)}")
        v = v.to(device="cpu", dtype=torch.float32)
        if spec.dtype != "float32":  # a new tensor: the caller's is not changed
            v = torch.cat([round_nearest(v[:, : spec.dim], spec.dtype), v[:, spec.dim:]], dim=1)
        return v

    # -- the data path ----------------------------------------------------------------------
    def _fetch(self, t: _Table, ids: torch.Tensor, out: np.ndarray | None = None) -> torch.Tensor:
        """Rows of ids (sorted) not in any tier: prefetched into staging, else queued
        for LMDB (newest first), else from LMDB, initial values for rows never
        written. Into ``out`` when given."""
        ids_np = ids.numpy()
        rows = np.empty((len(ids_np), t.spec.width), dtype=np.float32) if out is None else out
        cold = ~self._prefetcher.take(t.spec.name, ids, torch.from_numpy(rows))  # staged rows are the newest
        if cold.any():
            where = np.flatnonzero(cold)
            queued, queued_rows = self._writeback.lookup(t.spec.name, ids_np[where])
            if queued_rows is not None:
                rows[where[queued]] = queued_rows
                cold[where[queued]] = False
        cold_ids = ids_np[cold]
        if len(cold_ids):
            mark = time.perf_counter()
            all_cold = len(cold_ids) == len(ids_np)
            cold_rows = self._fill_unwritten(t, cold_ids, *self._backend.get_rows(t.spec.name, cold_ids, rows if all_cold else None))
            t.counters.latency.observe("ssd_read", time.perf_counter() - mark)
            if not all_cold:
                rows[cold] = cold_rows
        if t.life.resets:
            self._expire_fetched(t, ids_np, rows)
        return torch.from_numpy(rows)

    def _fill_unwritten(self, t: _Table, ids: np.ndarray, rows: np.ndarray, found: np.ndarray) -> np.ndarray:
        """Give rows LMDB does not hold their initial values, and count the read."""
        if not found.all():
            rows[~found] = initial_rows(t.spec, ids[~found])
        t.counters.ssd.count_reads(len(ids), int(found.sum()), t.spec.row_bytes)
        return rows

    def _next_use(self, t: _Table, *parts: tuple[CacheTier, torch.Tensor]) -> np.ndarray | None:
        """Next use in the prefetch window of the rows at these (tier, slots), in
        order; None without a window."""
        per_slot = [self._prefetcher.next_use(t.spec.name, tier) for tier, _ in parts]
        if per_slot[0] is None:
            return None
        return np.concatenate([nu[slots.cpu().numpy()] for nu, (_, slots) in zip(per_slot, parts)])

    def _queue_write(self, batches, meta=None) -> None:
        """Every LMDB row write starts here, and is counted here: counts do not
        depend on when the writer thread commits."""
        last = {name: self._last_use_to_store(self._tables[name], ids)
                for name, ids, _ in batches if self._tables[name].life.ttl_steps is not None}
        self._writeback.submit(batches, meta, last)
        for name, ids, _ in batches:
            t = self._tables[name]
            t.counters.ssd.count_writes(len(ids), t.spec.row_bytes)
            self._prefetcher.written(name, ids)  # staged copies are older now

    def _reap(self, drain: bool = False) -> None:
        """Account for committed write-backs; raise a failed one (the call then changes nothing)."""
        try:
            if drain:
                self._writeback.drain()
            else:
                self._writeback.reap()
        except Exception as e:
            raise OSError(
                f"writing rows to {self.path} failed ({e}); nothing was lost: the rows stay queued in memory, "
                "and flush() retries once the cause (often a full disk) is fixed"
            ) from e

    def _access(self, t: _Table, uid: torch.Tensor, use_clock: torch.Tensor, refresh: torch.Tensor | None = None):
        """Serve one step's unique ids and apply the policy.

        Returns (tier, slots, None) when every row is in that one tier now, else
        (None, None, rows) with rows [len(uid), width] on the HBM device.
        ``refresh``: rows whose last-use step must reach LMDB even if clean (TTL).
        """
        H, D = t.hbm, t.ddr
        n = len(uid)
        c = t.counters
        mark = time.perf_counter()
        slot_h = H.lookup(uid).cpu() if H else torch.full((n,), -1, dtype=torch.int64)
        in_h = slot_h >= 0
        n_h = int(in_h.sum())
        if H:
            c.hbm.hits += n_h
            c.hbm.misses += n - n_h
            c.latency.observe("hbm", time.perf_counter() - mark)
        if n_h == n:
            H.touch(slot_h, use_clock)
            return H, slot_h.to(H.device), None

        slot_d = torch.full((n,), -1, dtype=torch.int64)
        if D:
            mark = time.perf_counter()
            rest = torch.nonzero(~in_h).squeeze(1)
            slot_d[rest] = D.lookup(uid[rest])
        in_d = slot_d >= 0
        n_d = int(in_d.sum())
        if D:
            c.ddr.hits += n_d
            c.ddr.misses += n - n_h - n_d
            c.latency.observe("ddr", time.perf_counter() - mark)
            if n_d == n and H is None:
                D.touch(slot_d, use_clock)
                return D, slot_d, None

        if (H is None) != (D is None):
            tier, slot, hit = (H, slot_h, in_h) if D is None else (D, slot_d, in_d)
            if n <= tier.capacity:
                return self._access_one_tier(t, tier, uid, use_clock, slot, hit)

        miss = torch.nonzero(~in_h & ~in_d).squeeze(1)
        plan, fetched = self._fetch_while_planning(t, uid[miss], lambda: self._plan(t, use_clock, slot_h, in_h, slot_d, in_d))
        old_dirty, new_freq, keep_h, keep_d, demote, e_ids, e_last, e_freq, e_dirty, e_drop, resident_drop = plan
        demote_dev = demote.to(H.device) if H else demote

        dev = H.device if H else torch.device("cpu")
        fetched = (fetched.pin_memory() if dev.type == "cuda" else fetched).to(dev, non_blocking=True)
        if len(miss) == n:  # all cold: the fetched rows are the call's rows, in uid order
            rows = fetched
        else:
            rows = torch.empty((n, t.spec.width), dtype=torch.float32, device=dev)
            if n_h:
                rows[in_h] = H.gather(slot_h[in_h].to(dev))
            if n_d:
                rows[in_d.to(dev)] = D.gather(slot_d[in_d]).to(dev)
            rows[miss.to(dev)] = fetched
        everyone = torch.arange(n)
        leave = everyone[~keep_h & ~keep_d]  # call rows leaving the cache after this call

        # write back dirty rows that leave the cache
        wb_ids, wb_rows = [], []
        if len(leave):
            dirty = leave[(old_dirty if refresh is None else old_dirty | refresh)[leave]]
            wb_ids.append(uid[dirty])
            wb_rows.append(rows[dirty.to(dev)].cpu())
        if len(e_drop):
            dirty = e_drop[e_dirty[e_drop]]
            wb_ids.append(e_ids[dirty])
            wb_rows.append(H.gather(demote[dirty].to(H.device)).cpu())
        if len(resident_drop):
            dirty = resident_drop[D.dirty[resident_drop]]
            wb_ids.append(D.ids[dirty])
            wb_rows.append(D.gather(dirty))
        n_wb = sum(len(i) for i in wb_ids)
        if n_wb:
            self._queue_write_back(t, *by_id(torch.cat(wb_ids), torch.cat(wb_rows)))

        # -- commit the plan (in memory only; cannot fail half-way) --
        self._await_gathers()
        if H:
            e_survive = torch.ones(len(demote), dtype=torch.bool)
            e_survive[e_drop] = False
            e_rows = H.gather(demote_dev[e_survive.to(H.device)]).cpu() if D else None
            leaving_h = torch.cat([demote, slot_h[in_h & ~keep_h]])
            H.remove(leaving_h.to(H.device))
            c.hbm.evictions += len(leaving_h)
            stay = in_h & keep_h
            H.touch(slot_h[stay], use_clock[stay], new_freq[stay])
            enter = ~in_h & keep_h
            H.add(uid[enter], _where(rows, enter), use_clock[enter], new_freq[enter], old_dirty[enter])
        if D:
            leaving_d = torch.cat([slot_d[in_d & ~keep_d], resident_drop])
            D.remove(leaving_d)
            c.ddr.evictions += int((in_d & ~keep_d & ~keep_h).sum()) + len(resident_drop) + len(e_drop)
            stay = in_d & keep_d
            D.touch(slot_d[stay], use_clock[stay], new_freq[stay])
            enter = ~in_d & keep_d
            D.add(uid[enter], _where(rows, enter).cpu(), use_clock[enter], new_freq[enter], old_dirty[enter])
            if H and e_survive.any():
                D.add(e_ids[e_survive], e_rows, e_last[e_survive], e_freq[e_survive], e_dirty[e_survive])
            c.ddr.writebacks += n_wb
        elif H:
            c.hbm.writebacks += n_wb
        return None, None, rows

    def _access_one_tier(self, t: _Table, T: CacheTier, uid: torch.Tensor, use_clock: torch.Tensor,
                         slot: torch.Tensor, hit: torch.Tensor):
        """_access where one tier, with none below it, takes every row of the call:
        the fetched rows go straight into it, and the output is gathered from it.
        A quarter of the tensor ops of the two-level plan, which for the few
        thousand rows of a prefetched step cost more than the rows themselves."""
        c = t.counters.hbm if T is t.hbm else t.counters.ddr
        miss = torch.nonzero(~hit).squeeze(1)
        hit_slots = slot[hit]
        new_freq = T.counts_after(slot, hit)

        def plan() -> tuple[torch.Tensor, torch.Tensor]:
            return T.make_room(hit_slots, len(miss), use_clock, new_freq, lambda cand: self._next_use(t, (T, cand)))

        (keep, evict), fetched = self._fetch_while_planning(t, uid[miss], plan)
        fetched = (fetched.pin_memory() if T.device.type == "cuda" else fetched).to(T.device, non_blocking=True)
        evict_dev = evict.to(T.device)
        dirty = evict_dev[T.dirty[evict_dev]]
        self._queue_write_back(t, *T.rows_by_id(dirty))

        # -- commit (in memory only; cannot fail half-way) --
        self._await_gathers()
        added, left = T.apply_step(uid, slot, hit, keep, evict, fetched, use_clock, new_freq)
        c.evictions += left
        c.writebacks += len(dirty)
        if len(miss) == len(uid):  # all cold: the fetched rows are contiguous, faster to gather from
            return None, None, fetched
        slots = slot.to(T.device)
        slots[miss.to(T.device)] = added
        return T, slots, None

    def _queue_write_back(self, t: _Table, ids: np.ndarray, rows: np.ndarray) -> None:
        """Queue dirty rows leaving the cache (sorted by id) for LMDB."""
        if len(ids):
            mark = time.perf_counter()
            self._queue_write([(t.spec.name, ids, rows)])
            t.counters.latency.observe("writeback", time.perf_counter() - mark)

    def _fetch_while_planning(self, t: _Table, ids: torch.Tensor, plan: Callable[[], object]) -> tuple[object, torch.Tensor]:
        """``plan()`` and the rows of ids not cached. A plan needs no fetched row:
        for a long fetch it is made on a helper thread while this one reads LMDB
        (both release the GIL in their C calls)."""
        if len(ids) < _PLAN_ASIDE_ROWS:
            return plan(), self._fetch(t, ids, t.scratch(len(ids)))
        planned = self._planner().submit(plan)
        try:
            fetched = self._fetch(t, ids, t.scratch(len(ids)))
        finally:
            futures.wait([planned])  # never leave it reading tiers that a later call changes
        return planned.result(), fetched

    def _planner(self) -> futures.ThreadPoolExecutor:
        if self._plan_pool is None:
            self._plan_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="tierstore-plan")
        return self._plan_pool

    def _plan(self, t: _Table, use_clock: torch.Tensor, slot_h: torch.Tensor, in_h: torch.Tensor,
              slot_d: torch.Tensor, in_d: torch.Tensor) -> "_Plan":
        """Plan one step of both levels, changing nothing, so that a failed fetch
        or write-back leaves the store exactly as it was."""
        H, D = t.hbm, t.ddr
        n = len(use_clock)
        old_freq = torch.zeros(n, dtype=torch.int64)
        old_dirty = torch.zeros(n, dtype=torch.bool)
        for tier, slot, inside in ((H, slot_h, in_h), (D, slot_d, in_d)):
            if tier is not None and bool(inside.any()):
                s = slot[inside].to(tier.device)
                old_freq[inside] = tier.freq[s].cpu()
                old_dirty[inside] = tier.dirty[s].cpu()
        new_freq = old_freq + 1

        everyone = torch.arange(n)
        if H:  # demote: HBM slots of non-call rows going down
            keep_h, demote = H.make_room(slot_h[in_h], n - int(in_h.sum()), use_clock, new_freq, lambda cand: self._next_use(t, (H, cand)))
        else:
            keep_h, demote = torch.zeros(n, dtype=torch.bool), torch.empty(0, dtype=torch.int64)
        down = everyone[~keep_h]  # call rows below HBM
        demote_dev = demote.to(H.device) if H else demote
        e_ids = H.ids[demote_dev].cpu() if H else demote
        e_last = H.last[demote_dev].cpu() if H else demote
        e_freq = H.freq[demote_dev].cpu() if H else demote
        e_dirty = H.dirty[demote_dev].cpu() if H else demote.bool()

        keep_d = torch.zeros(n, dtype=torch.bool)
        resident_drop = torch.empty(0, dtype=torch.int64)  # DDR slots of non-call rows leaving
        e_drop = torch.arange(len(demote))  # positions into the demoted rows that leave the cache
        if D:
            keep_d[down] = True
            if len(down) > D.capacity:
                over = D.policy.select(use_clock[down].numpy(), new_freq[down].numpy(), len(down) - D.capacity)
                keep_d[down[torch.from_numpy(over)]] = False
            others = D.occupied_except(slot_d[in_d])
            k = len(others) + len(demote) - (D.capacity - int(keep_d.sum()))
            e_drop = e_drop[:0]
            if k > 0:
                v = D.pick_victims(torch.cat([D.last[others], e_last]), torch.cat([D.freq[others], e_freq]), k,
                                   self._next_use(t, (D, others), *([(H, demote)] if H else [])))
                resident_drop = others[v[v < len(others)]]
                e_drop = v[v >= len(others)] - len(others)
        return _Plan(old_dirty, new_freq, keep_h, keep_d, demote, e_ids, e_last, e_freq, e_dirty, e_drop, resident_drop)

    def _cached(self, t: _Table, uid: torch.Tensor) -> tuple[list[tuple[CacheTier, torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Where the rows of ``uid`` are cached: ([(tier, slots, positions in uid)] for each
        tier, slots and positions on the CPU), and the mask of the ids some tier holds."""
        placed = torch.zeros(len(uid), dtype=torch.bool)
        targets = []
        for tier in (t.hbm, t.ddr):
            if tier is None:
                continue
            todo = torch.nonzero(~placed).squeeze(1)
            slot = tier.lookup(uid[todo]).cpu()
            hit = slot >= 0
            targets.append((tier, slot[hit], todo[hit]))
            placed[todo[hit]] = True
        return targets, placed

    def _write_unique(self, t: _Table, uid: torch.Tensor, values: torch.Tensor, cols: int) -> None:
        n = len(uid)
        targets, placed = self._cached(t, uid)
        cold = torch.nonzero(~placed).squeeze(1)
        if len(cold):  # not cached: straight to LMDB (durable at the next flush)
            if cols == t.spec.width:
                rows = values[cold]
            else:
                rows = self._fetch(t, uid[cold])
                rows[:, :cols] = values[cold]
            self._queue_write([(t.spec.name, uid[cold].numpy(), rows.numpy())])
        self._await_gathers()
        for tier, slot, pos in targets:
            s = slot.to(tier.device)
            if t.life.resets:
                self._revive_cached(t, tier, s)
            tier.put(s, values if len(pos) == n else values[pos], cols)  # all in one tier: no gather
            tier.dirty[s] = True

    # -- unbounded id spaces: admission and TTL (README "Unbounded id spaces") --------------
    def _lived_access(self, t: _Table, uid: torch.Tensor, use_clock: torch.Tensor):
        """_access for a table with admission or TTL: the step is counted (the sketch,
        the step number), rows idle too long read as initial, and with TTL the rows
        the step may keep are marked dirty, so that their last-use step reaches
        LMDB. A failure takes the count back."""
        life, c = t.life, t.counters
        uid_np = uid.numpy()
        admitted = life.begin_step(uid_np, self._use_clock)
        # a readonly store writes nothing: its reads follow the rule but keep no last-use steps
        refresh = torch.from_numpy(admitted) if life.ttl_steps is not None and not self.readonly else None
        try:
            with restored_on_error([c]):
                if life.resets:
                    for tier, slots, _ in self._cached(t, uid)[0]:
                        self._expire_cached(t, tier, slots.to(tier.device))
                result = self._access(t, uid, use_clock, refresh)
                if refresh is not None:
                    self._mark_dirty(t, uid[refresh])
        except BaseException:
            life.abort_step()
            raise
        life.end_step()
        if life.sketch is not None:
            c.life.admitted += int(admitted.sum())
            c.life.rejected += len(uid_np) - int(admitted.sum())
        cutoff = life.sweep_cutoff()
        if not self.readonly and ((cutoff is not None and cutoff >= 0) or life.l2_below is not None):
            self._writeback.sweeps[t.spec.name] = (cutoff, life.l2_below)
        return result

    def _mark_dirty(self, t: _Table, ids: torch.Tensor) -> None:
        for tier, slots, _ in self._cached(t, ids)[0]:
            tier.dirty[slots.to(tier.device)] = True

    def _expire_cached(self, t: _Table, tier: CacheTier, slots: torch.Tensor) -> torch.Tensor:
        """Cached rows at ``slots`` idle ttl_steps or more, or below evict_l2_below, get
        their initial values (they read as such wherever they are); returns the mask of those."""
        life = t.life
        dead = life.too_small(tier.gather(slots, tier.dim).cpu().numpy())
        if life.ttl_steps is None:
            pass
        elif self.readonly:  # its reads record no use: the last-use steps on disk hold, cached or not
            ids = tier.ids[slots].cpu().numpy()
            order = np.argsort(ids)
            last = np.empty(len(ids), dtype=np.int64)
            last[order] = self._stored_last_use(t, ids[order])
            dead |= life.expired(last)
        else:
            dead |= life.expired(life.steps_of(tier.last[slots].cpu().numpy()))
        dead = torch.from_numpy(dead)
        if bool(dead.any()):
            gone = slots[dead.to(slots.device)]
            self._await_gathers()  # a gather outside the lock may be reading these rows
            tier.put(gone, torch.from_numpy(initial_rows(t.spec, tier.ids[gone].cpu().numpy())))
            t.counters.life.expired += len(gone)
        return dead

    def _revive_cached(self, t: _Table, tier: CacheTier, slots: torch.Tensor) -> None:
        """A write to cached rows: those idle too long start over from their initial
        values, used at the latest step, as a write to a row not cached does."""
        dead = self._expire_cached(t, tier, slots)
        start = t.life.step_start_clock()
        if bool(dead.any()) and start is not None and t.life.ttl_steps is not None:
            tier.last[slots[dead.to(slots.device)]] = start

    def _stored_last_use(self, t: _Table, ids: np.ndarray) -> np.ndarray:
        """Last-use step of rows not cached (sorted ids): the queue's, else LMDB's; -1 for none."""
        queued, steps = self._writeback.lookup_last(t.spec.name, ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        out[queued] = steps
        if not queued.all():
            out[~queued] = self._backend.get_last_use(t.spec.name, ids[~queued])
        return out

    def _expire_fetched(self, t: _Table, ids: np.ndarray, rows: np.ndarray) -> None:
        """Rows fetched from staging, the queue or LMDB that are idle too long (or were
        swept), or below evict_l2_below, read as initial."""
        dead = t.life.too_small(rows[:, : t.spec.dim])
        counted = dead.copy()
        if t.life.ttl_steps is not None:
            last = self._stored_last_use(t, ids)
            dead |= t.life.expired(last)
            counted |= dead & (last >= 0)
        if dead.any():
            rows[dead] = initial_rows(t.spec, ids[dead])
            t.counters.life.expired += int(counted.sum())

    def _last_use_to_store(self, t: _Table, ids: np.ndarray) -> np.ndarray:
        """Last-use steps of rows on their way to LMDB (sorted ids): the step in
        progress for its rows, the tiers' use clocks for cached rows, and for a
        write of a row not cached its stored step, or the latest step if it had
        none alive (a write re-creates it)."""
        life = t.life
        out = np.full(len(ids), -1, dtype=np.int64)
        if life.current is not None:
            out[np.isin(ids, life.current, assume_unique=True)] = life.steps + 1
        todo = np.flatnonzero(out < 0)
        if len(todo):
            for tier, slots, pos in self._cached(t, torch.from_numpy(ids[todo]))[0]:
                out[todo[pos.numpy()]] = life.steps_of(tier.last[slots.to(tier.device)].cpu().numpy())
        rest = np.flatnonzero(out < 0)
        if len(rest):
            stored = self._stored_last_use(t, ids[rest])
            stored[life.expired(stored)] = life.steps
            out[rest] = stored
        return out

    def _admitted(self, table: str, uid: torch.Tensor) -> torch.Tensor | None:
        """Which of the sorted unique ids a trainer's update may change now (the
        read of its step done); None when all may (no admission)."""
        with self._lock:
            life = self._table(table).life
            if life.sketch is None:
                return None
            return torch.from_numpy(life.admitted(uid.cpu().numpy()))

    def _reread(self, table: str, uid: torch.Tensor) -> torch.Tensor:
        """The rows, with state, of sorted unique ids as they are now, for a backward
        whose forward's copy is stale: not a step, no use, nothing moves between tiers
        (whether a backward re-reads depends on the tiers' sizes)."""
        with self._lock:
            self._check_open()
            t = self._table(table)
            self._reap()
            uid = uid.cpu()
            rows = torch.empty((len(uid), t.spec.width), dtype=torch.float32)
            targets, placed = self._cached(t, uid)
            self._await_gathers()
            for tier, slots, pos in targets:
                s = slots.to(tier.device)
                if t.life.resets:
                    self._expire_cached(t, tier, s)
                rows[pos] = tier.gather(s).cpu()
            if not bool(placed.all()):
                rows[~placed] = self._fetch(t, uid[~placed])
            return rows.to(self.device)

    def evict(self, table: str, ids) -> int:
        """Delete the rows of ``ids`` from every tier and from LMDB: a later read
        gives their initial values. Waits for queued writes first (a queued value
        would bring a row back). Returns how many of them LMDB held. Durable at
        the next flush(); a failure leaves every row as it was."""
        with self._lock:
            t = self._table_to_write(table)
            uid = torch.unique(self._as_ids(t.spec, ids).cpu())
            if not len(uid):
                return 0
            self._reap(drain=True)
            uid_np = uid.numpy()
            deleted = self._backend.delete_rows(table, uid_np)
            # -- LMDB has changed; the rest is in memory and cannot fail --
            self._prefetcher.written(table, uid_np)  # staged copies are gone too
            self._await_gathers()
            for tier in (t.hbm, t.ddr):
                if tier is not None:
                    slots = tier.lookup(uid)
                    tier.remove(slots[slots >= 0])
            t.counters.life.evicted += deleted
            return deleted

    def _count_swept(self, table: str, rows: int) -> None:
        t = self._tables.get(table)
        if t is not None:
            t.counters.life.evicted += rows

    def _add_row_stats(self, each: dict[str, dict]) -> None:
        """stats()'s "rows" of each table: rows in LMDB now (queued writes not yet
        committed excepted), and the admission and eviction counts."""
        stored = self._backend.table_stats() if each else {}
        for name, d in each.items():
            d["rows"] = {"stored": stored[name], **dataclasses.asdict(self._tables[name].counters.life)}

    def _load_sketches(self) -> None:
        for name, t in self._tables.items():
            blob = self._backend.get_sketch(name) if t.life.sketch is not None else None
            if blob is not None:
                try:
                    t.life.sketch.load(blob)
                except ValueError as e:
                    raise corrupt(self.path / "data.mdb", f"table {name!r}: {e}") from None

    def _store_sketches(self) -> None:
        """Admission counts are durable at flush, with the step counts (written just before)."""
        changed = {name: t.life for name, t in self._tables.items() if t.life.sketch is not None and t.life.steps != t.life.stored_steps}
        if changed:
            self._backend.put_sketches({name: life.sketch.counters.tobytes() for name, life in changed.items()})
            for life in changed.values():
                life.stored_steps = life.steps

    def _life_meta(self) -> dict:
        """What flush() makes durable of admission and eviction, beside the sketches."""
        return {"steps": {name: t.life.steps for name, t in self._tables.items()},
                "evicted": {name: self._evicted_before.get(name, 0) + t.counters.life.evicted for name, t in self._tables.items()}}
