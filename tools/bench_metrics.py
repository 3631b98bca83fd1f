"""``tierstore bench metrics``: read throughput while Prometheus scrapes the
store over HTTP, against the same store with nothing scraping, in one run.

Blocks of reads rotate through three modes: not scraped, scraped once a
second (15x Prometheus' usual 15 s interval; the goal figure), and scraped
ten times a second (a stress figure). The order rotates too, so drift in the
machine's load falls on every mode alike; ratios are of median block times.
The scraper is a separate process, as Prometheus is, so only the endpoint's
side of a scrape lands in the measured process. The per-call stage timings
are always on; their own cost is measured separately as a share of a read.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from tierstore.tools.bench import report, shared
from tierstore.tools.bench_store import read_all

MODES = {"off": None, "1 scrape/s": 1.0, "10 scrapes/s": 0.1}  # mode -> scrape interval (s)
GOAL_MODE = "1 scrape/s"
BLOCK_S = 1.0  # a block spans a whole 1 s interval, and the scraper scrapes as a block starts

# stdin carries "every SECONDS", "off" and "quit"; a thread reads it so that the
# scrape loop never blocks on a half-read buffer
_SCRAPER = """
import json, sys, threading, time, urllib.request
url, state, changed, seconds, size = sys.argv[1], {"cmd": ["off"]}, threading.Event(), [], 0
def control():
    for line in sys.stdin:
        state["cmd"] = line.split() or ["quit"]
        changed.set()
    state["cmd"] = ["quit"]
    changed.set()
threading.Thread(target=control, daemon=True).start()
while True:
    cmd = state["cmd"]
    if cmd[0] == "quit":
        break
    if cmd[0] == "every":
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as r:
            size = len(r.read())
        seconds.append(time.perf_counter() - t0)
    changed.wait(float(cmd[1]) if cmd[0] == "every" else None)
    changed.clear()
print(json.dumps({"seconds": seconds, "bytes": size}), flush=True)
"""


class Scraper:
    """A separate process that scrapes ``url`` at the interval it is given."""

    def __init__(self, url: str):
        self._proc = subprocess.Popen([sys.executable, "-c", _SCRAPER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.seconds: list[float] = []
        self.body_bytes = 0

    def every(self, interval: float | None) -> None:
        self._send("off" if interval is None else f"every {interval}")

    def _send(self, line: str) -> None:
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._send("quit")
            result = json.loads(self._proc.stdout.readline() or "{}")
            self.seconds, self.body_bytes = result.get("seconds", []), result.get("bytes", 0)
        self._proc.wait(timeout=30)


def _zipf_batches(rng: np.random.Generator, rows: int, batch: int, count: int, alpha: float = 1.05) -> list[torch.Tensor]:
    # Zipf over a permutation, so hot rows are spread over the id space
    perm = rng.permutation(rows)
    cdf = np.cumsum(1.0 / np.arange(1, rows + 1) ** alpha)
    cdf /= cdf[-1]
    return [torch.from_numpy(perm[np.minimum(np.searchsorted(cdf, rng.random(batch)), rows - 1)]) for _ in range(count)]


def _timing_mark_cost(repeat: int = 200_000) -> float:
    """Seconds per stage observation as the store makes it: two clock reads and observe()."""
    from tierstore.engine.counters import StageHistogram

    hist, perf = StageHistogram(), time.perf_counter
    t0 = perf()
    for _ in range(repeat):
        mark = perf()
        hist.observe("stage", perf() - mark)
    return (perf() - t0) / repeat


def _observations(hist) -> tuple[int, int]:
    snap = hist.snapshot()
    return sum(sum(c) for c, _ in snap.values()), sum(snap["total"][0]) if "total" in snap else 0


def _scenario(args, title: str, hbm_rows: int, ddr_rows: int, warm_all: bool) -> float:
    import tierstore

    n, dim, batch = args.rows, args.dim, args.batch
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=args.dir) as d:
        store = tierstore.TieredStore(d, [tierstore.TableSpec("t", n, dim)], hbm_rows=hbm_rows, ddr_rows=ddr_rows,
                                      device=args.device, registry=CollectorRegistry(), name="bench")
        if warm_all:
            read_all(store, n)
        batches = [b.to(store.device) for b in _zipf_batches(rng, n, batch, 16)]
        it = iter(range(10**12))
        sync = torch.cuda.synchronize if store.device.type == "cuda" else (lambda: None)

        def block(reads: int) -> tuple[float, float]:
            """Wall and process CPU seconds per read; CPU time includes the
            endpoint's threads and excludes waiting for other processes."""
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reads):
                store.read("t", batches[next(it) % len(batches)])
            sync()
            return (time.perf_counter() - t0) / reads, (time.process_time() - c0) / reads

        server = store.serve_metrics(0)
        scraper = Scraper(server.url)
        time.sleep(0.5)  # let the scraper process start before anything is timed
        reads = max(2, int(BLOCK_S / min(block(2)[0] for _ in range(3))))
        hist = store.snapshot().tables["t"].counters.latency
        obs0, calls0 = _observations(hist)
        before = store.stats()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        order = list(MODES)
        try:
            for r in range(args.repeat):
                for mode in order[r % 3:] + order[: r % 3]:
                    scraper.every(MODES[mode])
                    wall, used = block(reads)
                    times[mode].append(wall)
                    cpu[mode].append(used)
            scraper.every(None)
        finally:
            scraper.close()
        obs1, calls1 = _observations(hist)
        after = store.stats()
        store.close()
    med = {m: statistics.median(ts) for m, ts in times.items()}
    med_cpu = {m: statistics.median(ts) for m, ts in cpu.items()}
    mark = _timing_mark_cost()
    obs_per_read = (obs1 - obs0) / max(1, calls1 - calls0)
    hbm = {k: after["hbm"][k] - before["hbm"][k] for k in ("hits", "misses")}
    rows = [(m, f"{t * 1e3:8.2f} ms/read  {batch / t / 1e6:6.2f} M ids/s  ({med['off'] / t:.3f}x);  "
                f"CPU {med_cpu[m] * 1e3:8.2f} ms/read ({med_cpu['off'] / med_cpu[m]:.3f}x)") for m, t in med.items()]
    scrape_ms = statistics.median(scraper.seconds) * 1e3 if scraper.seconds else float("nan")
    rows.append(("scrapes", f"{len(scraper.seconds)}, median {scrape_ms:.2f} ms, {scraper.body_bytes:,} bytes each"))
    rows.append(("stage timings (always on)", f"{obs_per_read:.1f} observations/read x {mark * 1e9:.0f} ns = "
                 f"{obs_per_read * mark * 1e6:.2f} us/read ({100 * obs_per_read * mark / med['off']:.4f}% of a read)"))
    report(
        f"metrics: {title}",
        {"rows": n, "dim": dim, "batch": batch, "hbm_rows": hbm_rows, "ddr_rows": ddr_rows, "device": args.device,
         "blocks": f"{args.repeat} x {reads} reads per mode",
         "HBM hit ratio": f"{hbm['hits'] / max(1, hbm['hits'] + hbm['misses']):.3f}"},
        rows, f"read throughput scraped {GOAL_MODE} / not scraped", med["off"] / med[GOAL_MODE], ">= 0.97",
    )
    return med["off"] / med[GOAL_MODE]


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "rows", "dim", "batch", "repeat", "device", "dir", "seed",
           helps={"repeat": "blocks of reads of each mode, about a second each (the median block is reported)"})


def run(args: argparse.Namespace) -> None:
    n = args.rows
    _scenario(args, "Zipf reads through HBM, DDR and LMDB", hbm_rows=n // 16, ddr_rows=n // 8, warm_all=False)
    _scenario(args, "every row resident (the fastest read, so the largest relative cost)", hbm_rows=n, ddr_rows=0, warm_all=True)
