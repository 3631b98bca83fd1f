"""One table's data path: its tiers, counters and row life, and the step of a read through them.

A store checks a read call, then hands it to the table (TableStore.read):
- probe: every id in the top tier -> use_top_tier counts the use; the store
  gathers the rows (no dedupe; the embedded store does so outside its lock);
- else dedupe, and step (_access) through the tiers:
  probe HBM, then DDR for the rest;
  plan while fetching: tierstore.engine.step plans the step (the rows each tier keeps,
  the victims, the write-back), changing nothing, while fetch asks the table's
  RowSource (tierstore.engine.source) for the misses: the embedded store's prefetch
  staging, write-back queue and LMDB, or a daemon client's daemon (the two on two
  threads for long fetches);
  write back: the plan's dirty rows leaving the cache go to the source;
  commit: each tier carries out its part (in memory only: it cannot fail half-way);
  (_access_one_tier commits where one tier, with none below, takes every row);
- the store gathers the call's rows from the one tier holding them all, or from the step's rows.
Admission and TTL wrap the step: _lived_access (tierstore/engine/lived.py; the counts are tierstore/engine/admission.py's).

A table never reaches back into the store: what a store's tables share (the row source,
the prefetcher, the use clock, the trace recorder, the wait for gathers running outside
the lock) comes in one Shared object. The embedded TieredStore and the daemon client's
HBM tier (tierstore.daemon.client_hbm) both step through TableStore.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from tierstore.errors import UnsupportedError

from tierstore.engine.admission import RowLife
from tierstore.engine.counters import TableCounters, counting, restored_on_error
from tierstore.spec import TableSpec, initial_rows
from tierstore.engine.inflight import InFlight
from tierstore.engine.lived import LivedRows
from tierstore.engine.source import BackendRows, RowSource
from tierstore.engine.step import StepPlan, StepPlanner
from tierstore.engine.tensors import gather_rows, gather_tier
from tierstore.engine.tiers import CacheTier, by_id, first_uses, found_all, nonzero, select
from tierstore.engine.trainer import DeviceRows
from tierstore.engine.upload import Upload
from tierstore.trace import TraceRecorder

_SCRATCH_BYTES = 64 << 20
PROBE_SAMPLE = 256  # ids of a call probed before all of them (use_top_tier)
PROBE_AFTER = 16 * PROBE_SAMPLE  # calls of more ids than this probe a sample first
# misses above which a read plans on a helper thread while it fetches: a handoff
# costs ~0.1 ms, reading 4096 rows from LMDB ~4 ms
_PLAN_ASIDE_ROWS = 4096
_HOLD_CHUNK = 1 << 16  # rows hold_resident brings up per step


class Prefetch(Protocol):
    """What a table asks of the store's prefetcher (tierstore.engine.prefetch.Prefetcher)."""

    def take(self, table: str, ids: torch.Tensor, out: torch.Tensor, places: np.ndarray | None = None) -> np.ndarray: ...
    def written(self, table: str, ids: np.ndarray) -> None: ...
    def consumed(self, table: str, ids: torch.Tensor, sorted_unique: bool = False) -> None: ...
    def in_window(self, table: str, ids: np.ndarray) -> np.ndarray | None: ...
    def next_use(self, table: str, tier: CacheTier) -> np.ndarray | None: ...
    def read_time(self, rows: int, seconds: float) -> None: ...


class _NoPrefetch:
    """The Prefetch of a store with no prefetcher of its own (a daemon client: its
    hints go to the daemon): nothing staged, no window."""

    def take(self, table: str, ids: torch.Tensor, out: torch.Tensor, places: np.ndarray | None = None) -> np.ndarray:
        return np.zeros(len(ids), dtype=bool)

    def written(self, table: str, ids: np.ndarray) -> None:
        pass

    def consumed(self, table: str, ids: torch.Tensor, sorted_unique: bool = False) -> None:
        pass

    def in_window(self, table: str, ids: np.ndarray) -> None:
        return None

    def next_use(self, table: str, tier: CacheTier) -> None:
        return None

    def read_time(self, rows: int, seconds: float) -> None:
        pass


NO_PREFETCH: Prefetch = _NoPrefetch()


@dataclass(eq=False)
class Shared:
    """What the tables of one store share; the store makes it and hands it to each."""
    source: RowSource  # below the tables' tiers (tierstore.engine.source): the backend's rows, or a daemon's
    readonly: bool
    await_gathers: Callable[[], None]  # called with the lock held before tier rows are overwritten
    recorder: TraceRecorder | None = None  # record_trace: every read step goes to a trace
    prefetcher: Prefetch = NO_PREFETCH  # the store's, set once the tables exist (the prefetcher reads them)
    use_clock: int = 0  # advanced by each read call's length (store.py's semantics)
    upload: Upload | None = None  # host rows up to the HBM tier's device (pinned staging, a side stream)
    _plan_pool: futures.ThreadPoolExecutor | None = None

    def plan_pool(self) -> futures.ThreadPoolExecutor:
        if self._plan_pool is None:
            self._plan_pool = futures.ThreadPoolExecutor(1, thread_name_prefix="tierstore-plan")
        return self._plan_pool

    def close(self) -> None:
        if self._plan_pool is not None:
            self._plan_pool.shutdown()


class Resident(NamedTuple):
    """Where the rows of a call are when every one is in a table's top tier."""
    tier: CacheTier
    slots: torch.Tensor  # of each id of the call, on the tier's device
    generation: int  # the tier's, when the slots were taken


def _rows_at(rows: torch.Tensor, at: np.ndarray) -> torch.Tensor:
    """rows at positions ``at`` (sorted, unique), without copying when every row is selected."""
    return rows if len(at) == len(rows) else rows.index_select(0, torch.from_numpy(at).to(rows.device))


class TableStore(LivedRows):
    """One table of a store: its tiers (either may be None), counters and row life,
    and every step of its rows through them. Called with the store's lock held."""

    def __init__(self, spec: TableSpec, hbm: CacheTier | None, ddr: CacheTier | None, shared: Shared, steps: int = 0):
        self.spec = spec
        self.hbm = hbm
        self.ddr = ddr
        self.counters = TableCounters.new()
        self.life = RowLife(spec.admit_after, spec.admit_width, spec.admit_depth, spec.ttl_steps, steps, spec.evict_l2_below)
        self._shared = shared
        self._planner = StepPlanner()
        self.in_flight: InFlight | None = None  # the rows of steps resolved ahead (resolve)
        self._scratch = np.empty((0, spec.width), dtype=np.float32)

    @property
    def _backend_rows(self) -> BackendRows:
        """The embedded store's source, for what only its backend keeps (evict; row life's
        last-use steps and sweeps): a daemon client caches no table with row life and evicts at the daemon."""
        return self._shared.source

    def scratch(self, n: int) -> np.ndarray | None:
        """A buffer for the rows one read fetches from LMDB, reused by the next
        read: a fresh one page-faults on every call (10-20 ms per 32 MiB here).
        None above _SCRATCH_BYTES, so one huge call does not pin its size."""
        if n * self.spec.width * 4 > _SCRATCH_BYTES:
            return None
        if len(self._scratch) < n:
            self._scratch = np.empty((n, self.spec.width), dtype=np.float32)
        return self._scratch[:n]

    # -- a read's step ------------------------------------------------------------------
    def use_top_tier(self, ids: torch.Tensor) -> Resident | None:
        """When every id is in the top tier: count the use (ids in call order, a
        repeated row at its first position) and return where the rows are."""
        top = self.hbm or self.ddr
        if top is None or self.life.active:  # admission and TTL work on the step's unique ids: step
            return None
        # a spread sample first: out of core most calls miss somewhere, and the sample
        # says so for 256 ids' probes instead of the whole call's (below a few thousand
        # ids, a probe's fixed cost is more than what the sample saves)
        if len(ids) > PROBE_AFTER:
            sample = ids[:: max(1, len(ids) // PROBE_SAMPLE)]
            if not found_all(top.lookup(sample)):
                return None
        slots = top.lookup(ids)
        if not found_all(slots):
            return None
        if self._shared.recorder is not None:
            self._shared.recorder.record(self.spec.name, ids)
        (self.counters.hbm if top is self.hbm else self.counters.ddr).hits += top.use_resident(slots, self._shared.use_clock)
        self._shared.use_clock += len(ids)
        self._shared.prefetcher.consumed(self.spec.name, ids)
        return Resident(top, slots, top.generation)

    def read(self, ids: torch.Tensor, cols: int, out: torch.Tensor | None, device: torch.device) -> Resident | torch.Tensor:
        """A read call's step (checked ids, in call order): where the rows are when every
        one is in the top tier (the caller gathers them, outside the lock if it can),
        else the first ``cols`` columns of its rows on ``device``, in ``out`` when given."""
        hit = self.use_top_tier(ids)  # fast path: no dedupe is needed
        if hit is not None:
            return hit
        mark = time.perf_counter()
        uid, inverse, first = first_uses(ids.cpu())
        self.counters.latency.observe("dedupe", time.perf_counter() - mark)
        source, slots, rows = self.step(ids, uid, first)
        if source is not None:  # every row in one tier
            return gather_tier(source, slots.index_select(0, inverse.to(slots.device)), cols, out, device)
        return gather_rows(rows, inverse.to(rows.device), cols, out, device)

    def admit(self, ids: torch.Tensor) -> Resident | None:
        """A read of ids through the tiers that leaves every row in the top tier,
        returning where they are; None, having changed nothing, when the call has
        more rows than the top tier holds. The step and its bookkeeping are the
        read's; only the rows are not copied out (the caller computes in place,
        and its backward updates them there)."""
        start = time.perf_counter()
        top = self.hbm or self.ddr
        if top is None:
            return None
        uid, inverse, first = first_uses(ids.cpu())
        if len(uid) > top.capacity:
            return None
        self.counters.latency.observe("dedupe", time.perf_counter() - start)
        source, slots, _ = self.step(ids, uid, first)
        if source is not top:
            slots = top.lookup(uid)
        self.counters.latency.observe("total", time.perf_counter() - start)
        return Resident(top, slots.index_select(0, inverse.to(slots.device)), top.generation)

    def step(self, ids: torch.Tensor, uid: torch.Tensor, first: torch.Tensor):
        """A read's step through the tiers for ids (sorted unique ``uid``, each at
        its ``first`` position in the call): traced, counted, clocked; _access's result."""
        if self._shared.recorder is not None:
            self._shared.recorder.record(self.spec.name, ids)
        if self.life.active:
            result = self._lived_access(uid, first + self._shared.use_clock)
        else:
            with restored_on_error([self.counters]):
                result = self._access(uid, first + self._shared.use_clock)
        self._shared.use_clock += len(ids)
        self._shared.prefetcher.consumed(self.spec.name, uid, sorted_unique=True)
        return result

    def _access(self, uid: torch.Tensor, use_clock: torch.Tensor, refresh: torch.Tensor | None = None):
        """Serve one step's unique ids and apply the policy.

        Returns (tier, slots, None) when every row is in that one tier now, else
        (None, None, rows) with rows [len(uid), width] on the HBM device.
        ``refresh``: rows whose last-use step must reach LMDB even if clean (TTL).
        """
        H, D = self.hbm, self.ddr
        n = len(uid)
        c = self.counters
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
            if n_h:
                rest = nonzero(~in_h)
                slot_d.index_copy_(0, rest, D.lookup(uid.index_select(0, rest)).cpu())
            else:
                slot_d = D.lookup(uid).cpu()
        in_d = slot_d >= 0
        n_d = int(in_d.sum())
        if D:
            c.ddr.hits += n_d
            c.ddr.misses += n - n_h - n_d
            c.latency.observe("ddr", time.perf_counter() - mark)
            if n_d == n and H is None:
                D.touch(slot_d, use_clock)
                return D, slot_d, None

        if (H is None) != (D is None) and n <= (H or D).capacity:
            return self._access_one_tier(H or D, uid, use_clock, slot_h, slot_d)

        miss = nonzero(~in_h & ~in_d)
        plan, fetched, fetched_at = self._fetch_while_planning(uid[miss], lambda: self._plan(use_clock, slot_h, slot_d, refresh))
        places = _places(n, miss, fetched_at, (H, slot_h, in_h), (D, slot_d, in_d))
        dev = H.device if H else torch.device("cpu")
        fetched = self._up(fetched, dev)
        if len(miss) == n:  # all cold: the fetched rows are the call's rows, in uid order
            rows = fetched
        else:
            rows = torch.empty((n, self.spec.width), dtype=torch.float32, device=dev)
            for tier, slot, inside, count in ((H, slot_h, in_h, n_h), (D, slot_d, in_d, n_d)):
                if count:
                    at = nonzero(inside)
                    rows.index_copy_(0, at.to(dev), self._up(tier.gather(slot.index_select(0, at).to(tier.device)), dev))
            rows.index_copy_(0, miss.to(dev), fetched)
        n_wb = self._write_back(plan, uid, rows, places)

        # -- commit the plan (in memory only; cannot fail half-way) --
        self._shared.await_gathers()
        down = plan.demoted
        if H:
            kept_down = torch.from_numpy(np.flatnonzero(down.kept))
            down_rows = H.gather(torch.from_numpy(down.slots).index_select(0, kept_down).to(H.device)).cpu() if D else None
            down_places = H.places_at(down.slots[kept_down.numpy()])
            H.commit(plan.hbm, plan, uid, _rows_at(rows, plan.hbm.entering()), places)
            c.hbm.evictions += plan.hbm.evictions
        if D:
            D.commit(plan.ddr, plan, uid, _rows_at(rows, plan.ddr.entering()).cpu(), places)
            c.ddr.evictions += plan.ddr.evictions
            if H and len(kept_down):
                ids, last, freq, dirty = (torch.from_numpy(a).index_select(0, kept_down)
                                          for a in (down.ids, down.last, down.freq, down.dirty))
                D.add(ids, down_rows, last, freq, dirty, down_places)
            c.ddr.writebacks += n_wb
        elif H:
            c.hbm.writebacks += n_wb
        return None, None, rows

    def _access_one_tier(self, T: CacheTier, uid: torch.Tensor, use_clock: torch.Tensor,
                         slot_h: torch.Tensor, slot_d: torch.Tensor):
        """_access where one tier, with none below it, takes every row of the call:
        the fetched rows go straight into it, and the output is gathered from it.
        A quarter of the tensor ops of the two-level commit, which for the few
        thousand rows of a prefetched step cost more than the rows themselves."""
        c = self.counters.hbm if T is self.hbm else self.counters.ddr
        slot = slot_h if T is self.hbm else slot_d
        miss = nonzero(slot < 0)
        plan, fetched, fetched_at = self._fetch_while_planning(uid[miss], lambda: self._plan(use_clock, slot_h, slot_d))
        level = plan.hbm if T is self.hbm else plan.ddr
        fetched = self._up(fetched, T.device)
        n_wb = self._write_back(plan, uid, None)

        # -- commit (in memory only; cannot fail half-way) --
        self._shared.await_gathers()
        added = T.commit(level, plan, uid, fetched, _places(len(uid), miss, fetched_at))
        c.evictions += level.evictions
        c.writebacks += n_wb
        if len(miss) == len(uid):  # all cold: the fetched rows are contiguous, faster to gather from
            return None, None, fetched
        slots = slot.to(T.device)
        slots.index_copy_(0, miss.to(T.device), added)
        return T, slots, None

    def _up(self, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Rows of the step on ``device``: host rows going up to the HBM tier's device
        through the store's Upload (pinned staging, a side stream), others moved as they are."""
        up = self._shared.upload
        if up is not None and up.staged and device == up.device and rows.device.type == "cpu":
            return up(rows)
        return rows.to(device)

    def _fetch_while_planning(self, ids: torch.Tensor, plan: Callable[[], StepPlan]) -> tuple[StepPlan, torch.Tensor, np.ndarray]:
        """``plan()``, the rows of ids not cached and where LMDB had them (RowSource.fetch's
        places). A plan needs no fetched row: for a long fetch it is made on a helper thread
        while this one reads LMDB (both release the GIL in their C calls)."""
        places = np.full(len(ids), -1, dtype=np.int64)
        if len(ids) < _PLAN_ASIDE_ROWS:
            return plan(), self.fetch(ids, self.scratch(len(ids)), places), places
        planned = self._shared.plan_pool().submit(plan)
        try:
            fetched = self.fetch(ids, self.scratch(len(ids)), places)
        finally:
            futures.wait([planned])  # never leave it reading tiers that a later call changes
        return planned.result(), fetched, places

    def _plan(self, use_clock: torch.Tensor, slot_h: torch.Tensor, slot_d: torch.Tensor,
              refresh: torch.Tensor | None = None) -> StepPlan:
        """This table's step (tierstore.engine.step), with the prefetch window and the steps
        in flight (resolve) pinning rows; one that would evict a row in flight is refused."""
        plan = self._planner.plan(self.hbm, self.ddr, use_clock.numpy(), slot_h.numpy(), slot_d.numpy(),
                                  refresh=None if refresh is None else refresh.numpy(), next_use=self._next_use,
                                  in_window=self._in_window)
        if self.in_flight is not None:
            self.in_flight.check((plan.hbm if self.hbm else plan.ddr).evict)
        return plan

    def _next_use(self, tier: CacheTier) -> np.ndarray | None:
        use = self._shared.prefetcher.next_use(self.spec.name, tier)
        return use if self.in_flight is None else self.in_flight.next_use(tier, use)

    def _in_window(self, ids: np.ndarray) -> np.ndarray | None:
        named = self._shared.prefetcher.in_window(self.spec.name, ids)
        return named if self.in_flight is None else self.in_flight.in_window(ids, named)

    def resolve(self, ids: torch.Tensor) -> tuple[Resident, np.ndarray]:
        """store.trainer(table).resolve on this table: every row of ``ids`` (a batch's, in call
        order) brought into the top tier by a read's step, its use counted, and pinned there
        (tierstore.engine.inflight) until ``in_flight.release`` of the slots returned."""
        top = self.hbm or self.ddr
        if top is None or self.life.active or self._shared.readonly:
            raise UnsupportedError(f"table {self.spec.name!r} cannot resolve steps ahead: it needs a tier, no admission or "
                                   "TTL and a writable store")
        if self.in_flight is None:
            self.in_flight = InFlight(self.spec.name, top)
        hit = self.use_top_tier(ids) or self.admit(ids)
        if hit is None:
            raise UnsupportedError(f"table {self.spec.name!r}: a batch has more rows than its {top.name} tier holds "
                                   f"({top.capacity}); give the tier more rows or use smaller batches")
        return hit, self.in_flight.pin(hit.slots)

    def _write_back(self, plan: StepPlan, uid: torch.Tensor, rows: torch.Tensor | None, places: np.ndarray | None = None) -> int:
        """Queue the plan's dirty rows leaving the cache for LMDB, before anything changes:
        call rows from the step's ``rows`` (None when no call row leaves; ``places``: where
        LMDB had the call's rows), the others from their tiers. Returns how many."""
        wb = plan.write_back
        if not len(wb):
            return 0
        taken = [(tier, torch.from_numpy(slots).to(tier.device)) for tier, slots in ((self.hbm, wb.hbm), (self.ddr, wb.ddr)) if len(slots)]
        at = torch.from_numpy(wb.call)
        called = (uid.index_select(0, at), rows.index_select(0, at.to(rows.device)).cpu(), places[wb.call]) if len(at) else None
        self._queue_write_back(*_rows_by_id(taken, called))
        return len(wb)

    def fetch(self, ids: torch.Tensor, out: np.ndarray | None = None, places: np.ndarray | None = None) -> torch.Tensor:
        """Rows of ids (sorted) not in any tier, from the table's source (tierstore.engine.source),
        rows idle too long as initial (TTL). Into ``out`` when given; where LMDB had them into
        ``places`` (-1s) when given."""
        rows = self._shared.source.fetch(self, ids, out, places)
        if self.life.resets:
            self._expire_fetched(ids.numpy(), rows.numpy())
        return rows

    def fill_unwritten(self, ids: np.ndarray, rows: np.ndarray, found: np.ndarray) -> np.ndarray:
        """Give rows LMDB does not hold their initial values, and count the read."""
        if not found.all():
            rows[~found] = initial_rows(self.spec, ids[~found])
        self.counters.ssd.count_reads(len(ids), int(found.sum()), self.spec.row_bytes)
        return rows

    def _queue_write_back(self, ids: np.ndarray, rows: np.ndarray, places: np.ndarray) -> None:
        """Hand dirty rows leaving the cache (sorted by id), and where LMDB had them, to the table's source."""
        if len(ids):
            mark = time.perf_counter()
            self._shared.source.write_back(self, ids, rows, places)
            self.counters.latency.observe("writeback", time.perf_counter() - mark)

    # -- calls that are not a step -----------------------------------------------------------
    def _cached(self, uid: torch.Tensor) -> tuple[list[tuple[CacheTier, torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Where the rows of ``uid`` are cached: ([(tier, slots, positions in uid)] for each
        tier, slots and positions on the CPU), and the mask of the ids some tier holds."""
        placed = torch.zeros(len(uid), dtype=torch.bool)
        targets = []
        for tier in (self.hbm, self.ddr):
            if tier is None:
                continue
            todo = nonzero(~placed)
            slot = tier.lookup(uid.index_select(0, todo)).cpu()
            slots, at = select(slot >= 0, slot, todo)
            targets.append((tier, slots, at))
            placed.index_fill_(0, at, True)
        return targets, placed

    def write(self, uid: torch.Tensor, values: torch.Tensor, cols: int) -> None:
        """Set the first ``cols`` columns of the rows of sorted unique ids (on the
        CPU): cached rows in place, then dirty; the others to the table's source first
        (it may refuse them: nothing has changed yet)."""
        n = len(uid)
        targets, placed = self._cached(uid)
        cold = nonzero(~placed)
        if len(cold):
            self._shared.source.write(self, uid[cold], values[cold], cols)
        self._shared.await_gathers()
        for tier, slot, pos in targets:
            s = slot.to(tier.device)
            if self.life.resets:
                self._revive_cached(tier, s)
            tier.put(s, values if len(pos) == n else values[pos], cols)  # all in one tier: no gather
            tier.dirty[s] = True

    def reread(self, uid: torch.Tensor) -> torch.Tensor:
        """The rows, with state, of sorted unique ids (on the CPU) as they are now:
        not a step, no use, nothing moves between tiers (store.trainer(table).reread)."""
        rows = torch.empty((len(uid), self.spec.width), dtype=torch.float32)
        targets, placed = self._cached(uid)
        self._shared.await_gathers()
        for tier, slots, pos in targets:
            s = slots.to(tier.device)
            if self.life.resets:
                self._expire_cached(tier, s)
            rows[pos] = tier.gather(s).cpu()
        if not bool(placed.all()):
            rows[~placed] = self.fetch(uid[~placed])
        return rows

    def evict(self, uid: torch.Tensor) -> int:
        """Delete the rows of sorted unique ids (on the CPU; none queued for LMDB)
        from every tier and from LMDB; returns how many of them LMDB held."""
        uid_np = uid.numpy()
        deleted = self._backend_rows.backend.delete_rows(self.spec.name, uid_np)
        # -- LMDB has changed; the rest is in memory and cannot fail --
        self._shared.prefetcher.written(self.spec.name, uid_np)  # staged copies are gone too
        self._shared.await_gathers()
        for tier in (self.hbm, self.ddr):
            if tier is not None:
                slots = tier.lookup(uid)
                tier.remove(slots[slots >= 0])
        self.counters.life.evicted += deleted
        return deleted

    def take_dirty(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The dirty rows of both tiers by id (``limit`` of them at most), and where LMDB had them,
        marked clean: the caller queues them for LMDB, and the queue holds their values until
        committed. None if none."""
        taken = []
        for tier in (self.hbm, self.ddr):
            if tier is None:
                continue
            slots = tier.dirty_slots()[: None if limit is None else limit - sum(len(s) for _, s in taken)]
            if len(slots):
                tier.dirty[slots] = False
                taken.append((tier, slots))
        return _rows_by_id(taken) if taken else None

    def hold_resident(self, device: torch.device) -> DeviceRows:
        """store.trainer(table).hold_resident on this table: every row brought into the top
        tier (read through the tiers as a read of them would), where it fits and the id
        space is the dense map's."""
        top = self.hbm or self.ddr
        n = self.spec.num_rows
        why = [what for what, bad in (
            ("the store is readonly", self._shared.readonly), ("it has no tier", top is None),
            ("its id space is unbounded (num_rows=None)", n is None),
            ("admission or TTL is on", self.life.active)) if bad]
        if not why and (n > top.capacity or not top.dense_index or top.device != device):
            why = [f"its top tier ({top.capacity} rows on {top.device}) cannot hold its {n} rows on {device}"]
        if why:
            raise UnsupportedError(f"table {self.spec.name!r} cannot hold every row in its top tier: {'; '.join(why)}. "
                                   "Open the store with hbm_rows >= num_rows (or ddr_rows without HBM) on the device "
                                   "the step runs on, or keep the host step")
        if top.resident < n:
            ids = torch.arange(n)
            missing = ids[top.lookup(ids).cpu() < 0]
            for lo in range(0, len(missing), _HOLD_CHUNK):
                self.admit(missing[lo: lo + _HOLD_CHUNK])
        return DeviceRows(top, top.generation, top.weights, top.state, top.dirty, top.index.as_tensor(),
                          counting(self.counters.hbm if top is self.hbm else self.counters.ddr))

    def update_resident(self, slots: torch.Tensor, generation: int, update: Callable[[CacheTier], None]) -> bool:
        """store.trainer(table).update_resident on this table: False, having changed nothing,
        if a slot of the top tier changed owner since ``generation``."""
        top = self.hbm or self.ddr
        if top is None or top.generation != generation:
            return False
        self._shared.await_gathers()
        update(top)
        top.mark_dirty(slots)
        return True


def _places(n: int, miss: torch.Tensor, fetched: np.ndarray, *held: tuple[CacheTier | None, torch.Tensor, torch.Tensor]) -> np.ndarray:
    """Where LMDB had each of a step's ``n`` rows (-1: not known): ``fetched``'s for the rows
    at ``miss``, and each (tier, slots, mask of the rows in it)'s for those it holds."""
    places = np.full(n, -1, dtype=np.int64)
    places[miss.numpy()] = fetched
    for tier, slots, inside in held:
        if tier is not None and tier.places is not None and bool(inside.any()):
            at = inside.numpy()
            places[at] = tier.places_at(slots.numpy()[at])
    return places


def _rows_by_id(taken: list[tuple[CacheTier, torch.Tensor]],
                called: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows at each tier's slots, and ``called`` ((ids, rows, places) on the host: a step's rows
    no tier keeps), as LMDB takes them (host numpy, sorted by id), with where LMDB had them. One tier's alone are gathered
    once, in id order, where a gather, a concatenation and a sort copied them three times: the
    trainer's thread took 66-68 ms of CPU a bench-scale DLRM step against 72-78 (13.7k 256-byte
    rows evicted a step), and a flush held its chunk (a quarter of the write-back queue) three
    times over."""
    if len(taken) == 1 and called is None:
        return taken[0][0].rows_by_id(taken[0][1])
    ids, rows, places = ([called[0]], [called[1]], [called[2]]) if called is not None else ([], [], [])
    ids = torch.cat(ids + [tier.ids.index_select(0, s).cpu() for tier, s in taken])
    order = torch.argsort(ids)
    places = np.concatenate(places + [tier.places_at(s.cpu()) for tier, s in taken])[order.numpy()]
    return (*by_id(ids, torch.cat(rows + [tier.gather(s).cpu() for tier, s in taken]), order), places)
