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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierstore.trace import Trace, TraceTable
from tierstore.validate import check_int, check_number
from tierstore.errors import FormatError, SettingError

# bucket upper bounds of the dlrm_datasets locality histograms: (0,1], (1,2], (2,4], ... (16384,32768], 32768+
BUCKET_EDGES = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768])


class ZipfSampler:
    """P(k) proportional to k**-alpha for k in 1..n (any alpha > 0), vectorized."""

    def __init__(self, n: int, alpha: float):
        if not (isinstance(n, (int, np.integer)) and n >= 1):
            raise SettingError(f"Zipf needs n >= 1 rows, got {n!r}")
        if not alpha > 0:
            raise SettingError(f"Zipf alpha must be > 0, got {alpha!r}")
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
            raise SettingError("a synthetic trace needs at least one table")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise SettingError(f"duplicate table names {names}")
        for t in self.tables:
            check_int(t.rows, f"table {t.name!r}: rows", at_least=1)
            check_number(t.alpha, f"table {t.name!r}: alpha", above=True, none=True)
            check_number(t.pooling, f"table {t.name!r}: pooling", above=True, none=True)
        check_number(self.alpha, "alpha", above=True, meaning="Zipf exponent; 0.8-1.2 is typical")
        for name in ("batch_size", "steps", "dim"):
            check_int(getattr(self, name), name, at_least=1)
        check_number(self.pooling, "pooling", above=True)
        check_number(self.drift, "drift", meaning="rows per step")


def _permutation(n: int, rng: np.random.Generator) -> tuple[int, int]:
    """(a, c) of the bijection r -> (a * r + c) mod n, with a * r < 2**63."""
    limit = min(n, (1 << 62) // max(n, 1))
    if limit < 3:
        return 1, int(rng.integers(0, n))
    while True:
        a = int(rng.integers(max(limit // 2, 1), limit))
        if math.gcd(a, n) == 1:
            return a, int(rng.integers(0, n))


def _call_sizes(cfg: SynthConfig) -> list[int]:
    """Ids each table's call reads, every step."""
    return [max(1, int(round(cfg.batch_size * (t.pooling if t.pooling is not None else cfg.pooling)))) for t in cfg.tables]


def trace_size(config: SynthConfig) -> tuple[int, int]:
    """(accesses, bytes) of the trace :func:`synth` makes, known before any of it is:
    the bytes of the arrays it builds in memory and ``Trace.save`` writes (file headers
    aside): int64 ids, int64 offsets (one more than the calls), int32 call_table and
    int64 call_step per call."""
    calls = len(config.tables) * config.steps
    accesses = sum(_call_sizes(config)) * config.steps
    return accesses, 8 * accesses + 8 * (calls + 1) + (4 + 8) * calls


def synth(config: SynthConfig) -> Trace:
    """Generate the trace (deterministic for a seed)."""
    cfg = config
    rng = np.random.default_rng(cfg.seed)
    samplers, perms = [], []
    sizes = _call_sizes(cfg)
    for t in cfg.tables:
        samplers.append(ZipfSampler(int(t.rows), t.alpha if t.alpha is not None else cfg.alpha))
        perms.append(_permutation(int(t.rows), rng))
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
            raise FormatError(f"{path}: section {name!r} is not a dlrm_datasets locality report")
        bucket = re.compile(r"^\((\d+), (\d+)\]: ([\d.]+)|^\((\d+)\+: ([\d.]+)", re.M)
        hists = []
        for part in parts:
            vals = [float(g[2] or g[4]) for g in bucket.findall(part)]
            if len(vals) != len(BUCKET_EDGES):
                raise FormatError(f"{path}: section {name!r} has {len(vals)} histogram buckets, expected {len(BUCKET_EDGES)}")
            hists.append(np.array(vals))
        out.append(LocalityStats(name, int(m.group(1)), int(m.group(2)), float(ind.group(1)), float(uniq.group(1)), hists[0], hists[1]))
    if not out:
        raise FormatError(f"{path}: no locality sections found")
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


# -- expected histograms: counts per row in a batch are Poisson(M p_r) --------------------------------------
_LOG_LAM = np.linspace(np.log(1e-12), np.log(1e7), 6000)
_PROBS: tuple[np.ndarray, np.ndarray] | None = None


def _bucket_probs() -> tuple[np.ndarray, np.ndarray]:
    """For each lambda on a log grid: P(X in bucket) and E[X; X in bucket], X ~ Poisson(lambda)."""
    global _PROBS
    if _PROBS is None:
        lam = np.exp(_LOG_LAM)
        edges = BUCKET_EDGES
        points = np.unique(np.concatenate([edges, edges - 1]))
        points = points[points >= 0]
        cdf = np.empty((len(lam), len(points)))
        small = lam <= 1000
        kmax = 2400  # beyond lambda + 40 sd for every small lambda
        k = np.arange(kmax + 1)
        logfact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, kmax + 1)))])
        pmf = np.exp(k[None, :] * np.log(lam[small])[:, None] - lam[small][:, None] - logfact[None, :])
        full = np.cumsum(pmf, axis=1)
        cdf[small] = np.where(points[None, :] <= kmax, full[:, np.minimum(points, kmax)], 1.0)
        big = lam[~small]
        z = (points[None, :] + 0.5 - big[:, None]) / np.sqrt(big)[:, None]
        cdf[~small] = 0.5 * (1 + _erf(z / np.sqrt(2)))  # normal approximation, lambda > 1000
        F = lambda x: np.where(x < 0, 0.0, cdf[:, np.searchsorted(points, np.maximum(x, 0))]) if np.ndim(x) == 0 else None  # noqa: E731
        rows = np.empty((len(lam), len(edges)))
        ids = np.empty((len(lam), len(edges)))
        for j in range(len(edges)):  # 17 buckets
            lo, hi = edges[j], edges[j + 1] if j + 1 < len(edges) else None
            f_hi = F(hi) if hi is not None else 1.0
            rows[:, j] = f_hi - F(lo)
            f_hi1 = F(hi - 1) if hi is not None else 1.0
            ids[:, j] = lam * (f_hi1 - F(lo - 1))  # E[X; a < X <= b] = lambda P(a - 1 < X <= b - 1)
        _PROBS = (np.clip(rows, 0, 1), np.clip(ids, 0, None))
    return _PROBS


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf
    t = 1 / (1 + 0.3275911 * np.abs(x))
    y = 1 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * np.exp(-x * x)
    return np.sign(x) * y


def _zipf_bins(n: int, alpha: float, head: int = 1000, ratio: float = 1.005) -> tuple[np.ndarray, np.ndarray]:
    """Ranks 1..n grouped: (rows per group, sum of r**-alpha per group); the head
    one rank per group, the tail in geometric groups (midpoint-rule sums)."""
    h = np.arange(1, min(n, head) + 1, dtype=np.float64)
    sizes, mass = [np.ones_like(h)], [h**-alpha]
    if n > head:
        edges = np.unique(np.geomspace(head + 1, n + 1, max(2, int(np.log((n + 1) / (head + 1)) / np.log(ratio)) + 2)).round())
        a, b = edges[:-1] - 0.5, edges[1:] - 0.5
        integral = np.log(b / a) if alpha == 1 else (b ** (1 - alpha) - a ** (1 - alpha)) / (1 - alpha)
        sizes.append(np.diff(edges))
        mass.append(integral)
    return np.concatenate(sizes), np.concatenate(mass)


def expected_histograms(n: int, alpha: float, m: float) -> tuple[np.ndarray, np.ndarray]:
    """Expected (distinct rows, ids) per bucket for a batch of m ids from Zipf(alpha) over n rows."""
    rows_p, ids_p = _bucket_probs()
    size, mass = _zipf_bins(int(n), float(alpha))
    lam = m * (mass / size) / mass.sum()
    pos = np.clip((np.log(np.maximum(lam, 1e-300)) - _LOG_LAM[0]) / (_LOG_LAM[1] - _LOG_LAM[0]), 0, len(_LOG_LAM) - 1.001)
    i = pos.astype(np.int64)
    f = (pos - i)[:, None]
    blend = lambda t: t[i] * (1 - f) + t[i + 1] * f  # noqa: E731
    return size @ blend(rows_p), size @ blend(ids_p)


# -- calibration -------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    """Tables (rows, alpha, share of the batch's ids) whose batch histograms best match the target."""

    classes: tuple[tuple[int, float, float], ...]
    ids_per_table: int
    model_tv: tuple[float, float]  # (distinct rows, ids) TV distance of the Poisson model
    rows_tv: float  # of a generated batch: the figure to quote
    index_tv: float
    synthetic_rows_hist: np.ndarray
    synthetic_index_hist: np.ndarray
    mean_reuse: float  # ids per distinct row in the generated batch
    target: LocalityStats

    def synth_args(self) -> str:
        pooling = lambda share: self.ids_per_table * share / self.target.batch_size  # noqa: E731
        tables = " ".join(f"--table c{i}:{n}:{a:g}:{pooling(w):.4g}" for i, (n, a, w) in enumerate(self.classes))
        return f"{tables} --batch-size {self.target.batch_size}"

    def as_dict(self) -> dict:
        return {"classes": [{"rows": n, "alpha": a, "share": w} for n, a, w in self.classes],
                "ids_per_table": self.ids_per_table, "model_tv": list(self.model_tv),
                "rows_tv": self.rows_tv, "index_tv": self.index_tv, "mean_reuse": self.mean_reuse,
                "target_mean_reuse": self.target.indices / self.target.unique, "synth_args": self.synth_args(),
                "synthetic_rows_hist": self.synthetic_rows_hist.tolist(), "target_rows_hist": self.target.rows_hist.tolist(),
                "synthetic_index_hist": self.synthetic_index_hist.tolist(), "target_index_hist": self.target.index_hist.tolist()}


def _tv_rows(rows: np.ndarray, ids: np.ndarray, target: LocalityStats) -> np.ndarray:
    """Sum of the two TV distances for stacked candidate histograms (..., 17)."""
    r = rows / rows.sum(axis=-1, keepdims=True)
    i = ids / ids.sum(axis=-1, keepdims=True)
    return (np.abs(r - target.rows_hist).sum(-1) + np.abs(i - target.index_hist).sum(-1)) / 2


def calibrate(target: LocalityStats, components: int = 2, ids_per_table: int | None = None, seed: int = 0,
              quick: bool = False) -> Calibration:
    """Fit one Zipf table (components=1), or a mix of two (a share of the ids on a
    second table with its own rows and alpha), to the target's histograms.

    The search scores expected histograms (row counts in a batch are Poisson,
    ranks grouped geometrically), on a grid then a finer grid around the best;
    the figures returned are measured on a batch drawn with :class:`ZipfSampler`.
    """
    if components not in (1, 2):
        raise SettingError(f"components must be 1 or 2, got {components}")
    m = int(ids_per_table or round(target.ids_per_table))
    step = 2 if quick else 1
    alphas = np.round(np.arange(0.3, 1.61, 0.05 * step), 3)
    log_rows = np.arange(3, 9.51, 0.25 * step)

    def grid_hists(al, lr, mm):
        return [[expected_histograms(int(10**x), a, mm) for x in lr] for a in al]

    best_single = None
    H = grid_hists(alphas, log_rows, m)
    for ia, a in enumerate(alphas):
        for ir, x in enumerate(log_rows):
            score = float(_tv_rows(H[ia][ir][0], H[ia][ir][1], target))
            if best_single is None or score < best_single[0]:
                best_single = (score, ((int(10**x), float(a), 1.0),))
    best = best_single
    if components == 2:
        shares = np.round(np.arange(0.05, 0.951, 0.05 * step), 3)
        flat = [(int(10**x), float(a)) for a in alphas for x in log_rows]
        for w in shares:
            A = np.array([expected_histograms(n, a, w * m) for n, a in flat])  # (K, 2, 17)
            B = np.array([expected_histograms(n, a, (1 - w) * m) for n, a in flat])
            rows = A[:, None, 0, :] + B[None, :, 0, :]
            ids = A[:, None, 1, :] + B[None, :, 1, :]
            score = _tv_rows(rows, ids, target)
            k1, k2 = np.unravel_index(int(np.argmin(score)), score.shape)
            if score[k1, k2] < best[0]:
                best = (float(score[k1, k2]), ((*flat[k1], float(w)), (*flat[k2], float(1 - w))))
        # finer around the best mix
        (n1, a1, w1), (n2, a2, _) = best[1]
        for _ in range(2):
            cands = []
            for da1 in (-0.02, 0, 0.02):
                for da2 in (-0.02, 0, 0.02):
                    for dl1 in (-0.1, 0, 0.1):
                        for dl2 in (-0.1, 0, 0.1):
                            for dw in (-0.02, 0, 0.02):
                                w = min(max(w1 + dw, 0.01), 0.99)
                                c = ((int(n1 * 10**dl1), max(a1 + da1, 0.05), w), (int(n2 * 10**dl2), max(a2 + da2, 0.05), 1 - w))
                                r = sum(expected_histograms(n, a, s * m)[0] for n, a, s in c)
                                i = sum(expected_histograms(n, a, s * m)[1] for n, a, s in c)
                                cands.append((float(_tv_rows(r, i, target)), c))
            top = min(cands, key=lambda t: t[0])
            if top[0] < best[0]:
                best = top
            (n1, a1, w1), (n2, a2, _) = best[1]
    score, classes = best
    classes = tuple((int(n), round(float(a), 3), round(float(w), 3)) for n, a, w in classes)
    model_r = sum(expected_histograms(n, a, w * m)[0] for n, a, w in classes)
    model_i = sum(expected_histograms(n, a, w * m)[1] for n, a, w in classes)
    # measured on a generated batch: one table per class, rows of different tables distinct
    rng = np.random.default_rng(seed)
    parts, offset = [], 0
    for n, a, w in classes:
        parts.append(ZipfSampler(n, a).sample(rng, max(1, int(round(w * m)))) + offset)
        offset += n
    ids = np.concatenate(parts)
    rh, ih = batch_histograms(ids)
    return Calibration(classes, m, (histogram_distance(model_r / model_r.sum(), target.rows_hist),
                                    histogram_distance(model_i / model_i.sum(), target.index_hist)),
                       histogram_distance(rh, target.rows_hist), histogram_distance(ih, target.index_hist),
                       rh, ih, float(len(ids) / len(np.unique(ids))), target)
