"""Asynchronous prefetch of the rows that the next batches will read.

Background threads read the rows of announced batches from LMDB into a
per-table *staging* area in host memory, without holding the store lock. A
read that misses every cache tier takes its rows from staging instead of LMDB
and promotes them through the normal path, so prefetch changes where rows come
from, never what the cache policy does with them.

No stale data: staging only ever holds the newest value of rows that are not
cached. Rows queued for LMDB (tierstore.io.writeback) are staged from the queue
when their batch is announced: LMDB lags the queue, and once the queue commits
them only LMDB has them. When a fetch from LMDB lands (under the store lock) it
drops rows that are now cached (the cached copy is newer or equal) and rows
written after the fetch began (a short per-table write log); any later write of
a staged row drops the staged copy.

Pinning: rows of announced batches that are staged cannot be evicted; cached
rows of announced batches are evicted only when nothing outside the window is
left (their next use is known: see eviction/lookahead.py). Staging has a fixed
capacity; a prefetch that does not fit waits (LookaheadLoader shrinks its
effective depth) instead of evicting anything, so pinning cannot deadlock.

Sharing a small machine with the trainer: a fetch uses only the threads it needs
to land before its batch is due (from measured read and step times), and the
threads pause while the trainer is in the store; both keep them from taking the
GIL from it. And rows are read ahead only while reading them is slow: when the
page cache serves them (PrefetchConfig.sync_read_us), the step reads them for
less CPU than staging them costs, and the window only pins.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierstore.eviction.lookahead import NOT_IN_WINDOW
from tierstore.io import find_sorted, unique_ids
from tierstore.io.workers import MIN_CHUNK, read_rows_async

from tierstore.precision import DTYPES
from tierstore.spec import TableSpec
from tierstore.engine.tiers import CacheTier, is_sorted_unique, masked
from tierstore.validate import check_int, check_number
from tierstore.errors import WaitTimeoutError
from tierstore.engine.loader import LookaheadLoader, PrefetchGroup, PrefetchTarget  # noqa: F401 (imported from here)

if TYPE_CHECKING:
    from tierstore.io import RowBackend, WriteBack

    from tierstore.engine.table import TableStore


CHUNK_SECONDS = 5e-4  # of reading a thread does between two checks for the trainer
MAX_CHUNK = 2048
# Rows of the first announced batch read and timed in the trainer's thread, before any
# read-ahead: whether to read ahead is then known from the start. A read call costs
# ~45 us beyond its rows, so a batch of fewer than FIRST_READ_MIN rows to fetch is read
# ahead without a timed read (it would time the call, not the rows), as are all until one is timed.
FIRST_READ_ROWS, FIRST_READ_MIN = 512, 128


def chunk_rows(row_seconds: float | None) -> int:
    """Rows a reading thread takes at a time (between two checks for the trainer, and the
    fewest a thread is given), its recent time a row ``row_seconds`` (None: not measured
    yet): CHUNK_SECONDS of reading, at least MIN_CHUNK rows. Rows from the page cache
    (~1 us a row) come in chunks of several hundred; small chunks cost the threads more
    CPU than the reads."""
    if row_seconds is None:
        return MIN_CHUNK
    return max(MIN_CHUNK, min(MAX_CHUNK, int(CHUNK_SECONDS / max(row_seconds, 1e-9))))


@dataclass
class PrefetchConfig:
    workers: int = 8  # threads for cold reads: the most one fetch uses (it takes those it needs to land in time)
    staged_rows: int | Mapping[str, int] | None = None  # per table; None: ddr_rows, else hbm_rows, else 65536
    executor: Executor | None = None  # injected pool (not shut down by the store)
    # Rows are read ahead only while LMDB takes at least this long a row (smoothed, as measured by
    # the thread reading): faster, the page cache holds them, and the step reads them itself for
    # less CPU than handing them through staging costs. The window still pins and ranks rows.
    # 0: always read ahead.
    sync_read_us: float = 8.0

    def __post_init__(self):
        check_int(self.workers, "prefetch workers", at_least=1)
        check_number(self.sync_read_us, "prefetch sync_read_us", meaning="0: always read ahead", finite=False)
        values = self.staged_rows.values() if isinstance(self.staged_rows, Mapping) else [self.staged_rows]
        for v in values:
            check_int(v, "prefetch staged_rows", none=True)


class PrefetchTicket:
    """One table's prefetch for one batch: ``wait()`` raises its failure; ``release()``
    unpins what the batch did not read (the loader does both)."""

    def __init__(self, prefetcher: "Prefetcher | None", table: str, step: int, ids: np.ndarray | None, error: BaseException | None = None):
        self._prefetcher = prefetcher
        self.table = table
        self.step = step
        self.ids = ids
        self._error = error
        self._done = threading.Event()
        self._released = False
        self.owned = False  # a LookaheadLoader delivers its failure at its batch
        self.rejected = error is not None  # the ids themselves were bad: nothing was fetched
        if error is not None or prefetcher is None:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise WaitTimeoutError(f"prefetch of table {self.table!r} (batch {self.step}) not done after {timeout} s")
        if self._error is not None:
            error, self._error = self._error, None  # delivered once
            if self._prefetcher is not None:
                self._prefetcher._delivered(self)
            raise _naming_batch(error, self.table, self.step)

    def dismiss(self) -> None:
        """Forget a rejected batch's failure: the read of the batch raises it itself."""
        self._error = None
        if self._prefetcher is not None:
            self._prefetcher._delivered(self)

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._prefetcher is not None:
                self._prefetcher._release(self)

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()



@dataclass(frozen=True)
class StoreParts:
    """What the prefetcher uses of its store, and nothing more."""
    tables: Mapping[str, "TableStore"]  # the store's tables (the live mapping: emptied when it closes)
    table: Callable[[str], "TableStore"]  # a table by name, or the store's KeyError naming the tables
    as_ids: Callable[[TableSpec, object], torch.Tensor]  # the store's one id check
    lock: threading.RLock  # the store's: held by every caller but the workers, which take it to land
    backend: "RowBackend"  # the rows on disk, read by the workers
    writeback: "WriteBack"  # rows queued for LMDB: newer than LMDB's


class Prefetcher:
    """The store's background reader. Every method but the worker callback runs
    with the store lock held by the caller. ``config.staged_rows``: per table, resolved
    by the store (its memory split)."""

    def __init__(self, parts: StoreParts, config: PrefetchConfig):
        self._uses = parts
        self._config = config
        self._executor = config.executor
        self._owns_executor = config.executor is None
        self._staged: dict[str, CacheTier] = {}
        self._reserved: dict[str, int] = {}
        self._window: dict[str, dict[int, np.ndarray]] = {}  # table -> step -> ids announced
        self._outstanding: dict[str, deque[PrefetchTicket]] = {}
        self._undelivered: dict[str, list[PrefetchTicket]] = {}
        self._log: dict[str, list[tuple[int, np.ndarray]]] = {}  # LMDB writes since the oldest fetch began
        self._inflight: dict[int, int] = {}  # ticket step -> write seq when its fetch began
        self._write_seq = 0
        self._step = 0
        self._idle = threading.Condition(parts.lock)
        self._row_seconds: float | None = None  # a reading thread's time per row, recent fetches
        self._read_seconds: float | None = None  # the same, with the step's own reads: see reading_ahead
        self._step_seconds: float | None = None  # the trainer's time per batch, waits excluded
        self._next_use_out: dict[tuple[str, str], np.ndarray] = {}
        self._pins: dict[str, dict[int, list[torch.Tensor]]] = {}  # table -> step -> staging slots pinned until it (see _pin)

    # -- capacity ------------------------------------------------------------------
    def capacity(self, table: str) -> int:
        v = self._config.staged_rows
        return int((v.get(table) if isinstance(v, Mapping) else v) or 0)

    def room(self, table: str) -> int:
        """Rows a new prefetch of this table can still stage."""
        tier = self._staging(table)
        return (tier.free if tier else 0) - self._reserved.get(table, 0)

    def _staging(self, table: str) -> CacheTier | None:
        if table not in self._staged:
            cap = self.capacity(table)
            spec = self._uses.tables[table].spec
            self._staged[table] = CacheTier("staged", cap, spec.dim, spec.state_dim, torch.device("cpu"), None, spec.num_rows,
                                            DTYPES[spec.dtype]) if cap else None
        return self._staged[table]

    # -- issuing -------------------------------------------------------------------
    def _uncached(self, t, uid: np.ndarray) -> np.ndarray:
        """Mask of the sorted unique ids that no tier holds."""
        need = np.ones(len(uid), dtype=bool)
        uid_t = torch.from_numpy(uid)
        for tier in (t.hbm, t.ddr):
            if tier is not None:
                need &= (tier.lookup(uid_t).cpu() < 0).numpy()
        return need

    def reading_ahead(self) -> bool:
        """Whether announced rows are read ahead now (PrefetchConfig.sync_read_us): while
        reads are slow (and until one has been timed)."""
        return self._read_seconds is None or self._read_seconds * 1e6 >= self._config.sync_read_us

    def _time_first_read(self, table: str, uid: np.ndarray, need: np.ndarray) -> None:
        """Time a read of some rows the first announced batch will fetch (their pages are
        then in; the rows themselves are read again where they are needed)."""
        sample = uid[need][:: max(1, int(need.sum()) // FIRST_READ_ROWS)][:FIRST_READ_ROWS]
        if len(sample) >= FIRST_READ_MIN and self._config.sync_read_us:
            mark = time.perf_counter()
            self._uses.backend.get_rows(table, sample, None)
            self.read_time(len(sample), time.perf_counter() - mark)

    def read_time(self, rows: int, seconds: float) -> None:
        """A thread read ``rows`` rows from LMDB in ``seconds`` (a fetch, or the step itself:
        while rows are not read ahead, how the step's reads go says when to start again)."""
        if rows:
            self._read_seconds = _smoothed(self._read_seconds, seconds / rows, weight=0.5)

    def _needs(self, table: str, ids) -> tuple:
        """A read's table, its sorted unique ids, the mask of those it would fetch,
        and the staging slots of those already staged (-1 where not)."""
        t = self._uses.table(table)
        ids = self._uses.as_ids(t.spec, ids).cpu()
        uid = (ids if is_sorted_unique(ids) else torch.unique(ids)).numpy()
        if self.reading_ahead():
            need = self._uncached(t, uid)
            if self._read_seconds is None:
                self._time_first_read(table, uid, need)
        if not self.reading_ahead():  # announced only: the window pins, the step reads
            return t, uid, np.zeros(len(uid), dtype=bool), None
        staging = self._staging(table)
        staged = None
        if staging is not None and need.any():
            # only rows no tier holds can be staged (_stage stages none that a tier holds, a
            # step takes a row out of staging as it enters a tier): probe those alone
            at = np.flatnonzero(need)
            staged = torch.full((len(uid),), -1, dtype=torch.int64)
            staged[at] = staging.lookup(torch.from_numpy(uid[at])).cpu()
            need &= (staged < 0).numpy()
        return t, uid, need, staged

    def fits(self, reads: Mapping[str, torch.Tensor]) -> dict[str, tuple | Exception] | None:
        """None unless staging has room for every row these reads would fetch (rows
        already cached or staged need none); else each table's needs, for ``prefetch``."""
        needs = {}
        for table, ids in reads.items():
            try:
                needs[table] = self._needs(table, ids)
            except Exception as e:  # a bad batch takes no room: prefetch() fails it at its own step
                needs[table] = e
                continue
            if self.room(table) < int(needs[table][2].sum()):
                return None
        return needs

    def prefetch(self, table: str, ids, needs: tuple | Exception | None = None) -> PrefetchTicket:
        """``needs``: what ``fits`` found for these ids, under the same hold of the lock."""
        step = self._step
        self._step += 1
        try:
            if isinstance(needs, Exception):
                raise needs
            t, uid, need, staged = needs or self._needs(table, ids)
        except Exception as e:  # a bad future batch fails at its own step, not now
            ticket = PrefetchTicket(self, table, step, None, e)
            self._undelivered.setdefault(table, []).append(ticket)
            return ticket
        ticket = PrefetchTicket(self, table, step, uid)
        self._window.setdefault(table, {})[step] = uid
        self._outstanding.setdefault(table, deque()).append(ticket)
        c = t.counters.prefetch
        c.issued_batches += 1
        c.step_read_batches += not self.reading_ahead()
        c.queued += 1
        if staged is not None:
            held = masked(staged, staged >= 0)
            staging = self._staged[table]
            staging.last.index_copy_(0, held, torch.clamp(staging.last.index_select(0, held), min=step))  # pinned until this step is done
            self._pin(table, step, held)
        fetch = uid[need][: max(0, self.room(table))]
        c.dropped_rows += int(need.sum()) - len(fetch)
        queued, queued_rows = self._uses.writeback.lookup(table, fetch)
        if queued_rows is not None:
            self._add_staged(t, table, fetch[queued], queued_rows, step)
            fetch = fetch[~queued]
        if len(fetch) == 0:
            ticket._finish()
            c.queued -= 1
            return ticket
        self._reserved[table] = self._reserved.get(table, 0) + len(fetch)
        self._inflight[step] = self._write_seq
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._config.workers, thread_name_prefix="tierstore-prefetch")
        read_rows_async(
            self._uses.backend, table, fetch, t.spec.width, self._executor,
            self._parts(len(fetch), batches_ahead=len(self._outstanding[table]) - 1),
            lambda rows, found, err, seconds, places: self._land(ticket, fetch, rows, found, places, err, seconds),
            None if self._uses.backend.reads_directly else self._yield_to_store,
            chunk=chunk_rows(self._row_seconds),
        )
        return ticket

    def _parts(self, rows: int, batches_ahead: int) -> int:
        """Threads for a fetch: enough to land it, with a 2x margin, before the
        trainer gets to its batch; all of them while that time is not known. More
        only take the GIL from the trainer: on 2 cores, 8 threads where 2 would do
        slowed the DLRM step's MLP by ~6 ms."""
        if not batches_ahead or self._row_seconds is None or self._step_seconds is None:
            return self._config.workers
        needed = 2 * rows * self._row_seconds / (batches_ahead * self._step_seconds)
        return max(1, min(self._config.workers, math.ceil(needed)))

    def trainer_step(self, seconds: float) -> None:
        """A LookaheadLoader's batch took the trainer this long, waits excluded."""
        self._step_seconds = _smoothed(self._step_seconds, seconds)

    def _yield_to_store(self) -> None:
        """Called by the workers before every few rows they read through LMDB's map: they
        wait while the trainer is in the store. Their copies fault pages in with the GIL
        held, and on a small machine the trainer otherwise queued behind each fault at its
        many tensor ops, which doubled its read time. Direct reads wait without the GIL:
        pausing them cost the step more than it saved (0.5 GiB DLRM depth 2: 4% a step;
        1 GiB embedding step depth 4: 7%)."""
        with self._uses.lock:
            pass

    def _land(self, ticket: PrefetchTicket, ids: np.ndarray, rows: np.ndarray, found: np.ndarray, places: np.ndarray,
              error, seconds: float) -> None:
        """Worker thread: install fetched rows under the store lock."""
        with self._uses.lock:
            if error is None:
                self._row_seconds = _smoothed(self._row_seconds, seconds / len(ids))
                self.read_time(len(ids), seconds)
            table = ticket.table
            self._reserved[table] -= len(ids)
            began = self._inflight.pop(ticket.step)
            store_t = self._uses.tables.get(table)
            try:
                if error is not None:
                    raise error
                if store_t is not None and not ticket._released:  # else: closing, or the batch is done
                    self._stage(store_t, ticket, ids, rows, found, places, began)
            except BaseException as e:
                self._undelivered.setdefault(table, []).append(ticket)
                error = e
            finally:
                self._prune_log()
                if store_t is not None:
                    store_t.counters.prefetch.queued -= 1
                ticket._finish(error)
                self._idle.notify_all()

    def _stage(self, store_t, ticket: PrefetchTicket, ids, rows, found, places, began: int) -> None:
        c = store_t.counters
        store_t.fill_unwritten(ids, rows, found)
        # a row queued for LMDB before the fetch began was staged from the queue, not
        # fetched; one queued since is in the write log
        keep = ~find_sorted(self._written_since(ticket.table, began), ids)[1]
        ids_t = torch.from_numpy(ids)
        for tier in (store_t.hbm, store_t.ddr, self._staged[ticket.table]):
            if tier is not None:
                keep &= (tier.lookup(ids_t).cpu() < 0).numpy()
        c.prefetch.dropped_rows += len(ids) - int(keep.sum())
        self._add_staged(store_t, ticket.table, ids[keep], rows[keep], ticket.step, places[keep])

    def _add_staged(self, store_t, table: str, ids: np.ndarray, rows: np.ndarray, step: int,
                    places: np.ndarray | None = None) -> None:
        """Stage rows, pinned until announced step ``step`` is done; ``places``: where LMDB had them."""
        staging = self._staged[table]
        n = len(ids)
        slots = staging.add(torch.from_numpy(ids), torch.from_numpy(rows), torch.full((n,), step),
                            torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool), places)
        self._pin(table, step, slots)
        store_t.counters.prefetch.issued_rows += n
        store_t.counters.prefetch.staged_rows = staging.resident

    # -- the store's hooks -----------------------------------------------------------
    def take(self, table: str, ids: torch.Tensor, out: torch.Tensor, places: np.ndarray | None = None) -> np.ndarray:
        """Move the staged rows of ids out of staging into their rows of ``out`` (and where
        LMDB had them into ``places``); returns the mask of those found."""
        staging = self._staged.get(table)
        if staging is None or staging.resident == 0:
            return np.zeros(len(ids), dtype=bool)
        slots = staging.lookup(ids)
        found = slots >= 0
        if bool(found.all()):  # the usual prefetched step: one gather, no scatter
            staging.gather(slots, out=out)
        else:
            slots = slots[found]
            out[found] = staging.gather(slots)
        if places is not None:
            places[found.numpy()] = staging.places_at(slots)
        staging.remove(slots)
        c = self._uses.tables[table].counters.prefetch
        c.served_rows += int(found.sum())
        c.staged_rows = staging.resident
        return found.numpy()

    def written(self, table: str, ids: np.ndarray) -> None:
        """ids of table were just written (queued for LMDB): staged copies are stale now."""
        staging = self._staged.get(table)
        if staging is not None and staging.resident:
            slots = staging.lookup(torch.from_numpy(ids))
            staging.remove(slots[slots >= 0])
            self._uses.tables[table].counters.prefetch.staged_rows = staging.resident
        if self._inflight:
            self._log.setdefault(table, []).append((self._write_seq, ids.copy()))
        self._write_seq += 1

    def check(self, table: str) -> None:
        """Raise a background failure of this table that nobody waited for, once
        no earlier announced batch of the table is still pending. Tickets a
        LookaheadLoader owns are left to it: it raises them when their batch is due."""
        pending = [t for t in self._undelivered.get(table, ()) if not t.owned]
        if pending:
            failed = min(pending, key=lambda t: t.step)
            queue = self._outstanding.get(table, ())
            if not any(t.step < failed.step and not t._released for t in queue):
                failed.wait()

    def consumed(self, table: str, ids: torch.Tensor, sorted_unique: bool = False) -> None:
        """A read used these ids: release the oldest outstanding tickets it covers."""
        queue = self._outstanding.get(table)
        uid = None
        while queue and queue[0].done():
            if uid is None:
                uid = ids.cpu().numpy() if sorted_unique else unique_ids(ids.cpu().numpy())
            if not _covers(uid, queue[0].ids):
                break
            queue[0].release()

    def in_window(self, table: str, ids: np.ndarray) -> np.ndarray | None:
        """Mask of ``ids`` that an announced batch of ``table`` reads; None without a window.
        A search of each batch's sorted ids: for the planner's few victims, cheaper than
        next_use's answer for every slot of a tier."""
        window = self._window.get(table)
        if not window:
            return None
        named = np.zeros(len(ids), dtype=bool)
        for uid in window.values():
            if len(uid):
                named |= find_sorted(uid, ids)[1]
        return named

    def next_use(self, table: str, tier: CacheTier) -> np.ndarray | None:
        """Per slot of ``tier``, the step of its row's next announced use, NOT_IN_WINDOW
        if none or the slot is free; None without a window. Valid until the next call."""
        window = self._window.get(table)
        if not window:
            return None
        out = self._next_use_out.get((table, tier.name))
        if out is None or len(out) != tier.capacity:  # kept for the next step: a fresh one page-faults at 1M slots
            out = self._next_use_out[(table, tier.name)] = np.empty(tier.capacity, dtype=np.int64)
        out.fill(NOT_IN_WINDOW)
        # The tier's index is probed for every announced id: a hash probe (~0.1 us an id) costs
        # less than a binary search of the tier's ids sorted, even before the sort (505k slots,
        # 125k ids announced: 14 ms probing, 50 ms sorting and searching).
        for step in sorted(window, reverse=True):  # the earliest step written last wins
            if len(window[step]):
                slots = tier.lookup(torch.from_numpy(window[step])).cpu().numpy()
                out[slots[slots >= 0]] = step
        return out

    # -- releasing -----------------------------------------------------------------------
    def _release(self, ticket: PrefetchTicket) -> None:
        with self._uses.lock:
            table = ticket.table
            self._window.get(table, {}).pop(ticket.step, None)
            queue = self._outstanding.get(table)
            if queue and ticket in queue:
                queue.remove(ticket)
            staging = self._staged.get(table)
            pins = self._pins.get(table, {})
            due = [slots for step in [s for s in pins if s <= ticket.step] for slots in pins.pop(step)]
            if staging is not None and staging.resident and due:
                # unpin rows no later announced batch needs: of the slots pinned until now, those
                # still staged and not pinned since for a later batch
                slots = torch.unique(torch.cat(due))
                staging.remove(masked(slots, (staging.ids.index_select(0, slots) >= 0) & (staging.last.index_select(0, slots) <= ticket.step)))
                if table in self._uses.tables:
                    self._uses.tables[table].counters.prefetch.staged_rows = staging.resident

    def _pin(self, table: str, step: int, slots: torch.Tensor) -> None:
        """Note staging slots pinned until announced step ``step``: its release looks at
        these, not at every slot of staging (as large as the DDR tier: 1M slots took ~1 ms)."""
        self._pins.setdefault(table, {}).setdefault(step, []).append(slots)

    def _delivered(self, ticket: PrefetchTicket) -> None:
        with self._uses.lock:
            pending = self._undelivered.get(ticket.table, [])
            if ticket in pending:
                pending.remove(ticket)

    def _written_since(self, table: str, seq: int) -> np.ndarray:
        """Ids written since write ``seq``, sorted unique (searched while the store lock is held)."""
        entries = [ids for s, ids in self._log.get(table, []) if s >= seq]
        return unique_ids(np.concatenate(entries)) if entries else np.empty(0, dtype=np.int64)

    def _prune_log(self) -> None:
        oldest = min(self._inflight.values(), default=self._write_seq)
        for table, entries in self._log.items():
            self._log[table] = [(s, ids) for s, ids in entries if s >= oldest]

    def state(self) -> dict:
        """What is pending: for tests and `close()` checks."""
        return {
            "inflight": len(self._inflight),
            "staged_rows": sum(t.resident for t in self._staged.values() if t is not None),
            "window_batches": sum(len(w) for w in self._window.values()),
            "outstanding": sum(len(q) for q in self._outstanding.values()),
            "reading_ahead": self.reading_ahead(),
            "row_read_us": None if self._read_seconds is None else self._read_seconds * 1e6,
        }

    def close(self) -> None:
        """Wait for fetches in flight, release everything, stop owned threads.
        Called without the store lock (landing fetches take it)."""
        with self._uses.lock:
            self._idle.wait_for(lambda: not self._inflight, timeout=60)
            for queue in list(self._outstanding.values()):
                for ticket in list(queue):
                    ticket.release()
        if self._owns_executor and self._executor is not None:
            self._executor.shutdown(wait=True)


def _naming_batch(error: BaseException, table: str, step: int) -> BaseException:
    """A prefetch's failure as the trainer's thread raises it at its batch: the
    exception the same read raises without prefetch (a bad id stays an IndexError,
    an LMDB fault the backend's error), its message naming the batch."""
    where = f"(raised by the prefetch of table {table!r} for batch {step})"
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} {where}",)
    elif hasattr(error, "add_note"):
        error.add_note(where)
    return error


def _covers(uid: np.ndarray, want: np.ndarray) -> bool:
    """Whether sorted unique ``uid`` holds every id of sorted unique ``want``. The usual
    read is the very batch announced (equal arrays: one comparison); the next batch
    announced usually fails on a few ids sampled first, before a search of all."""
    if len(want) > len(uid):
        return False
    if len(want) == len(uid):
        return bool(np.array_equal(uid, want))
    return bool(find_sorted(uid, want[:: max(1, len(want) // 16)])[1].all() and find_sorted(uid, want)[1].all())


def _smoothed(average: float | None, value: float, weight: float = 0.25) -> float:
    return value if average is None else (1 - weight) * average + weight * value
