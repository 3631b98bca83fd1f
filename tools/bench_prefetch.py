"""``tierstore bench prefetch``: the training step with cold rows, by prefetch
depth, against the step with every row resident; and the hit rate of lookahead
eviction against LRU, LFU and Belady's optimum."""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np
import torch

import tierstore
from tierstore.prefetch import LookaheadLoader, PrefetchConfig

ROWS, DIM, BAGS, POOLING, STEPS = 200_000, 64, 256, 16, 40


def _batches(steps: int, seed: int) -> list:
    from tierstore.tools.synth import ZipfSampler

    rng = np.random.default_rng(seed)
    zipf = ZipfSampler(ROWS, 1.05)
    perm = rng.permutation(ROWS)  # popular rows spread over the key space, as in real tables
    offsets = torch.arange(0, BAGS * POOLING, POOLING)
    return [(torch.from_numpy(perm[zipf.sample(rng, BAGS * POOLING) - 1]), offsets) for _ in range(steps)]


def _model(path, ddr_rows: int, latency_us: float, workers: int):
    store = tierstore.TieredStore(path, ddr_rows=ddr_rows, device="cpu", prefetch=PrefetchConfig(workers=workers))
    emb = tierstore.TieredEmbeddingBag(ROWS, DIM, mode="sum", store=store, table="t0", optimizer=tierstore.optim.SGD(lr=0.01))
    if latency_us:
        real = emb.store._backend.get_rows

        def slow_get_rows(table, ids, out):  # a disk that serves a row every latency_us per thread
            time.sleep(len(ids) * latency_us * 1e-6)
            return real(table, ids, out)

        emb.store._backend.get_rows = slow_get_rows
    return emb


def _drop_page_cache(path) -> None:
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _step_ms(emb, data, depth: int) -> tuple[float, float]:
    times = []
    loader = LookaheadLoader(data, emb, depth=depth)
    t_prev = time.perf_counter()
    for ids, offsets in loader:
        emb(ids, offsets).pow(2).sum().backward()
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
    steady = times[len(times) // 4:]  # past the start, where the window fills
    return statistics.median(steady) * 1e3, statistics.mean(steady) * 1e3


def bench_steps(args) -> None:
    latency = getattr(args, "latency_us", 50.0)
    data = _batches(STEPS, args.seed)
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=args.dir) as d:
        base = os.path.join(d, "rows")
        with tierstore.TieredStore(base, [tierstore.TableSpec("t0", ROWS, DIM, state_dim=0)], device="cpu") as s:
            rng = np.random.default_rng(0)
            for lo in range(0, ROWS, 50_000):
                ids = np.arange(lo, lo + 50_000)
                s.write("t0", ids, rng.standard_normal((len(ids), DIM), dtype=np.float32))
        emb = _model(base, ROWS, 0, 8)
        for lo in range(0, ROWS, 50_000):
            emb.store.read("t0", torch.arange(lo, lo + 50_000))
        resident, _ = _step_ms(emb, data, 0)
        emb.store.close()
        rows = [("every row resident in DDR", f"{resident:7.1f} ms/step", "1.00x")]
        ddr = ROWS // 20
        for mode, lat in (("injected %.0f us/row per thread" % latency, latency), ("page cache dropped (this disk)", 0.0)):
            for depth in (0, 2, 4, 8):
                emb = _model(base, ddr, lat, 8)
                _drop_page_cache(base)
                med, _ = _step_ms(emb, data, depth)
                served = emb.store.prefetch_stats()["tables"]["t0"]["served_rows"]
                emb.store.close()
                rows.append((f"{mode}, depth {depth}", f"{med:7.1f} ms/step  ({served} rows prefetched)", f"{med / resident:.2f}x"))
    print("\n== prefetch: training step (forward, backward, fused SGD) with cold rows")
    print(f"   rows={ROWS}, dim={DIM}, bags={BAGS} x pooling {POOLING} (Zipf 1.05), ddr_rows={ROWS // 20}, "
          f"hbm_rows=0, 8 prefetch threads, {STEPS} steps (median of the last 3/4)")
    w = max(len(r[0]) for r in rows)
    for label, value, ratio in rows:
        print(f"   {label:<{w}}  {value}  {ratio} of resident")
    print("   goal: depth >= 2 at most 1.15x of resident")


def bench_hit_rates(args) -> None:
    from tierstore.tools.capacity import build_streams, simulate
    from tierstore.tools.synth import SynthConfig, SynthTable, synth

    rows = 100_000
    trace = synth(SynthConfig(tables=(SynthTable("t0", rows),), alpha=1.05, batch_size=256, pooling=8.0, steps=300, seed=args.seed))
    stream = build_streams(trace)[0]
    print("\n== prefetch: hit rate of lookahead eviction (window of K batches, base LRU) vs LRU, LFU, Belady")
    print(f"   synthetic Zipf(1.05) trace: {rows} rows, 300 steps x 2048 ids; one tier")
    for frac in (0.05, 0.10):
        size = int(rows * frac)
        hits = {}
        for policy, window in (("lru", None), ("lfu", None), ("belady", None), ("lookahead", 8), ("lookahead", 32), ("lookahead", 128)):
            c = simulate(stream, size, 0, policy, window=window)
            hits[policy if window is None else f"lookahead K={window}"] = c.hbm_hits / max(1, c.hbm_hits + c.hbm_misses)
        print(f"   {frac:.0%} cached ({size} rows): " + ", ".join(f"{p} {h:.3f}" for p, h in hits.items()))
        print("      lookahead / belady: " + ", ".join(f"K={k} {hits[f'lookahead K={k}'] / hits['belady']:.2f}x" for k in (8, 32, 128)) + "  (goal >= 0.90)")


def run(args) -> None:
    bench_steps(args)
    bench_hit_rates(args)
