"""The store's own benchmarks (``tierstore bench read``, ``cold``, ``evict``, ``memory``,
``load``): its reads and bulk load against plain torch and py-lmdb, and its memory."""
from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

import numpy as np
import torch

from tierstore.tools.bench import interleaved_medians, report, shared


def read_all(store, n: int, table: str = "t") -> None:
    """Read every row once, in parts: brings them all into a cache that holds them."""
    for lo in range(0, n, 262_144):
        store.read(table, torch.arange(lo, min(n, lo + 262_144)))


def _workdir(directory: str | None):
    return tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=directory)


def read_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "rows", "dim", "batch", "repeat", "device", "dir", "seed")


def bench_read(args) -> None:
    """All-resident read vs torch.index_select over a plain tensor."""
    import tierstore

    device = torch.device(args.device)
    n, dim, batch = args.rows, args.dim, args.batch
    on_hbm = device.type != "cpu"
    with _workdir(args.dir) as d:
        spec = tierstore.TableSpec("t", n, dim, init=tierstore.RowInit.uniform(-1, 1, seed=args.seed))
        store = tierstore.TieredStore(d, [spec], hbm_rows=n if on_hbm else 0, ddr_rows=0 if on_hbm else n, device=device)
        read_all(store, n)
        plain = store.read("t", torch.arange(n)).to(device)
        gen = torch.Generator().manual_seed(args.seed)
        batches = [torch.randint(0, n, (batch,), generator=gen) for _ in range(8)]
        dev_batches = [b.to(device) for b in batches]
        out = torch.empty((batch, dim), device=device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        it = iter(range(10**9))

        def baseline():
            torch.index_select(plain, 0, dev_batches[next(it) % 8], out=out)
            sync()

        def tiered():
            store.read("t", dev_batches[next(it) % 8], out=out)
            sync()

        def baseline_alloc():
            plain.index_select(0, dev_batches[next(it) % 8])
            sync()

        def tiered_alloc():
            store.read("t", dev_batches[next(it) % 8])
            sync()

        t_base, t_store, t_base_alloc, t_store_alloc = interleaved_medians((baseline, tiered, baseline_alloc, tiered_alloc), args.repeat)
        assert torch.equal(store.read("t", batches[0]), plain[batches[0].to(device)])
        store.close()
    report(
        "read: every row resident" + (" in HBM" if on_hbm else " in the DDR tier (hbm_rows=0)"),
        {"rows": n, "dim": dim, "batch": batch, "device": device},
        [("torch.index_select(out=)", f"{t_base * 1e3:8.2f} ms  {batch / t_base / 1e6:6.1f} M rows/s"),
         ("TieredStore.read(out=)", f"{t_store * 1e3:8.2f} ms  {batch / t_store / 1e6:6.1f} M rows/s"),
         ("torch.index_select, new output", f"{t_base_alloc * 1e3:8.2f} ms  (store/plain {t_base_alloc / t_store_alloc:.2f}x)"),
         ("TieredStore.read, new output", f"{t_store_alloc * 1e3:8.2f} ms")],
        "store / index_select throughput", t_base / t_store, ">= 0.50",
    )


def cold_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "rows", "dim", "batch", "repeat", "dir", "seed")


def bench_cold(args) -> None:
    """Rows only in LMDB (page cache warm) vs LMDB's own floor: a raw sorted txn.get loop
    over the same rows stored a key each in a plain LMDB environment beside the store."""
    import lmdb

    import tierstore
    from tierstore.io.codecs import encode_keys

    n, dim, batch = args.rows, args.dim, args.batch
    with _workdir(args.dir) as d:
        spec = tierstore.TableSpec("t", n, dim)
        ddr = 4 * batch
        env = lmdb.open(f"{d}/raw", map_size=4 * n * (4 * dim + 64) + (64 << 20), max_dbs=1, sync=False, readahead=False)
        db = env.open_db(b"t")
        with tierstore.TieredStore(d, [spec], ddr_rows=0) as loader:
            rng = np.random.default_rng(args.seed)
            for lo in range(0, n, 262_144):
                ids = np.arange(lo, min(n, lo + 262_144))
                rows = rng.standard_normal((len(ids), dim), dtype=np.float32)
                loader.write("t", ids, rows)
                with env.begin(write=True, db=db) as txn:
                    txn.cursor().putmulti(zip(encode_keys(ids), rows.view(f"V{4 * dim}").ravel().tolist()), append=True)
        store = tierstore.TieredStore(d, hbm_rows=0, ddr_rows=ddr)
        perm = torch.from_numpy(np.random.default_rng(args.seed + 1).permutation(n))
        # consecutive slices of a permutation: each batch misses the DDR tier, which holds the last four
        batches = [perm[i * batch : (i + 1) * batch] for i in range(n // batch)]
        keys = [encode_keys(np.sort(b.numpy())) for b in batches]
        i_base, i_store = iter(range(10**9)), iter(range(10**9))

        def baseline():
            with env.begin(db=db, buffers=False) as txn:
                get = txn.get
                [get(k) for k in keys[next(i_base) % len(keys)]]

        out = torch.empty((batch, dim))

        def tiered():  # both store variants share one pass over the batches, so every read misses
            store.read("t", batches[next(i_store) % len(batches)], out=out)

        def tiered_alloc():
            store.read("t", batches[next(i_store) % len(batches)])

        for b in batches:  # warm the page cache
            baseline()
        before = store.stats()["ddr"]["hits"]
        t_base, t_store, t_store_alloc = interleaved_medians((baseline, tiered, tiered_alloc), args.repeat)
        hits = store.stats()["ddr"]["hits"] - before
        store.close()
        env.close()
    report(
        "cold read: rows only in LMDB, page cache warm",
        {"rows": n, "dim": dim, "batch": batch, "ddr_rows": ddr, "ddr hits during run": hits},
        [("raw sorted txn.get loop", f"{t_base * 1e3:8.2f} ms  {batch / t_base / 1e3:7.0f} k rows/s"),
         ("TieredStore.read(out=) (miss, insert, evict)", f"{t_store * 1e3:8.2f} ms  {batch / t_store / 1e3:7.0f} k rows/s"),
         ("TieredStore.read, new output", f"{t_store_alloc * 1e3:8.2f} ms  (store/raw loop {t_base / t_store_alloc:.2f}x)")],
        "store / raw loop throughput", t_base / t_store, ">= 0.70",
    )


def evict_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "rows", "batch", "repeat", "dir", "seed",
           helps={"rows": "rows the DDR tier holds (the table has 4x as many, of dim 16)"})


def bench_evict(args) -> dict:
    """Reads that evict from a large DDR tier vs the same reads, less their misses, from a
    store alike that holds every row they read: what misses and choosing their victims
    cost, by policy, with and without a prefetch window pinning the next batches' rows."""
    import tierstore
    from tierstore.engine.prefetch import LookaheadLoader

    capacity, batch, dim = args.rows, args.batch, 16
    misses = batch // 16
    rng = np.random.default_rng(args.seed)
    spec = tierstore.TableSpec("t", 4 * capacity, dim)  # rows never written: a miss costs no LMDB read
    # hot ids from the rows the tier holds, and misses from the rest of the table
    batches = [np.concatenate([rng.integers(0, capacity, batch - misses), rng.integers(capacity, 4 * capacity, misses)])
               for _ in range(args.repeat + 4)]
    settings = [("lru", "policy"), ("lfu", "policy"), ("lru", "lookahead")]  # lookahead: with a prefetch window
    results = {}
    with _workdir(args.dir) as d:
        for policy, eviction in settings:
            # two stores alike: one only ever reads rows it holds, the other's reads evict
            stores = [tierstore.TieredStore(os.path.join(d, f"{policy}-{eviction}-{i}"), [spec], ddr_rows=capacity, device="cpu",
                                            policy=policy, eviction=eviction) for i in range(2)]
            try:
                for store in stores:
                    read_all(store, capacity)
                held, store = stores
                resident = itertools.cycle([b[b < capacity] for b in batches])
                # with a window, the next two batches are announced as a trainer's loader announces them
                depth = 2 if eviction == "lookahead" else 0
                evicting = iter(LookaheadLoader(itertools.cycle(batches), store, depth=depth, ids=lambda b: {"t": b}))

                def reads_resident():
                    held.read("t", next(resident))

                def reads_evicting():
                    store.read("t", next(evicting))

                before = store.stats()["ddr"]["evictions"]
                t_res, t_ev = interleaved_medians((reads_resident, reads_evicting), args.repeat)
                assert held.stats()["ddr"]["evictions"] == 0
                results[(policy, eviction)] = (t_res, t_ev, (store.stats()["ddr"]["evictions"] - before) / (args.repeat + 2))
            finally:
                for s in stores:
                    s.close()
    rows = []
    for (policy, eviction), (t_res, t_ev, evicted) in results.items():
        label = f"{policy}, eviction={eviction}" + (", prefetch depth 2 (its issue and staging included)" if eviction == "lookahead" else "")
        rows.append((f"{label}: resident read / evicting read",
                     f"{t_res * 1e3:7.2f} / {t_ev * 1e3:7.2f} ms  ({t_ev / t_res:.2f}x; {evicted:,.0f} rows evicted a read)"))
    worst = max(t_ev / t_res for t_res, t_ev, _ in results.values())
    report("evict: reads that evict from a large DDR tier",
           {"ddr_rows": capacity, "table rows": 4 * capacity, "dim": dim, "batch": batch, "misses a read": misses},
           rows, "evicting read / resident read, worst setting", worst, "report only: the cost of choosing victims at this tier size")
    return results


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "dim", "batch", "dir", "seed")


def bench_memory(args) -> None:
    """A 10^9-row table with a 1M-row DDR tier: open time and resident memory."""
    import tierstore

    n, dim, ddr, batch = 10**9, args.dim, 1_000_000, args.batch
    with _workdir(args.dir) as d:
        spec = tierstore.TableSpec("huge", n, dim)
        tierstore.TieredStore(d, [spec]).close()
        rss0 = _rss_bytes()
        t0 = time.perf_counter()
        store = tierstore.TieredStore(d, hbm_rows=0, ddr_rows=ddr)
        t_open = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(args.seed)
        reads = 24
        t0 = time.perf_counter()
        for _ in range(reads):
            store.read("huge", torch.randint(0, n, (batch,), generator=gen))
        t_reads = time.perf_counter() - t0
        resident = store.resident_rows("huge")["ddr"]
        tier_bytes = resident * 4 * dim
        beyond = _rss_bytes() - rss0 - tier_bytes
        store.close()
    dense = 4 * n
    report(
        "memory: 10^9-row table, 1M-row DDR tier",
        {"num_rows": n, "dim": dim, "ddr_rows": ddr, "reads": f"{reads} x {batch} random ids"},
        [("open", f"{t_open * 1e3:8.1f} ms (goal < 1000 ms)"),
         ("reads", f"{t_reads / reads * 1e3:8.1f} ms per read"),
         ("DDR rows resident", f"{resident:,} ({tier_bytes / 2**20:.0f} MiB of row data)"),
         ("RSS beyond the tier rows", f"{beyond / 2**20:8.1f} MiB (goal < 1024 MiB)"),
         ("a dense int32 id->slot map would be", f"{dense / 2**20:8.1f} MiB")],
        "memory beyond tiers / dense id map", beyond / dense, "< 0.25 (and < 1 GiB)",
    )


def load_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "rows", "dim", "dir", "seed")


def bench_load(args: argparse.Namespace) -> None:
    """Bulk load: from_pretrained and one store.write of every row (each flushed:
    durable) against LMDB's own putmulti of the same rows in one transaction, synced."""
    import lmdb

    import tierstore
    from tierstore.io import RowCodec, encode_keys

    rows, dim = args.rows, args.dim
    weights = torch.randn(rows, dim, generator=torch.Generator().manual_seed(args.seed))
    with _workdir(args.dir) as d:
        turn = iter(range(10**9))

        def fresh() -> str:
            return os.path.join(d, str(next(turn)))

        def putmulti():
            env = lmdb.open(fresh(), map_size=4 * rows * (dim * 4 + 64) + (1 << 30), sync=False, max_dbs=2)
            with env.begin(write=True, db=env.open_db(b"t")) as txn:
                txn.cursor().putmulti(zip(encode_keys(np.arange(rows)), RowCodec(dim).encode(weights.numpy())), append=True)
            env.sync(True)
            env.close()

        def from_pretrained():
            emb = tierstore.TieredEmbeddingBag.from_pretrained(weights, path=fresh())
            emb.store.flush()
            emb.close()

        def store_write():
            with tierstore.TieredStore(fresh(), [tierstore.TableSpec("t", rows, dim)]) as store:
                store.write("t", torch.arange(rows), weights)
                store.flush()

        base, pre, write = interleaved_medians([putmulti, from_pretrained, store_write], repeat=3, warmup=0)
    report("load: bulk load, durable, against LMDB putmulti in one transaction", {"rows": rows, "dim": dim, "rounds": 3},
           [("LMDB putmulti, one txn, synced", f"{base:6.2f} s"),
            ("TieredEmbeddingBag.from_pretrained + flush", f"{pre:6.2f} s  {pre / base:.2f}x"),
            ("TieredStore.write (one call) + flush", f"{write:6.2f} s  {write / base:.2f}x")],
           "worst of the two, x putmulti", max(pre, write) / base, "<= 2.0")
