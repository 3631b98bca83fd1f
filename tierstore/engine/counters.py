"""Plain counters bumped on the hot path; readers (stats(), the Prometheus
collector) copy them at read time, so counting costs a few integer adds per call."""
from __future__ import annotations

import weakref
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from tierstore.errors import SettingError


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    writebacks: int = 0  # dirty rows written to LMDB when they left the cache


# TierCounters by key, for the custom ops of tierstore.training.devstep: their arguments are
# tensors and numbers, and their kernels run at each step even where torch.compile traced them once
_COUNTING: "weakref.WeakValueDictionary[int, TierCounters]" = weakref.WeakValueDictionary()


def counting(counters: TierCounters) -> int:
    """The key by which ``count_hits`` counts in ``counters``."""
    _COUNTING[id(counters)] = counters
    return id(counters)


def count_hits(key: int, hits: int) -> None:
    counters = _COUNTING.get(key)
    if counters is not None:  # -1, or the store gone: nothing to count in
        counters.hits += hits


@dataclass
class SSDCounters:
    reads: int = 0  # rows looked up in LMDB: the lookups no tier served, found or not (what capacity and plan predict)
    writes: int = 0  # rows written to LMDB
    read_bytes: int = 0  # of the rows found: (reads - initial) x row bytes
    write_bytes: int = 0
    initial: int = 0  # of the reads, rows LMDB did not hold (never written, or deleted): given their initial value, no bytes read

    def count_reads(self, rows: int, found: int, row_bytes: int) -> None:
        self.reads += rows
        self.initial += rows - found
        self.read_bytes += found * row_bytes

    def count_writes(self, rows: int, row_bytes: int) -> None:
        self.writes += rows
        self.write_bytes += rows * (8 + row_bytes)  # key and row


@dataclass
class LifeCounters:
    """Admission and eviction of a table's rows (docs/admission.md)."""

    admitted: int = 0  # row uses at or after admission: the update is kept (tables with admit_after > 1)
    rejected: int = 0  # row uses before admission: the initial value, the update dropped
    expired: int = 0  # row uses that found the row idle ttl_steps or more, or below evict_l2_below: it read as initial
    evicted: int = 0  # rows deleted from disk: by evict(), or idle rows by the background sweep


@dataclass
class TableCounters:
    hbm: TierCounters
    ddr: TierCounters
    ssd: SSDCounters
    # defined below; not in as_dict(), so stats() keeps its shape
    prefetch: "PrefetchCounters" = field(default_factory=lambda: PrefetchCounters())
    latency: "StageHistogram" = field(default_factory=lambda: StageHistogram())
    life: LifeCounters = field(default_factory=LifeCounters)

    @classmethod
    def new(cls) -> "TableCounters":
        return cls(TierCounters(), TierCounters(), SSDCounters())

    def as_dict(self) -> dict:
        return {"hbm": asdict(self.hbm), "ddr": asdict(self.ddr), "ssd": asdict(self.ssd)}


def add_dicts(a: dict, b: dict) -> dict:
    return {k: add_dicts(v, b[k]) if isinstance(v, dict) else v + b[k] for k, v in a.items()}


# Upper bounds (seconds) of the latency buckets: 5 us to 10 s, about 2.5x apart,
# so one table covers an all-HBM gather and a cold LMDB read alike.
LATENCY_BUCKETS = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


class StageHistogram:
    """Latency histograms by stage, as plain lists of bucket counts.

    ``observe`` is called once per call per stage (never per id): a bisect and
    two adds. ``counts[stage][i]`` is the number of observations in
    (bounds[i-1], bounds[i]]; the last entry is the overflow (+Inf) bucket.
    """

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        bounds = tuple(float(b) for b in bounds)
        if not bounds or any(b <= 0 for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise SettingError(f"histogram bounds must be positive and strictly increasing, got {bounds}")
        self.bounds = bounds
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, stage: str, seconds: float) -> None:
        counts = self.counts.get(stage)
        if counts is None:
            counts = self.counts[stage] = [0] * (len(self.bounds) + 1)
            self.sums[stage] = 0.0
        counts[bisect_left(self.bounds, seconds)] += 1
        self.sums[stage] += seconds

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """{stage: (bucket counts, sum of seconds)}, copied; safe to call from another thread."""
        return {stage: (list(counts), self.sums.get(stage, 0.0)) for stage, counts in list(self.counts.items())}


@dataclass
class PrefetchCounters:
    """Bumped by the prefetcher (tierstore/engine/prefetch.py); the metrics collector
    exports each field as tierstore_prefetch_* (see metrics/collector.py)."""

    queued: int = 0  # gauge: prefetch fetches issued and not yet landed (the queue depth)
    issued_batches: int = 0  # batches announced to the prefetcher
    issued_rows: int = 0  # rows fetched ahead into staging
    staged_rows: int = 0  # gauge: rows fetched ahead, pinned until read or released
    served_rows: int = 0  # rows a read took from the staged rows instead of LMDB
    dropped_rows: int = 0  # fetched rows left out: newer data appeared, or no room
    effective_depth: int = 0  # gauge: batches ahead with their prefetch issued (<= depth): the prefetch lead
    shrunk_steps: int = 0  # steps at which the window was shorter than asked (no room)
    step_read_batches: int = 0  # batches announced while LMDB was fast: their rows left to the step (sync_read_us)


@dataclass
class StoreCounters:
    """Store-wide facts: flush count, time of the last flush (store clock, from
    disk at open; None if never flushed) and flush latency."""

    flushes: int = 0
    last_flush: float | None = None
    flush_latency: StageHistogram = field(default_factory=StageHistogram)


@dataclass(frozen=True)
class TierFill:
    capacity: int  # rows the tier holds at most
    resident: int  # rows it holds now


@dataclass(frozen=True)
class TableSnapshot:
    """One table as readers see it: its counters (the live objects, read without a lock:
    plain ints and lists a reader copies) and the fill of the tiers it has."""
    counters: TableCounters
    tiers: dict[str, TierFill]  # "hbm", "ddr": only the tiers the table has


@dataclass(frozen=True)
class StoreSnapshot:
    """What stats(), stage_seconds() and the Prometheus collector read of a store
    (TieredStore.snapshot()): one public view instead of the store's internals."""
    tables: dict[str, TableSnapshot]
    store: StoreCounters
    writeback_queued_rows: int


@contextmanager
def restored_on_error(tables: "list[TableCounters]"):
    """Counts of a call that fails are taken back: a failed call changes nothing."""
    saved = [(obj, dict(vars(obj))) for c in tables for obj in (c.hbm, c.ddr, c.ssd, c.life)]
    try:
        yield
    except BaseException:
        for obj, fields in saved:
            vars(obj).update(fields)
        raise
