"""SHARDS (Waldspurger et al., FAST'15): approximate LRU curves of long traces.

Keep the rows whose hash falls below rate * 2**64, compute exact distances on
that sub-trace (tierstore/capacity/curves.py), scale them by 1/rate; the trace's exact
uses and distinct rows (cheap to count) pin the first touches and the total
(an extension of SHARDS_adj). Its error is estimated from the spread between
disjoint sub-samples.
"""
from __future__ import annotations

import math
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierstore.capacity.curves import LruCurve, even_sizes, stack_distances
from tierstore.capacity.progress import ProgressFactory, open_progress
from tierstore.trace import Trace
from tierstore.capacity.trace_streams import build_streams, trace_counts
from tierstore.errors import SettingError

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _table_salt(name: str, seed: int) -> np.uint64:
    # per table, so that tables do not all sample the same ids
    return np.uint64((zlib.crc32(name.encode()) * 0x9E3779B1 + seed * 0x85EBCA77) & 0xFFFFFFFFFFFFFFFF)


SUB_SAMPLES = 16  # disjoint sub-samples whose spread estimates SHARDS's error
MIN_SAMPLE_ROWS = 16_384  # a table's rate is raised until its sample holds about this many rows
ERROR_SIGMAS = 4.0  # the error band, in standard errors (held on every Zipf trace of the tests)


def shards_sample(trace: Trace, rate, seed: int = 0, chunk: int = 1 << 20,
                  progress: ProgressFactory | None = None) -> tuple[Trace, np.ndarray]:
    """The sub-trace of rows whose hash is below rate * 2**64 (same calls, fewer ids),
    and each kept id's sub-sample number (0..SUB_SAMPLES-1, from the hash's low bits).
    ``rate``: one rate, or one per table of the trace."""
    rates = np.broadcast_to(np.asarray(rate, dtype=np.float64), (len(trace.tables),))
    if not np.all((rates > 0) & (rates <= 1)):
        raise SettingError(f"SHARDS rate must be in (0, 1], got {rate}")
    thresholds = np.array([min(int(r * 2.0**64), 2**64 - 1) for r in rates], dtype=np.uint64)
    salts = np.array([_table_salt(t.name, seed) for t in trace.tables], dtype=np.uint64)
    lengths = np.diff(trace.offsets)
    kept_ids, kept_pos, kept_sub = [], [], []
    bar = open_progress(progress, trace.n_accesses, "SHARDS sampling")
    c0 = 0
    buf = np.empty(0, dtype=np.uint64)
    while c0 < trace.n_calls:
        # whole calls per chunk, about `chunk` ids each, so the salts are one repeat
        c1 = int(np.searchsorted(trace.offsets, trace.offsets[c0] + chunk, side="right")) - 1
        c1 = min(max(c1, c0 + 1), trace.n_calls)
        s, e = int(trace.offsets[c0]), int(trace.offsets[c1])
        ids = np.asarray(trace.ids[s:e])
        if len(buf) < e - s:
            buf = np.empty(e - s, dtype=np.uint64)
        h = buf[: e - s]
        tables = trace.call_table[c0:c1]
        np.bitwise_xor(ids.view(np.uint64), np.repeat(salts[tables], lengths[c0:c1]), out=h)
        # splitmix64's finaliser: every id bit moves every hash bit
        h ^= h >> np.uint64(30)
        h *= _M1
        h ^= h >> np.uint64(27)
        h *= _M2
        h ^= h >> np.uint64(31)
        kept = np.flatnonzero(h < np.repeat(thresholds[tables], lengths[c0:c1]))
        kept_ids.append(ids[kept])
        kept_pos.append(kept + s)
        kept_sub.append((h[kept] & np.uint64(SUB_SAMPLES - 1)).astype(np.int8))
        bar.update(e - s)
        c0 = c1
    bar.close()
    pos = np.concatenate(kept_pos) if kept_pos else np.empty(0, dtype=np.int64)
    offsets = np.searchsorted(pos, trace.offsets).astype(np.int64)
    sub = Trace(trace.tables, np.concatenate(kept_ids) if kept_ids else np.empty(0, dtype=np.int64), offsets,
                trace.call_table, trace.call_step, trace.complete)
    return sub, (np.concatenate(kept_sub) if kept_sub else np.empty(0, dtype=np.int8))


@dataclass
class ShardsResult:
    curves: list[LruCurve]
    rate: float  # as asked; each curve's own rate may be higher (see table_rates)
    sampled_accesses: int
    error_sizes: list[np.ndarray]  # per table: cache sizes (rows) where the error band is known
    error_bound: list[np.ndarray]  # per table: bound on |miss ratio error| at those sizes
    seconds: float

    @property
    def table_rates(self) -> list[float]:
        return [c.rate for c in self.curves]

    def bound(self, i: int, rows) -> np.ndarray:
        """Table i's error bound at any sizes: the larger of the two known sizes around each."""
        x, b = self.error_sizes[i], self.error_bound[i]
        if not len(x):
            return np.full(np.shape(rows), np.nan)
        j = np.clip(np.searchsorted(x, rows), 1, len(x) - 1) if len(x) > 1 else np.zeros(np.shape(rows), dtype=np.int64)
        return np.maximum(b[j], b[np.maximum(j - 1, 0)])

    @property
    def max_bound(self) -> list[float]:
        return [float(b.max()) if len(b) else float("nan") for b in self.error_bound]

    @property
    def mean_bound(self) -> list[float]:
        return [float(b.mean()) if len(b) else float("nan") for b in self.error_bound]


def shards_curves(trace: Trace, rate: float, tables: Sequence[str] | None = None, seed: int = 0,
                  adjust: bool = True, progress: ProgressFactory | None = None, estimate_error: bool = True,
                  min_sample_rows: int = MIN_SAMPLE_ROWS) -> ShardsResult:
    """Approximate LRU curves by SHARDS at ``rate``.

    A table whose sample would hold fewer than ``min_sample_rows`` rows is sampled
    at a higher rate (up to 1, exact): at rate 0.01 a 100k-row table keeps ~1000
    rows, and the few hot rows that decide small caches are in or out by chance.

    Adjustment (SHARDS_adj, extended): the trace's exact uses U and distinct
    rows W are cheap to count (a scatter per call, no streams), so the first
    touches are set to W and the difference between the sampled uses and their
    expectation is put at distance 0: hits(C) = U - W - (sampled reuses with
    distance >= rate * C) / rate. Only the reuse distances are estimated.

    Error band, per size: ERROR_SIGMAS standard errors (from the spread of
    SUB_SAMPLES disjoint sub-samples, whose variance is SUB_SAMPLES times the
    whole sample's; the largest within a factor 2 of the size, since one size's
    spread is itself noisy) plus the curve's rise over +-1/rate rows (what one
    sampled row of distance stands for).
    """
    t0 = time.perf_counter()
    names = list(tables) if tables else trace.table_names
    exact = trace_counts(trace, names)
    rates = np.full(len(trace.tables), float(rate))
    for n, w in zip(names, exact[1]):
        rates[trace.table_index(n)] = min(1.0, max(float(rate), min_sample_rows / max(w, 1)))
    sub, part = shards_sample(trace, rates, seed, progress=progress)
    per_table = trace.accesses_per_table()
    accesses = [int(per_table[trace.table_index(n)]) for n in names]
    name_rates = [float(rates[trace.table_index(n)]) for n in names]
    curves = _sample_curves(sub, names, name_rates, exact if adjust else None, accesses, progress)
    sizes = [_error_grid(c.working_set) for c in curves]
    bounds = [np.full(len(g), np.nan) for g in sizes]
    sampled = [i for i, c in enumerate(curves) if c.rate < 1.0]  # a table read whole is exact: no band
    for i in set(range(len(curves))) - set(sampled):
        bounds[i] = np.zeros(len(sizes[i]))
    if estimate_error and sub.n_accesses and sampled:
        some = [names[i] for i in sampled]
        some_exact = ([exact[0][i] for i in sampled], [exact[1][i] for i in sampled]) if adjust else None
        parts = []
        for k in range(SUB_SAMPLES):
            keep = part == k
            offs = np.searchsorted(np.flatnonzero(keep), sub.offsets).astype(np.int64)
            parts.append(_sample_curves(Trace(sub.tables, sub.ids[keep], offs, sub.call_table, sub.call_step), some,
                                        [name_rates[i] / SUB_SAMPLES for i in sampled], some_exact,
                                        [accesses[i] for i in sampled], False))
        for j, i in enumerate(sampled):
            c, g = curves[i], sizes[i]
            se = np.array([p[j].hit_ratio(g) for p in parts]).std(axis=0, ddof=1) / math.sqrt(SUB_SAMPLES)
            lo, hi = np.searchsorted(g, g / 2), np.searchsorted(g, g * 2, side="right")
            se = np.array([se[a:b].max() for a, b in zip(lo, hi)])  # a loop over ~300 sizes
            step = 1 / c.rate
            rise = c.hit_ratio(g + step) - c.hit_ratio(np.maximum(g - step, 0))
            bounds[i] = ERROR_SIGMAS * se + rise
    return ShardsResult(curves, rate, sub.n_accesses, sizes, bounds, time.perf_counter() - t0)


def _error_grid(working_set: float) -> np.ndarray:
    """Sizes for the error band: even steps and geometric ones (small caches) to the working set."""
    ws = max(int(math.ceil(working_set)), 1)
    return np.unique(np.concatenate([even_sizes(ws), np.geomspace(1, ws, 120).round().astype(np.int64)]))


def _sample_curves(sub: Trace, names, rates, exact, accesses, progress) -> list[LruCurve]:
    streams = build_streams(sub, names)
    dists = stack_distances(streams, progress)
    out = []
    for i, (s, d) in enumerate(zip(streams, dists)):
        rate = rates[i]
        c = LruCurve.from_distances(s, d, rate)
        if exact is not None:
            uses, distinct = exact[0][i], exact[1][i]
            c.cold = rate * distinct
            c.adjust = rate * uses - float(c.hist.sum()) - c.cold
        c.n_accesses = accesses[i]
        out.append(c)
    return out
