"""Prometheus export of the stores' plain counters, read at scrape time.

The hot path only bumps integers (tierstore/engine/counters.py); this module turns
them into metric families when Prometheus scrapes. One collector serves every
store attached to a registry, because a registry refuses two collectors that
describe the same metric names: stores are told apart by the ``store`` label.

The collector reads counters without taking the store's lock, so a scrape never
stalls a read. A scrape racing a read may see that call's counters half
applied; every counter still only goes up.
"""
from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from .server import DEFAULT_ADDR, MetricsServer, check_endpoint

from tierstore.errors import ArgumentTypeError, SettingError, StoreClosedError

if TYPE_CHECKING:
    from tierstore.store import TieredStore

_S = ["store"]
_T = ["store", "table"]
_TT = ["store", "table", "tier"]

# PrefetchCounters field -> (kind, name, help), per store and table
PREFETCH = (
    ("queued", "gauge", "tierstore_prefetch_queue_depth", "Prefetch fetches issued and not yet landed."),
    ("effective_depth", "gauge", "tierstore_prefetch_lead_steps", "Batches ahead of the one being read whose prefetch is issued."),
    ("issued_batches", "counter", "tierstore_prefetch_batches", "Batches announced to the prefetcher."),
    ("issued_rows", "counter", "tierstore_prefetch_rows", "Rows fetched ahead into staging."),
    ("staged_rows", "gauge", "tierstore_prefetch_staged_rows", "Rows fetched ahead and waiting in staging."),
    ("served_rows", "counter", "tierstore_prefetch_served_rows", "Rows reads took from staging instead of LMDB."),
    ("dropped_rows", "counter", "tierstore_prefetch_dropped_rows", "Fetched rows discarded: newer data appeared, or no room."),
    ("shrunk_steps", "counter", "tierstore_prefetch_shrunk_steps", "Steps whose prefetch window was shorter than asked (no staging room)."),
    ("step_read_batches", "counter", "tierstore_prefetch_step_read_batches",
     "Batches announced while LMDB served rows fast (under sync_read_us): the step read their rows itself."),
)

# LifeCounters field -> (name, help), per store and table: admission and eviction
LIFE = (
    ("admitted", "tierstore_rows_admitted", "Row uses at or after admission (admit_after > 1): the update is kept."),
    ("rejected", "tierstore_rows_rejected", "Row uses served before admission: the initial value, the update dropped."),
    ("expired", "tierstore_rows_expired", "Row uses that found the row idle ttl_steps or more, or below evict_l2_below: it read as its initial value."),
    ("evicted", "tierstore_rows_evicted", "Rows deleted from disk: by evict(), or idle rows by the background sweep."),
)

# (kind, name, help, labels); counters are named without _total, which
# prometheus_client appends. The README's metric table follows this list.
METRICS = (
    ("counter", "tierstore_lookups", "Unique ids looked up per call, by the tier that held them (hit) or the tiers above it (miss).", _TT + ["result"]),
    ("gauge", "tierstore_hit_ratio", "hits / (hits + misses) since the store opened; NaN before the first lookup.", _TT),
    ("counter", "tierstore_evictions", "Rows that left the tier (for HBM: demotions into DDR when the table has one).", _TT),
    ("counter", "tierstore_writeback_rows", "Dirty rows written to LMDB when they left the cache (flush() writes are not write-backs).", _TT),
    ("gauge", "tierstore_resident_rows", "Rows cached in the tier now.", _TT),
    ("gauge", "tierstore_capacity_rows", "Rows the tier holds at most.", _TT),
    ("counter", "tierstore_ssd_read_rows", "Rows looked up in LMDB (lookups no tier served), found or not: "
     "tierstore_ssd_initial_rows of them were not on disk and read as their initial value.", _T),
    ("counter", "tierstore_ssd_initial_rows", "Rows looked up in LMDB that it did not hold (never written, or deleted): "
     "given their initial value, no bytes read.", _T),
    ("counter", "tierstore_ssd_read_bytes", "Row payload bytes read from LMDB: (read_rows - initial_rows) x row bytes.", _T),
    ("counter", "tierstore_ssd_write_rows", "Rows written to LMDB (write-backs, uncached writes, flushes).", _T),
    ("counter", "tierstore_ssd_write_bytes", "Bytes written to LMDB (8-byte key plus row payload per row).", _T),
    ("histogram", "tierstore_lookup_seconds", "Host wall time of read() calls by stage: dedupe, hbm, ddr, ssd_read, writeback, total.", _T + ["stage"]),
    *((kind, name, doc, _T) for _, kind, name, doc in PREFETCH),
    *(("counter", name, doc, _T) for _, name, doc in LIFE),
    ("counter", "tierstore_flushes", "Completed flush() calls since the store opened.", _S),
    ("gauge", "tierstore_last_flush_timestamp_seconds", "Store-clock time of the last flush, from disk at open; absent if never flushed.", _S),
    ("histogram", "tierstore_flush_seconds", "Wall time of flush() calls.", _S),
    ("gauge", "tierstore_writeback_queue_rows", "Rows queued for LMDB that the writer thread has not committed yet.", _S),
    ("gauge", "tierstore_memory_budget_bytes", "The store's memory_budget (docs/memory-budget.md); NaN without one.", _S),
    ("gauge", "tierstore_memory_bytes", "Host memory of each part of the store (hbm, ddr, staging, writeback, lmdb_dirty, row_index, "
     "page_cache): what it may hold (kind=allowed) and what its rows fill now (kind=used; absent where not seen).",
     _S + ["part", "kind"]),
    ("gauge", "tierstore_store_info", "Always 1; labels describe the store.", _S + ["path", "policy", "device", "readonly"]),
)
_FAMILY_TYPES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


def _new_families() -> dict[str, Metric]:
    return {name: _FAMILY_TYPES[kind](name, doc, labels=labels) for kind, name, doc, labels in METRICS}


def _add_histogram(family: HistogramMetricFamily, labels: list[str], bounds, counts: list[int], total: float) -> None:
    cumulative = list(itertools.accumulate(counts))
    buckets = [(floatToGoString(b), c) for b, c in zip(bounds, cumulative)] + [("+Inf", cumulative[-1])]
    family.add_metric(labels, buckets, total)


def _export_store(f: dict[str, Metric], label: str, store: "TieredStore") -> None:
    """Add one store's samples, read from its plain counters without its lock,
    with the store's constant labels (StoreMetrics.add_labels) after its own."""
    extra = store.metrics.labels if getattr(store, "metrics", None) is not None else {}
    before = {name: len(family.samples) for name, family in f.items()} if extra else {}
    _export_store_samples(f, label, store)
    for name, n in before.items():
        samples = f[name].samples
        samples[n:] = [s._replace(labels={**s.labels, **extra}) for s in samples[n:]]


def _export_store_samples(f: dict[str, Metric], label: str, store: "TieredStore") -> None:
    """Tiers a table does not have are left out rather than exported as zeros."""
    snap = store.snapshot()
    if snap is None:  # closed
        return
    sc = snap.store
    for name, t in snap.tables.items():
        c = t.counters
        ssd, pre, lat = asdict(c.ssd), c.prefetch, c.latency.snapshot()
        for tier, cache in t.tiers.items():
            tc = getattr(c, tier)
            hits, misses = tc.hits, tc.misses
            key = [label, name, tier]
            f["tierstore_lookups"].add_metric(key + ["hit"], hits)
            f["tierstore_lookups"].add_metric(key + ["miss"], misses)
            f["tierstore_hit_ratio"].add_metric(key, hits / (hits + misses) if hits + misses else math.nan)
            f["tierstore_evictions"].add_metric(key, tc.evictions)
            f["tierstore_writeback_rows"].add_metric(key, tc.writebacks)
            f["tierstore_capacity_rows"].add_metric(key, cache.capacity)
            f["tierstore_resident_rows"].add_metric(key, cache.resident)
        key = [label, name]
        f["tierstore_ssd_read_rows"].add_metric(key, ssd["reads"])
        f["tierstore_ssd_initial_rows"].add_metric(key, ssd["initial"])
        f["tierstore_ssd_read_bytes"].add_metric(key, ssd["read_bytes"])
        f["tierstore_ssd_write_rows"].add_metric(key, ssd["writes"])
        f["tierstore_ssd_write_bytes"].add_metric(key, ssd["write_bytes"])
        for field, _, metric, _ in PREFETCH:
            f[metric].add_metric(key, getattr(pre, field))
        for field, metric, _ in LIFE:
            f[metric].add_metric(key, getattr(c.life, field))
        for stage, (counts, total) in sorted(lat.items()):
            _add_histogram(f["tierstore_lookup_seconds"], key + [stage], c.latency.bounds, counts, total)
    f["tierstore_flushes"].add_metric([label], sc.flushes)
    if sc.last_flush is not None:
        f["tierstore_last_flush_timestamp_seconds"].add_metric([label], sc.last_flush)
    flush = sc.flush_latency.snapshot().get("flush")
    if flush is not None:
        _add_histogram(f["tierstore_flush_seconds"], [label], sc.flush_latency.bounds, *flush)
    f["tierstore_writeback_queue_rows"].add_metric([label], snap.writeback_queued_rows)
    memory = store.memory()
    f["tierstore_memory_budget_bytes"].add_metric([label], math.nan if memory.budget is None else memory.budget)
    for part, p in memory.parts.items():
        f["tierstore_memory_bytes"].add_metric([label, part, "allowed"], p.bytes)
        if p.used_bytes is not None:
            f["tierstore_memory_bytes"].add_metric([label, part, "used"], p.used_bytes)
    info = [label, str(store.path), store.config.policy, str(store.device), str(store.readonly).lower()]
    f["tierstore_store_info"].add_metric(info, 1)


class TierstoreCollector(Collector):
    """Exports every store attached to one registry. Holds stores by weak
    reference: a store dropped without close() just stops being exported."""

    def __init__(self):
        self._stores: dict[str, weakref.ref] = {}
        self._lock = threading.Lock()

    def attach(self, store: "TieredStore", name: str | None) -> str:
        """Add ``store`` under label ``name`` (default: its resolved path, then
        "path#2", "path#3", ... for readers open beside it in this process)."""
        label = name if name is not None else str(Path(store.path).resolve())
        with self._lock:
            self._stores = {k: r for k, r in self._stores.items() if r() is not None}
            if name is None:
                base, n = label, 1
                while label in self._stores:
                    n += 1
                    label = f"{base}#{n}"
            if label in self._stores:
                raise SettingError(
                    f"store name {label!r} is already exported to this registry by another open store; "
                    "pass a different name= (or close the other store first)"
                )
            self._stores[label] = weakref.ref(store)
            return label

    def detach(self, label: str) -> bool:
        """Remove a store; True when no store is left."""
        with self._lock:
            self._stores.pop(label, None)
            self._stores = {k: r for k, r in self._stores.items() if r() is not None}
            return not self._stores

    @property
    def labels(self) -> list[str]:
        with self._lock:
            return [k for k, r in self._stores.items() if r() is not None]

    def describe(self) -> Iterator[Metric]:
        # names only: lets the registry refuse another collector that claims them
        return iter(_new_families().values())

    def collect(self) -> Iterator[Metric]:
        families = _new_families()
        with self._lock:
            stores = [(label, ref()) for label, ref in self._stores.items()]
        for label, store in stores:
            if store is not None:
                _export_store(families, label, store)
        return iter(families.values())


_COLLECTORS: "weakref.WeakKeyDictionary[CollectorRegistry, TierstoreCollector]" = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK = threading.Lock()


@dataclass
class MetricsConfig:
    """How a store exports metrics.

    registry: where its collector lives (None: prometheus_client's global REGISTRY).
    name: its ``store`` label (None: its resolved path).
    port/addr: start an HTTP endpoint when the store opens (port None: none; 0: a free port).
    """

    registry: CollectorRegistry | None = None
    name: str | None = None
    port: int | None = None
    addr: str = DEFAULT_ADDR

    def __post_init__(self):
        if self.registry is None:
            self.registry = REGISTRY
        if not (callable(getattr(self.registry, "register", None)) and callable(getattr(self.registry, "unregister", None))):
            raise ArgumentTypeError(f"registry must be a prometheus_client.CollectorRegistry (or None for the global one), got {self.registry!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise SettingError(f"name (the store's metrics label) must be a non-empty string or None, got {self.name!r}")
        if self.port is not None:
            check_endpoint(self.port, self.addr)
        elif not isinstance(self.addr, str) or not self.addr:
            raise ArgumentTypeError(f"metrics addr must be a host address string such as '127.0.0.1', got {self.addr!r}")


class StoreMetrics:
    """A store's place in a registry and its HTTP endpoints: created when the
    store opens, closed (detached, endpoints stopped) when it closes."""

    def __init__(self, store: "TieredStore", config: MetricsConfig):
        self.registry = config.registry
        with _COLLECTORS_LOCK:
            collector = _COLLECTORS.get(self.registry)
            if collector is None:
                collector = TierstoreCollector()
                self.registry.register(collector)  # raises if other collectors claim tierstore_* names
                _COLLECTORS[self.registry] = collector
            self._collector = collector
            self.label = collector.attach(store, config.name)
        self.servers: list[MetricsServer] = []
        self.labels: dict[str, str] = {}
        self._closed = False
        if config.port is not None:
            try:
                self.serve(config.port, config.addr)
            except BaseException:
                self.close()
                raise

    def add_labels(self, **labels: str) -> None:
        """Constant labels on every sample of this store, after its own labels, e.g.
        rank="0" for a shard's store (tierstore.distributed)."""
        if set(labels) & {"store", "table", "tier", "result", "stage", "le"}:
            raise SettingError(f"labels {sorted(labels)} would replace the store's own labels")
        self.labels.update({k: str(v) for k, v in labels.items()})

    def serve(self, port: int, addr: str = DEFAULT_ADDR) -> MetricsServer:
        """Start an endpoint serving this store's registry (every store in it)."""
        if self._closed:
            raise StoreClosedError(f"metrics for store {self.label!r} are closed (the store was closed)")
        server = MetricsServer(self.registry, port, addr)
        self.servers.append(server)
        return server

    def close(self) -> None:
        """Stop the endpoints and leave the registry; the collector leaves the
        registry with its last store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for server in self.servers:
                server.close()
        finally:
            with _COLLECTORS_LOCK:
                if self._collector.detach(self.label) and _COLLECTORS.get(self.registry) is self._collector:
                    del _COLLECTORS[self.registry]
                    self.registry.unregister(self._collector)
