"""Synthetic embedding traces (Zipf popularity that drifts) and their calibration
against the per-batch reuse histograms published with Meta's dlrm_datasets.

Each step reads every table once: ``batch_size * pooling`` ids drawn from a
bounded Zipf(alpha) over the table's rows (exact discrete Zipf, by
rejection-inversion, Hormann & Derflinger 1996). Rank r maps to a row by a
fixed affine permutation of the table, so hot rows are scattered over the id
space; ``drift`` shifts every rank by that many rows per step, so popularity
moves over time (temporal locality: a row is hot for a while, then cools).
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierstore.trace import Trace, TraceTable

# bucket upper bounds of the dlrm_datasets locality histograms: (0,1], (1,2], (2,4], ... (16384,32768], 32768+
BUCKET_EDGES = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768])


class ZipfSampler:
    """P(k) proportional to k**-alpha for k in 1..n (any alpha > 0), vectorized."""

    def __init__(self, n: int, alpha: float):
        if not (isinstance(n, (int, np.integer)) and n >= 1):
            raise ValueError(f"Zipf needs n >= 1 rows, got {n!r}")
        if not alpha > 0:
            raise ValueError(f"Zipf alpha must be > 0, got {alpha!r}")
        self.n, self.alpha = int(n), float(alpha)
        self._hx1 = self._H(np.float64(1.5)) - 1.0
        self._hn = self._H(np.float64(self.n + 0.5))
        self._s = 2.0 - self._Hinv(self._H(np.float64(2.5)) - self._h(np.float64(2.0)))

    def _h(self, x):
        return np.exp(-self.alpha * np.log(x))

    def _H(self, x):  # integral of h: (x**(1-alpha) - 1) / (1 - alpha), log x at alpha = 1
        lx = np.log(x)
        return _expm1_over(lx * (1.0 - self.alpha)) * lx

    def _Hinv(self, y):
        t = np.maximum(y * (1.0 - self.alpha), -1.0)
        return np.exp(_log1p_over(t) * y)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` ranks in 1..n."""
        out = np.empty(size, dtype=np.int64)
        todo = np.arange(size)
        while len(todo):  # about 1-5% are rejected per round
            u = self._hn + rng.random(len(todo)) * (self._hx1 - self._hn)
            x = self._Hinv(u)
            k = np.clip(np.floor(x + 0.5), 1, self.n)
            ok = (k - x <= self._s) | (u >= self._H(k + 0.5) - self._h(k))
            out[todo[ok]] = k[ok].astype(np.int64)
            todo = todo[~ok]
        return out


def _expm1_over(x):
    x = np.asarray(x, dtype=np.float64)
    small = np.abs(x) < 1e-8
    return np.where(small, 1 + x / 2 + x * x / 6, np.expm1(x) / np.where(small, 1, x))


def _log1p_over(x):
    x = np.asarray(x, dtype=np.float64)
    small = np.abs(x) < 1e-8
    return np.where(small, 1 - x / 2 + x * x / 3, np.log1p(x) / np.where(small, 1, x))


@dataclass(frozen=True)
class SynthTable:
    name: str
    rows: int
    alpha: float | None = None  # None: the config's
    pooling: float | None = None


@dataclass
class SynthConfig:
    """A synthetic trace: every step reads each table once (validated)."""

    tables: tuple = (SynthTable("t0", 1_000_000),)
    alpha: float = 1.05
    batch_size: int = 2048
    pooling: float = 16.0  # ids per sample per table; a call reads round(batch_size * pooling) ids
    steps: int = 100
    drift: float = 0.0  # rows every popularity rank moves per step
    dim: int = 64
    seed: int = 0

    def __post_init__(self):
        tables = []
        for t in self.tables:
            if isinstance(t, SynthTable):
                tables.append(t)
            else:
                tables.append(SynthTable(*t))
        self.tables = tuple(tables)
        if not self.tables:
            raise ValueError("a synthetic trace needs at least one table")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names {names}")
        for t in self.tables:
            if not isinstance(t.rows, (int, np.integer)) or t.rows < 1:
                raise ValueError(f"table {t.name!r}: rows must be an int >= 1, got {t.rows!r}")
            if t.alpha is not None and not t.alpha > 0:
                raise ValueError(f"table {t.name!r}: alpha must be > 0, got {t.alpha}")
            if t.pooling is not None and not t.pooling > 0:
                raise ValueError(f"table {t.name!r}: pooling must be > 0, got {t.pooling}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0 (Zipf exponent; 0.8-1.2 is typical), got {self.alpha}")
        for name in ("batch_size", "steps", "dim"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not self.pooling > 0:
            raise ValueError(f"pooling must be > 0, got {self.pooling}")
        if self.drift < 0:
            raise ValueError(f"drift must be >= 0 rows per step, got {self.drift}")


def _permutation(n: int, rng: np.random.Generator) -> tuple[int, int]:
    """(a, c) of the bijection r -> (a * r + c) mod n, with a * r < 2**63."""
    limit = min(n, (1 << 62) // max(n, 1))
    if limit < 3:
        return 1, int(rng.integers(0, n))
    while True:
        a = int(rng.integers(max(limit // 2, 1), limit))
        if math.gcd(a, n) == 1:
            return a, int(rng.integers(0, n))


def synth(config: SynthConfig) -> Trace:
    """Generate the trace (deterministic for a seed)."""
    cfg = config
    rng = np.random.default_rng(cfg.seed)
    samplers, perms, sizes = [], [], []
    for t in cfg.tables:
        samplers.append(ZipfSampler(int(t.rows), t.alpha if t.alpha is not None else cfg.alpha))
        perms.append(_permutation(int(t.rows), rng))
        sizes.append(max(1, int(round(cfg.batch_size * (t.pooling if t.pooling is not None else cfg.pooling)))))
    T = len(cfg.tables)
    lengths = np.tile(np.array(sizes, dtype=np.int64), cfg.steps)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.empty(int(offsets[-1]), dtype=np.int64)
    c = 0
    for step in range(cfg.steps):  # a loop per call; ids are drawn in bulk
        for i, t in enumerate(cfg.tables):
            r = samplers[i].sample(rng, sizes[i]) - 1
            if cfg.drift:
                r = (r + int(cfg.drift * step)) % t.rows
            a, b = perms[i]
            ids[offsets[c] : offsets[c + 1]] = (a * r + b) % t.rows
            c += 1
    tables = tuple(TraceTable(t.name, int(t.rows), cfg.dim, 4 * cfg.dim) for t in cfg.tables)
    call_table = np.tile(np.arange(T, dtype=np.int32), cfg.steps)
    call_step = np.repeat(np.arange(cfg.steps, dtype=np.int64), T)
    return Trace(tables, ids, offsets, call_table, call_step)


# -- calibration against dlrm_datasets locality statistics --------------------------------------------
@dataclass
class LocalityStats:
    """One section of a ``*_locality_stats.txt`` file: reuse within one batch."""

    name: str
    tables: int
    batch_size: int
    indices: float  # ids per batch, all tables
    unique: float
    rows_hist: np.ndarray  # fraction of distinct rows accessed (0,1], (1,2], (2,4], ... times in the batch
    index_hist: np.ndarray  # fraction of the batch's ids that go to rows in each bucket

    @property
    def ids_per_table(self) -> float:
        return self.indices / self.tables


def parse_locality_stats(path: str | Path) -> list[LocalityStats]:
    text = Path(path).read_text()
    sections = re.split(r"\n(?=\S+\.pt\n)", "\n" + text)
    out = []
    for sec in sections:
        sec = sec.strip()
        if not sec:
            continue
        name = sec.splitlines()[0].strip()
        m = re.search(r"_t(\d+)_bs(\d+)", name)
        ind = re.search(r"Avg # of indices:\s*([\d.]+)", sec)
        uniq = re.search(r"Avg # of unique cols:\s*([\d.]+)", sec)
        parts = re.split(r"Ratio of index distribution", sec)
        if not (m and ind and uniq and len(parts) == 2):
            raise ValueError(f"{path}: section {name!r} is not a dlrm_datasets locality report")
        bucket = re.compile(r"^\((\d+), (\d+)\]: ([\d.]+)|^\((\d+)\+: ([\d.]+)", re.M)
        hists = []
        for part in parts:
            vals = [float(g[2] or g[4]) for g in bucket.findall(part)]
            if len(vals) != len(BUCKET_EDGES):
                raise ValueError(f"{path}: section {name!r} has {len(vals)} histogram buckets, expected {len(BUCKET_EDGES)}")
            hists.append(np.array(vals))
        out.append(LocalityStats(name, int(m.group(1)), int(m.group(2)), float(ind.group(1)), float(uniq.group(1)), hists[0], hists[1]))
    if not out:
        raise ValueError(f"{path}: no locality sections found")
    return out


def batch_histograms(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two locality histograms of one batch of ids (one table)."""
    _, counts = np.unique(ids, return_counts=True)
    bucket = np.searchsorted(BUCKET_EDGES, counts, side="left") - 1  # (e[i], e[i+1]] -> i; > 32768 -> last
    bucket = np.minimum(bucket, len(BUCKET_EDGES) - 1)
    rows = np.bincount(bucket, minlength=len(BUCKET_EDGES)).astype(np.float64)
    idx = np.bincount(bucket, weights=counts, minlength=len(BUCKET_EDGES))
    return rows / rows.sum(), idx / idx.sum()


def histogram_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Total variation distance: half the L1 difference (0 same, 1 disjoint)."""
    return float(np.abs(np.asarray(a) - np.asarray(b)).sum() / 2)


@dataclass
class Calibration:
    alpha: float
    rows: int
    ids_per_table: int
    rows_tv: float  # TV distance of the distinct-rows histogram
    index_tv: float  # TV distance of the ids histogram
    synthetic_rows_hist: np.ndarray
    synthetic_index_hist: np.ndarray
    mean_reuse: float  # ids per distinct row in the synthetic batch
    target: LocalityStats

    def as_dict(self) -> dict:
        return {"alpha": self.alpha, "rows": self.rows, "ids_per_table": self.ids_per_table,
                "rows_tv": self.rows_tv, "index_tv": self.index_tv, "mean_reuse": self.mean_reuse,
                "target_mean_reuse": self.target.indices / self.target.unique,
                "synthetic_rows_hist": self.synthetic_rows_hist.tolist(), "target_rows_hist": self.target.rows_hist.tolist(),
                "synthetic_index_hist": self.synthetic_index_hist.tolist(), "target_index_hist": self.target.index_hist.tolist()}


def calibrate(target: LocalityStats, alphas: Sequence[float] | None = None, rows: Sequence[int] | None = None,
              ids_per_table: int | None = None, seed: int = 0) -> Calibration:
    """Grid search of (alpha, rows) for one table whose batch of ``ids_per_table``
    ids (default: the stats' ids per table and batch) best matches both histograms
    (sum of the two TV distances), then a finer search of alpha around the best."""
    m = int(ids_per_table or round(target.ids_per_table))
    alphas = list(alphas) if alphas is not None else list(np.round(np.arange(0.5, 1.51, 0.1), 3))
    rows = list(rows) if rows is not None else [int(x) for x in np.geomspace(1e5, 1e8, 7).round(-3)]

    def score(a, n):
        rng = np.random.default_rng(seed)
        ids = ZipfSampler(int(n), float(a)).sample(rng, m)
        rh, ih = batch_histograms(ids)
        return histogram_distance(rh, target.rows_hist) + histogram_distance(ih, target.index_hist), rh, ih, len(ids) / len(np.unique(ids))

    best = None
    for a in alphas:  # a loop per grid point; each draws a batch in bulk
        for n in rows:
            s = score(a, n)
            if best is None or s[0] < best[0][0]:
                best = (s, a, n)
    (_, _, _, _), a0, n0 = best
    for a in np.round(np.arange(a0 - 0.08, a0 + 0.081, 0.02), 3):
        if a > 0:
            s = score(a, n0)
            if s[0] < best[0][0]:
                best = (s, float(a), n0)
    (_, rh, ih, reuse), a, n = best
    return Calibration(float(a), int(n), m, histogram_distance(rh, target.rows_hist), histogram_distance(ih, target.index_hist),
                       rh, ih, float(reuse), target)
