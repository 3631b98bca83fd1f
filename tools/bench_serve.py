"""``tierstore bench serve``: pooled lookup latency and throughput of a serving store
(tierstore.serving), float32 against int8 and int4, and against FBGEMM's IntNBit
inference module (IntNBitTableBatchedEmbeddingBagsCodegen) holding the same rows.

One table of ``--rows`` x ``--dim`` is trained-written, exported in each dtype and
served with every row in the HBM tier (on the CPU, a tier in host memory), with
every row in the DDR tier below an HBM tier of 1% of them, and with no tiers (LMDB); batches are FBGEMM's 2048
bags x 32 ids (``--batch`` ids in all), uniform over the rows. Each round times one
lookup of every side in turn, so a change in machine load hits all of them; the
latencies' p50/p99/p999 and the ids per second at the median are reported.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from tierstore.tools.bench import DEFAULT_BATCH

DEFAULTS = {"rows": 200_000, "dim": 64, "repeat": 300}
POOLING = 32
N_BATCHES = 8
DTYPES = ("float32", "int8", "int4")


def run(args: argparse.Namespace) -> None:
    import tierstore
    from tierstore.serving import ServingStore
    from tierstore.serving_export import export

    n, dim = args.rows, args.dim
    bags = max(1, args.batch // POOLING) if args.batch != DEFAULT_BATCH else 2048
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, n, (bags * POOLING,), generator=gen) for _ in range(N_BATCHES)]
    offsets = torch.arange(bags + 1, dtype=torch.int64) * POOLING
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=args.dir) as d:
        spec = tierstore.TableSpec("t", n, dim, init=tierstore.RowInit.normal(0, 0.1, seed=args.seed))
        rows = torch.randn((n, dim), generator=gen) * 0.1
        with tierstore.TieredStore(f"{d}/train", tables=[spec], device="cpu") as store:
            for lo in range(0, n, 65536):
                store.write("t", torch.arange(lo, min(n, lo + 65536)), rows[lo: lo + 65536])
        sides, stores = {}, []
        for dtype in DTYPES:
            path = export(f"{d}/train", f"{d}/{dtype}", dtype=dtype)
            # DDR: an HBM tier of 1% of the rows over a DDR tier of all, so nearly every row moves up and back
            for tier, sizes in (("HBM", (n, 0)), ("DDR", (n // 100, n)), ("LMDB", (0, 0))):
                if tier != "HBM" and dtype != "int8":
                    continue
                s = ServingStore(path, hbm_rows=sizes[0], ddr_rows=sizes[1], device="cpu")
                stores.append(s)
                if tier != "LMDB":
                    for lo in range(0, n, 65536):  # every row resident
                        s.rows("t", torch.arange(lo, min(n, lo + 65536)))
                sides[f"tierstore {dtype}, {tier}"] = _lookup(s, offsets)
            tbe = _intnbit(rows, dtype)
            if tbe is not None:
                sides[f"FBGEMM IntNBit {dtype}"] = lambda ids, tbe=tbe: tbe(ids, offsets)
        applied = _apply_seconds(stores[1], n, dim, gen)
        default_threads = torch.get_num_threads()
        for threads in dict.fromkeys((default_threads, 1)):
            torch.set_num_threads(threads)
            lat = _time(sides, batches, args.repeat)
            _report(lat, bags, n, dim, threads)
        torch.set_num_threads(default_threads)
        for s in stores:
            s.close()
    print(f"   a delta of 1% of the rows ({n // 100:,}, int8) applied to the int8 HBM store in {applied * 1e3:.1f} ms "
          "(median of 5; rows resident, written over in place)")


def _apply_seconds(store, n: int, dim: int, gen: torch.Generator) -> float:
    """Median seconds of ServingStore.apply for a delta of 1% of the rows (what a Replica does per delta)."""
    from tierstore.io.serving_layout import RowFormat

    fmt, times = RowFormat(dim, "int8"), []
    for k in range(5):
        ids = torch.randperm(n, generator=gen)[: n // 100].sort().values.numpy()
        packed = fmt.encode((torch.randn((len(ids), dim), generator=gen) * 0.1).numpy())
        t0 = time.perf_counter()
        store.apply(store.version + 1, {"t": (ids, packed)})
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _time(sides: dict, batches: list[torch.Tensor], repeat: int) -> dict[str, list[float]]:
    """Seconds of each lookup, the sides in turn each round (LMDB lookups, ~100x slower, every 20th)."""
    lat = {k: [] for k in sides}
    for r in range(repeat + 3):
        for name, fn in sides.items():
            if "LMDB" in name and (r - 3) % 20:
                continue
            ids = batches[r % N_BATCHES]
            t0 = time.perf_counter()
            fn(ids)
            if r >= 3:
                lat[name].append(time.perf_counter() - t0)
    return lat


def _report(lat: dict[str, list[float]], bags: int, n: int, dim: int, threads: int) -> None:
    print(f"\n== serve: pooled lookups, {bags} bags x {POOLING} ids, table {n:,} x {dim}, torch threads {threads}")
    base = {dt: np.median(lat[f"FBGEMM IntNBit {dt}"]) for dt in DTYPES if f"FBGEMM IntNBit {dt}" in lat}
    for name, ts in lat.items():
        ms = np.percentile(np.array(ts) * 1e3, [50, 99, 99.9])
        dt = name.split(",")[0].split()[-1]
        vs = f"  {np.median(ts) / base[dt]:.2f}x FBGEMM {dt}" if dt in base and name.startswith("tierstore") else ""
        print(f"   {name:<26} p50 {ms[0]:7.3f} ms  p99 {ms[1]:7.3f} ms  p999 {ms[2]:7.3f} ms  "
              f"{bags * POOLING / np.median(ts) / 1e6:6.2f} M ids/s  (n={len(ts)}){vs}")


def _lookup(store, offsets):
    return lambda ids: store.lookup("t", ids, offsets)


def _intnbit(rows: torch.Tensor, dtype: str):
    """FBGEMM's IntNBit module over ``rows`` quantized by FBGEMM's quantizer; None without FBGEMM."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
    except ImportError:
        return None
    ty = {"float32": SparseType.FP32, "int8": SparseType.INT8, "int4": SparseType.INT4}[dtype]
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen([("t", *rows.shape, ty, EmbeddingLocation.HOST)], device="cpu",
                                                  pooling_mode=PoolingMode.SUM, output_dtype=SparseType.FP32)
    tbe.initialize_weights()
    (weights, scale_bias), = tbe.split_embedding_weights()
    if dtype == "float32":
        weights.copy_(rows.view(torch.uint8))
    else:
        q = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(rows, 8 if dtype == "int8" else 4)
        weights.copy_(q[:, :-4])
        scale_bias.copy_(q[:, -4:])
    return tbe
