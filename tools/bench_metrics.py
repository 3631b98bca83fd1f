"""``tierstore bench metrics``: read throughput while Prometheus scrapes the
store over HTTP, against the same store with nothing scraping, in one run.

Blocks of reads alternate between the two modes (which one goes first
alternates too), so drift in the machine's load falls on both alike; the
ratio is of the median block times. The per-call stage timings are always
on; their own cost is measured separately and printed as a share of a read.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request

import numpy as np
import torch
from prometheus_client import CollectorRegistry

SCRAPE_INTERVAL_S = 0.1  # 150x Prometheus' default 15 s: a deliberately harsh load
BLOCK_S = 0.4  # a block spans several scrape intervals, so every 'on' block is scraped


class Scraper:
    """Scrapes ``url`` every ``interval`` seconds while ``running`` is set."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval = url, interval
        self.running, self._stop = threading.Event(), threading.Event()
        self.seconds: list[float] = []
        self.body_bytes = 0
        self._thread = threading.Thread(target=self._loop, name="bench-scraper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.running.wait(0.05):
                continue
            t0 = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=10) as r:
                self.body_bytes = len(r.read())
            self.seconds.append(time.perf_counter() - t0)
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _zipf_batches(rng: np.random.Generator, rows: int, batch: int, count: int, alpha: float = 1.05) -> list[torch.Tensor]:
    # Zipf over a permutation, so hot rows are spread over the id space
    perm = rng.permutation(rows)
    weights = 1.0 / np.arange(1, rows + 1) ** alpha
    cdf = np.cumsum(weights / weights.sum())
    return [torch.from_numpy(perm[np.minimum(np.searchsorted(cdf, rng.random(batch)), rows - 1)]) for _ in range(count)]


def _timing_mark_cost(repeat: int = 200_000) -> float:
    """Seconds per stage observation as the store makes it: two clock reads and observe()."""
    from tierstore.counters import StageHistogram

    hist, perf = StageHistogram(), time.perf_counter
    t0 = perf()
    for _ in range(repeat):
        mark = perf()
        hist.observe("stage", perf() - mark)
    return (perf() - t0) / repeat


def _scenario(args, title: str, hbm_rows: int, ddr_rows: int, warm_all: bool) -> tuple[float, float]:
    import tierstore
    from tierstore.tools.bench import report

    n, dim, batch = args.rows, args.dim, args.batch
    rng = np.random.default_rng(args.seed)
    registry = CollectorRegistry()
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=args.dir) as d:
        store = tierstore.TieredStore(d, [tierstore.TableSpec("t", n, dim)], hbm_rows=hbm_rows, ddr_rows=ddr_rows,
                                      device=args.device, registry=registry, name="bench")
        if warm_all:
            for lo in range(0, n, 262_144):
                store.read("t", torch.arange(lo, min(n, lo + 262_144)))
        batches = [b.to(store.device) for b in _zipf_batches(rng, n, batch, 16)]
        it = iter(range(10**12))
        sync = torch.cuda.synchronize if store.device.type == "cuda" else (lambda: None)

        def block(reads: int) -> float:
            t0 = time.perf_counter()
            for _ in range(reads):
                store.read("t", batches[next(it) % len(batches)])
            sync()
            return (time.perf_counter() - t0) / reads

        server = store.serve_metrics(0)
        scraper = Scraper(server.url, SCRAPE_INTERVAL_S)
        warm = min(block(4) for _ in range(3))  # warm-up: caches, allocator
        reads = max(4, int(BLOCK_S / warm))
        times = {"off": [], "on": []}
        hist = store._tables["t"].counters.latency
        obs0 = sum(sum(c) for c, _ in hist.snapshot().values())
        calls0 = hist.snapshot().get("total", ([0], 0))[0]
        before = store.stats()
        try:
            for r in range(args.repeat):
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    if mode == "on":
                        scraper.running.set()
                    else:
                        scraper.running.clear()
                    times[mode].append(block(reads))
        finally:
            scraper.running.clear()
            scraper.close()
        snap = hist.snapshot()
        calls = sum(snap["total"][0]) - sum(calls0)
        obs_per_read = (sum(sum(c) for c, _ in snap.values()) - obs0) / max(calls, 1)
        after = store.stats()
        store.close()
    t_off, t_on = statistics.median(times["off"]), statistics.median(times["on"])
    mark = _timing_mark_cost()
    hbm = {k: after["hbm"][k] - before["hbm"][k] for k in ("hits", "misses")}
    hit_hbm = hbm["hits"] / max(1, hbm["hits"] + hbm["misses"])
    report(
        f"metrics: {title}",
        {"rows": n, "dim": dim, "batch": batch, "hbm_rows": hbm_rows, "ddr_rows": ddr_rows, "device": args.device,
         "blocks": f"{args.repeat} x {reads} reads per mode", "HBM hit ratio": f"{hit_hbm:.3f}"},
        [("metrics off (not scraped)", f"{t_off * 1e3:8.2f} ms/read  {batch / t_off / 1e6:6.2f} M ids/s"),
         ("metrics on (scraped over HTTP)", f"{t_on * 1e3:8.2f} ms/read  {batch / t_on / 1e6:6.2f} M ids/s"),
         ("scrapes during 'on' blocks", f"{len(scraper.seconds)} every {SCRAPE_INTERVAL_S * 1e3:.0f} ms, median "
          f"{statistics.median(scraper.seconds) * 1e3 if scraper.seconds else float('nan'):.2f} ms, {scraper.body_bytes:,} bytes"),
         ("stage timings (always on)", f"{obs_per_read:.1f} observations/read x {mark * 1e9:.0f} ns = "
          f"{obs_per_read * mark * 1e6:.2f} us/read ({100 * obs_per_read * mark / t_off:.3f}% of a read)")],
        "on / off read throughput", t_off / t_on, ">= 0.97",
    )
    return t_off, t_on


def run(args: argparse.Namespace) -> None:
    n = args.rows
    _scenario(args, "Zipf reads through HBM, DDR and LMDB", hbm_rows=n // 16, ddr_rows=n // 8, warm_all=False)
    _scenario(args, "every row resident (the fastest read, so the largest relative cost)", hbm_rows=n, ddr_rows=0, warm_all=True)
