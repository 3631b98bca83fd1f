"""Prometheus export: real stores on disk, the real HTTP endpoint over loopback,
parsed with prometheus_client's own parser, checked against stats() and an
independent LRU model."""
from __future__ import annotations

import json
import math
import re
import socket
import threading
import urllib.error
import urllib.request
from importlib import resources

import numpy as np
import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import tierstore
from tierstore.engine.counters import LATENCY_BUCKETS, StageHistogram
from tierstore.metrics import METRICS, MetricsServer
from tierstore.metrics.collector import PREFETCH

STAT_OF = {"hits": ("tierstore_lookups_total", {"result": "hit"}), "misses": ("tierstore_lookups_total", {"result": "miss"}),
           "evictions": ("tierstore_evictions_total", {}), "writebacks": ("tierstore_writeback_rows_total", {})}
SSD_OF = {"reads": "tierstore_ssd_read_rows_total", "read_bytes": "tierstore_ssd_read_bytes_total",
          "writes": "tierstore_ssd_write_rows_total", "write_bytes": "tierstore_ssd_write_bytes_total"}


class Scrape:
    """Samples of one exposition, parsed by prometheus_client.parser."""

    def __init__(self, text: str):
        self.text = text
        self.samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def find(self, name: str, **labels) -> list:
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels) -> float:
        found = self.find(name, **labels)
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
        return found[0].value

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def http_scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return Scrape(r.read().decode())


def registry_scrape(registry) -> Scrape:
    return Scrape(generate_latest(registry).decode())


class RefLRU:
    """The store's LRU semantics, written independently and per id: one
    recency list of h + d rows (most recent first) whose first h are in HBM;
    within a call, recency follows first position."""

    def __init__(self, h: int, d: int):
        self.h, self.d, self.order = h, d, []

    def call(self, ids) -> tuple[int, int, int]:
        uniq = list(dict.fromkeys(int(i) for i in ids))
        pos = {x: i for i, x in enumerate(self.order)}
        in_h = sum(1 for x in uniq if pos.get(x, math.inf) < self.h)
        in_d = sum(1 for x in uniq if self.h <= pos.get(x, math.inf) < self.h + self.d)
        used = set(uniq)
        self.order = (uniq[::-1] + [x for x in self.order if x not in used])[: self.h + self.d]
        return in_h, in_d, len(uniq)


def zipf_ids(rng, n, rows):
    return (rng.zipf(1.3, n) - 1) % rows


def check_equals_stats(scrape: Scrape, store: tierstore.TieredStore) -> None:
    label = store.metrics.label
    for table, st_ in store.stats(per_table=True).items():
        tiers = set(store.snapshot().tables[table].tiers)
        for tier in ("hbm", "ddr"):
            if tier not in tiers:  # a tier the table does not have is not exported
                assert not scrape.find("tierstore_lookups_total", store=label, table=table, tier=tier)
                assert all(v == 0 for v in st_[tier].values())
                continue
            for key, (name, extra) in STAT_OF.items():
                assert scrape.value(name, store=label, table=table, tier=tier, **extra) == st_[tier][key], (table, tier, key)
            assert scrape.value("tierstore_resident_rows", store=label, table=table, tier=tier) == store.resident_rows(table)[tier]
        for key, name in SSD_OF.items():
            assert scrape.value(name, store=label, table=table) == st_["ssd"][key], (table, key)


def workload(store, rng, calls=12, writes=True):
    for i in range(calls):
        for table, spec in store.tables.items():
            rows = spec.num_rows or 5_000
            ids = zipf_ids(rng, int(rng.integers(1, 200)), rows)
            store.read(table, ids)
            if writes and i % 3 == 0:
                w = zipf_ids(rng, 40, rows)
                store.write(table, w, rng.standard_normal((len(w), spec.dim)).astype(np.float32))
        if i == calls // 2:
            store.flush()


@pytest.fixture
def registry():
    return CollectorRegistry()


def two_table_store(path, registry, **kw):
    tables = [tierstore.TableSpec("user", 500, 8, state_dim=2), tierstore.TableSpec("item", None, 4)]
    return tierstore.TieredStore(path, tables, hbm_rows={"user": 16, "item": 0}, ddr_rows={"user": 64, "item": 32},
                                 device="cpu", registry=registry, **kw)


def test_scraped_counters_equal_stats_after_real_workload(tmp_path, registry):
    with two_table_store(tmp_path / "s", registry) as store:
        workload(store, np.random.default_rng(0))
        server = store.serve_metrics(0)
        assert server.addr == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
        scrape = http_scrape(server.url)
        check_equals_stats(scrape, store)
        label = store.metrics.label
        assert label == str((tmp_path / "s").resolve())
        # the workload really moved data, so equality is not 0 == 0
        per = store.stats(per_table=True)
        assert per["user"]["hbm"]["hits"] and per["user"]["ddr"]["evictions"] and per["item"]["ssd"]["writes"]
        assert per["user"]["ddr"]["writebacks"] and per["user"]["ssd"]["read_bytes"]
        assert scrape.value("tierstore_capacity_rows", store=label, table="user", tier="hbm") == 16
        assert scrape.value("tierstore_capacity_rows", store=label, table="item", tier="ddr") == 32
        info = scrape.find("tierstore_store_info", store=label)[0]
        assert info.value == 1 and info.labels["policy"] == "lru" and info.labels["readonly"] == "false"


def test_hit_ratio_is_hits_over_lookups_per_table_and_tier(tmp_path, registry):
    with two_table_store(tmp_path / "s", registry) as store:
        server = store.serve_metrics(0)
        before = http_scrape(server.url)
        for tier in ("ddr",):  # no lookups yet: 0/0 is NaN, not 0 or 1
            assert math.isnan(before.value("tierstore_hit_ratio", table="item", tier=tier))
        workload(store, np.random.default_rng(1))
        scrape = http_scrape(server.url)
        per = store.stats(per_table=True)
        checked = 0
        for s in scrape.find("tierstore_hit_ratio"):
            table, tier = s.labels["table"], s.labels["tier"]
            hits = scrape.value("tierstore_lookups_total", table=table, tier=tier, result="hit")
            misses = scrape.value("tierstore_lookups_total", table=table, tier=tier, result="miss")
            assert s.value == pytest.approx(hits / (hits + misses), rel=1e-12)
            c = per[table][tier]
            assert s.value == pytest.approx(c["hits"] / (c["hits"] + c["misses"]), rel=1e-12)
            assert 0 < s.value < 1
            checked += 1
        assert checked == 3  # user/hbm, user/ddr, item/ddr


@settings(max_examples=25, deadline=None)
@given(h=st.integers(0, 12), d=st.integers(0, 24),
       calls=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=30), min_size=1, max_size=12))
def test_exported_lookups_match_an_independent_lru_model(tmp_path_factory, h, d, calls):
    registry = CollectorRegistry()
    path = tmp_path_factory.mktemp("lru")
    model = RefLRU(h, d)
    want = {"hbm": [0, 0], "ddr": [0, 0]}
    ssd_calls = 0
    with tierstore.TieredStore(path, [tierstore.TableSpec("t", 41, 2)], hbm_rows=h, ddr_rows=d, device="cpu",
                               registry=registry, name="model") as store:
        for ids in calls:
            in_h, in_d, n = model.call(ids)
            want["hbm"][0] += in_h
            want["hbm"][1] += n - in_h
            want["ddr"][0] += in_d
            want["ddr"][1] += n - in_h - in_d
            ssd_calls += n > in_h + in_d
            store.read("t", ids)
        scrape = registry_scrape(registry)
        check_equals_stats(scrape, store)
        for tier, size in (("hbm", h), ("ddr", d)):
            if size:
                assert scrape.value("tierstore_lookups_total", table="t", tier=tier, result="hit") == want[tier][0]
                assert scrape.value("tierstore_lookups_total", table="t", tier=tier, result="miss") == want[tier][1]
        assert scrape.value("tierstore_lookup_seconds_count", table="t", stage="total") == len(calls)
        assert len(scrape.find("tierstore_lookup_seconds_count", table="t", stage="ssd_read")) == (ssd_calls > 0)
        if ssd_calls:
            assert scrape.value("tierstore_lookup_seconds_count", table="t", stage="ssd_read") == ssd_calls


def test_latency_histograms_count_calls_per_stage(tmp_path, registry):
    rng = np.random.default_rng(2)
    calls = {"total": 0, "ssd_read": 0, "writeback": 0}
    flushes = 0
    with tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 2_000, 8)], hbm_rows=32, ddr_rows=64,
                               device="cpu", registry=registry, clock=lambda: 1_700_000_000.25) as store:
        def read(ids):
            before = store.stats()
            store.read("t", ids)
            after = store.stats()
            calls["total"] += 1
            calls["ssd_read"] += after["ssd"]["reads"] > before["ssd"]["reads"]
            calls["writeback"] += after["ddr"]["writebacks"] > before["ddr"]["writebacks"]

        for i in range(40):
            read(zipf_ids(rng, int(rng.integers(1, 300)), 2_000))
            if i % 2:
                read([7, 8, 9])
                read([9, 8])  # all cached now: served without touching LMDB
            store.read("t", [])  # empty reads are not timed
            if i % 4 == 0:
                hot = np.arange(10)  # cached rows made dirty, so later evictions write back
                store.write("t", hot, np.full((10, 8), i, dtype=np.float32))
            if i % 10 == 9:
                store.flush()
                flushes += 1
        scrape = registry_scrape(registry)
        assert calls["writeback"] and calls["ssd_read"] < calls["total"]
        for stage, n in calls.items():
            assert scrape.value("tierstore_lookup_seconds_count", table="t", stage=stage) == n, stage
        stages = {s.labels["stage"] for s in scrape.find("tierstore_lookup_seconds_count")}
        assert stages <= {"dedupe", "hbm", "ddr", "ssd_read", "writeback", "total"}
        for stage in stages:
            buckets = scrape.find("tierstore_lookup_seconds_bucket", table="t", stage=stage)
            les = [float(b.labels["le"]) for b in buckets]
            counts = [b.value for b in buckets]
            assert les == sorted(les) and les[-1] == math.inf and les[:-1] == list(LATENCY_BUCKETS)
            assert counts == sorted(counts)  # cumulative
            assert counts[-1] == scrape.value("tierstore_lookup_seconds_count", table="t", stage=stage)
            assert scrape.value("tierstore_lookup_seconds_sum", table="t", stage=stage) > 0
        # a stage takes part of the call: its total time is below the calls' total time
        total = scrape.value("tierstore_lookup_seconds_sum", stage="total")
        assert all(scrape.value("tierstore_lookup_seconds_sum", stage=s) < total for s in stages - {"total"})
        assert scrape.value("tierstore_flushes_total") == flushes
        assert scrape.value("tierstore_flush_seconds_count") == flushes
        assert scrape.value("tierstore_last_flush_timestamp_seconds") == 1_700_000_000.25


def test_observations_per_call_do_not_grow_with_batch_size(tmp_path, registry):
    """The hot path records a few numbers per call, never one per id."""
    with tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 100_000, 4)], hbm_rows=1_000, ddr_rows=4_000,
                               device="cpu", registry=registry) as store:
        hist = store.snapshot().tables["t"].counters.latency
        for batch in (10, 10_000, 50_000):
            before = sum(sum(c) for c, _ in hist.snapshot().values())
            store.read("t", np.random.default_rng(batch).integers(0, 100_000, batch))
            observed = sum(sum(c) for c, _ in hist.snapshot().values()) - before
            assert 1 <= observed <= 6, (batch, observed)


def test_two_stores_in_one_registry_do_not_collide(tmp_path, registry):
    a = two_table_store(tmp_path / "a", registry)
    b = tierstore.TieredStore(tmp_path / "b", [tierstore.TableSpec("user", 100, 4)], ddr_rows=10, device="cpu",
                              registry=registry, name="ranker")
    try:
        workload(a, np.random.default_rng(3))
        workload(b, np.random.default_rng(4), calls=5)
        assert a.metrics.label == str((tmp_path / "a").resolve()) and b.metrics.label == "ranker"
        server = a.serve_metrics(0)  # one endpoint serves every store in the registry
        scrape = http_scrape(server.url)
        check_equals_stats(scrape, a)
        check_equals_stats(scrape, b)
        users = scrape.find("tierstore_lookups_total", table="user", tier="ddr", result="hit")
        assert {s.labels["store"] for s in users} == {a.metrics.label, "ranker"}
        # each family appears once in the exposition, with both stores' samples
        assert scrape.text.count("# TYPE tierstore_lookups_total counter") == 1
        with pytest.raises(ValueError, match="name 'ranker' is already exported"):
            tierstore.TieredStore(tmp_path / "c", [tierstore.TableSpec("x", 10, 2)], registry=registry, name="ranker")
        # the refused store released its files: it opens fine under another name,
        # and the same name is free in another registry
        tierstore.TieredStore(tmp_path / "c", registry=registry, name="other").close()
        tierstore.TieredStore(tmp_path / "c", registry=CollectorRegistry(), name="ranker").close()
        # a name may not take another store's default label either
        with pytest.raises(ValueError, match="already exported"):
            tierstore.TieredStore(tmp_path / "c", registry=registry, name=a.metrics.label)
    finally:
        a.close()
        b.close()


def test_close_unregisters_and_stops_the_endpoint(tmp_path, registry):
    a = two_table_store(tmp_path / "a", registry)
    b = tierstore.TieredStore(tmp_path / "b", [tierstore.TableSpec("u", 100, 4)], ddr_rows=10, device="cpu", registry=registry)
    workload(a, np.random.default_rng(5), calls=3)
    server_a = a.serve_metrics(0)
    server_b = b.serve_metrics(0)
    assert http_scrape(server_a.url).find("tierstore_flushes_total", store=a.metrics.label)
    a.close()
    assert server_a.closed
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server_a.url, timeout=5)
    left = http_scrape(server_b.url)
    assert {s.labels["store"] for s in left.samples if "store" in s.labels} == {b.metrics.label}
    b.close()
    assert not list(registry.collect())  # the collector left with the last store
    with pytest.raises(RuntimeError, match="closed"):
        b.serve_metrics(0)
    # the registry takes stores again afterwards
    with tierstore.TieredStore(tmp_path / "b", registry=registry, device="cpu") as again:
        assert registry_scrape(registry).find("tierstore_flushes_total", store=again.metrics.label)


def test_metrics_port_starts_the_endpoint_when_the_store_opens(tmp_path, registry):
    store = tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 100, 4)], ddr_rows=10, device="cpu",
                                  registry=registry, metrics_port=0)
    (server,) = store.metrics.servers
    store.read("t", [1, 2, 3, 3])
    scrape = http_scrape(f"http://127.0.0.1:{server.port}/metrics")
    assert scrape.value("tierstore_lookups_total", table="t", tier="ddr", result="miss") == 3
    store.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)


def test_default_registry_is_prometheus_clients_global_one(tmp_path):
    store = tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 100, 4)], ddr_rows=10, device="cpu", name="global-test")
    try:
        store.read("t", [5])
        assert registry_scrape(prometheus_client.REGISTRY).value("tierstore_lookups_total", store="global-test", result="miss") == 1
    finally:
        store.close()
    assert not registry_scrape(prometheus_client.REGISTRY).find("tierstore_lookups_total", store="global-test")


@pytest.mark.parametrize("kw, err, match", [
    ({"metrics_port": -1}, ValueError, "0..65535"),
    ({"metrics_port": 70_000}, ValueError, "0..65535"),
    ({"metrics_port": "9100"}, TypeError, "must be an int"),
    ({"metrics_port": True}, TypeError, "must be an int"),
    ({"metrics_port": 0, "metrics_addr": None}, TypeError, "addr"),
    ({"registry": object()}, TypeError, "CollectorRegistry"),
    ({"name": ""}, ValueError, "non-empty string"),
])
def test_bad_metrics_arguments_are_refused_before_anything_opens(tmp_path, kw, err, match):
    with pytest.raises(err, match=match):
        tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 10, 2)], device="cpu", **kw)
    assert not (tmp_path / "s").exists()


def test_busy_port_says_how_to_fix_it_and_releases_the_store(tmp_path, registry):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match="another metrics port, or 0 for a free one"):
            tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 10, 2)], device="cpu", registry=registry, metrics_port=port)
    assert not list(registry.collect())
    tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 10, 2)], device="cpu", registry=registry).close()


def test_scrapes_during_reads_in_another_thread_are_monotonic(tmp_path, registry):
    store = two_table_store(tmp_path / "s", registry)
    server = store.serve_metrics(0)
    stop, errors = threading.Event(), []

    def reader():
        rng = np.random.default_rng(6)
        try:
            while not stop.is_set():
                store.read("user", zipf_ids(rng, 256, 500))
                store.write("user", zipf_ids(rng, 16, 500), np.ones((16, 8), dtype=np.float32))
        except Exception as e:  # surfaced below
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        previous: dict = {}
        for _ in range(15):
            scrape = http_scrape(server.url)
            for s in scrape.samples:
                if s.name.endswith(("_total", "_count", "_bucket")):
                    key = (s.name, tuple(sorted(s.labels.items())))
                    assert s.value >= previous.get(key, 0), key
                    previous[key] = s.value
    finally:
        stop.set()
        thread.join()
    assert not errors
    check_equals_stats(http_scrape(server.url), store)
    store.close()


def test_prefetch_counters_are_exported(tmp_path, registry):
    """A real prefetch shows up on the next scrape as the prefetcher counted it."""
    # sync_read_us 0: read ahead however fast LMDB is (the counters of a real fetch are what is tested)
    with two_table_store(tmp_path / "s", registry, prefetch=tierstore.PrefetchConfig(sync_read_us=0)) as store:
        store.write("item", np.arange(1_000, 1_020), np.ones((20, 4), dtype=np.float32))
        store.flush()  # in LMDB now: queued rows would be served from the write-back queue, not prefetched
        ticket = store.prefetch("item", np.arange(1_000, 1_020))  # fits the staging area
        ticket.wait()
        scrape = registry_scrape(registry)
        pre = store.prefetch_stats()["tables"]
        assert pre["item"]["issued_rows"] == 20 and pre["item"]["staged_rows"] == 20
        for field, kind, name, _ in PREFETCH:
            sample = name + ("_total" if kind == "counter" else "")
            for table in ("item", "user"):
                assert scrape.value(sample, table=table) == pre[table][field], (table, field)
        store.read("item", np.arange(1_000, 1_020))  # served from staging, not LMDB
        ticket.release()
        scrape = registry_scrape(registry)
        assert scrape.value("tierstore_prefetch_served_rows_total", table="item") == 20
        assert scrape.value("tierstore_prefetch_staged_rows", table="item") == 0
        # the lead: batches ahead with their prefetch issued while a LookaheadLoader runs
        batches = [np.arange(2_000 + 5 * i, 2_005 + 5 * i) for i in range(5)]
        leads = []
        for batch in tierstore.LookaheadLoader(batches, store, depth=2, ids=lambda b: {"item": b}):
            leads.append(registry_scrape(registry).value("tierstore_prefetch_lead_steps", table="item"))
            store.read("item", batch)
        assert leads == [2, 2, 2, 1, 0]
        assert registry_scrape(registry).value("tierstore_prefetch_lead_steps", table="item") == 0


def test_last_flush_survives_reopen_and_is_absent_when_never_flushed(tmp_path, registry):
    spec = tierstore.TableSpec("t", 10, 2)
    with tierstore.TieredStore(tmp_path / "s", [spec], device="cpu", registry=registry) as store:
        assert not registry_scrape(registry).find("tierstore_last_flush_timestamp_seconds")
    # close() flushed with the default clock (time.time); the reopened store reads that time from disk
    with tierstore.TieredStore(tmp_path / "s", device="cpu", registry=registry, clock=lambda: 123.0) as store:
        on_disk = registry_scrape(registry).value("tierstore_last_flush_timestamp_seconds")
        assert on_disk > 1_600_000_000  # time.time() of the first store's close
        assert registry_scrape(registry).value("tierstore_flushes_total") == 0
        store.flush()
        assert registry_scrape(registry).value("tierstore_last_flush_timestamp_seconds") == 123.0


def test_every_declared_metric_is_exported(tmp_path, registry):
    with two_table_store(tmp_path / "s", registry) as store:
        workload(store, np.random.default_rng(7))
        names = registry_scrape(registry).names()
    for kind, name, _, _ in METRICS:
        expected = {"counter": name + "_total", "histogram": name + "_count"}.get(kind, name)
        assert expected in names, expected


def test_grafana_dashboard_queries_only_exported_metrics(tmp_path, registry):
    dashboard = json.loads(resources.files("tierstore.tools").joinpath("grafana-dashboard.json").read_text())
    with two_table_store(tmp_path / "s", registry) as store:
        workload(store, np.random.default_rng(8))
        exported = registry_scrape(registry).names()

    def panels(d):
        for p in d.get("panels", []):
            yield p
            yield from panels(p)

    exprs = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in panels(dashboard)}
    used = {m for es in exprs.values() for e in es for m in re.findall(r"\btierstore_[a-z_]+", e)}
    sharded = {m for m in used if m.startswith("tierstore_sharded_")}  # a sharded collection's: test_distributed
    assert used and used - sharded <= exported, used - sharded - exported
    text = json.dumps(exprs)
    for needed in ("tierstore_lookups_total", "tierstore_ssd_read_bytes_total", "tierstore_ssd_write_bytes_total",
                   "tierstore_evictions_total", "tierstore_prefetch_lead_steps", "tierstore_lookup_seconds_bucket"):
        assert needed in text, needed
    assert all("$store" in e for es in exprs.values() for e in es if "tierstore_sharded_" not in e)


@given(st.lists(st.floats(0, 20, allow_nan=False), max_size=50))
def test_stage_histogram_buckets_follow_prometheus_le(values):
    h = StageHistogram()
    for v in values:
        h.observe("s", v)
    if not values:
        assert h.snapshot() == {}
        return
    counts, total = h.snapshot()["s"]
    bounds = np.array(LATENCY_BUCKETS + (math.inf,))
    want = [int(np.sum(np.asarray(values) <= b)) for b in bounds]  # le: at most the bound
    assert list(np.cumsum(counts)) == want
    assert total == pytest.approx(sum(values))


def test_stage_histogram_rejects_bad_bounds():
    for bad in ((), (0.1, 0.1), (0.2, 0.1), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="strictly increasing"):
            StageHistogram(bad)


def test_metrics_server_serves_any_registry_and_closes_idempotently(registry):
    with MetricsServer(registry, 0) as server:
        assert http_scrape(server.url).samples == []
    server.close()
    assert server.closed


def test_writeback_queue_gauge_counts_rows_not_yet_committed(tmp_path, registry, monkeypatch):
    with tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 100, 2)], device="cpu", registry=registry) as store:
        gate = threading.Event()
        real = store._backend.put_rows  # latency injection: LMDB commits wait for the gate
        monkeypatch.setattr(store._backend, "put_rows", lambda *a, **k: (gate.wait(30), real(*a, **k))[1])
        store.write("t", np.arange(7), np.ones((7, 2), dtype=np.float32))  # not cached: queued for LMDB
        assert registry_scrape(registry).value("tierstore_writeback_queue_rows") == 7
        gate.set()
        store.flush()
        assert registry_scrape(registry).value("tierstore_writeback_queue_rows") == 0
