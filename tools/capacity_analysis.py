"""``tierstore capacity``'s analysis of a trace: the curves, recommendations and
replays of the capacity library put together as one JSON-ready report (a dict),
which tools/capacity_report.py prints and tools/capacity_plots.py draws.

The numbers come from the library: exact LRU curves (tierstore/capacity/curves.py),
SHARDS (tierstore/capacity/shards.py), replays at chosen sizes (tierstore/capacity/cachesim.py),
budget splits (tierstore/capacity/budget.py), admission (tierstore/capacity/admission_replay.py).
Everything predicts what a :class:`tierstore.TieredStore` of a given size
measures when the trace is replayed through it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from tierstore.capacity.admission_replay import predict_admission
from tierstore.capacity.budget import rows_for_targets, split_budget, total_curve
from tierstore.capacity.cachesim import clamp_sizes, simulate
from tierstore.capacity.curves import LruCurve, mean_abs_error, stack_distances
from tierstore.eviction import POLICIES
from tierstore.engine.memory import MemorySplit, split_memory
from tierstore.capacity.progress import ProgressFactory
from tierstore.capacity.shards import MIN_SAMPLE_ROWS, shards_curves
from tierstore.spec import TableSpec
from tierstore.tools.capacity_progress import bars
from tierstore.trace import Trace
from tierstore.capacity.trace_streams import build_streams
from tierstore.validate import check_int, check_number
from tierstore.errors import SettingError

DEFAULT_ROW_BYTES = 512  # a dim-128 float32 row, when the trace does not say


@dataclass
class CapacityConfig:
    """What ``tierstore capacity`` computes (validated)."""

    tables: tuple[str, ...] | None = None
    shards_rate: float | None = None  # None: exact curves
    compare_exact: bool = False  # with shards_rate: also the exact curve, and SHARDS's measured error
    sizes: tuple[tuple[str, str], ...] = ()  # (hbm, ddr) per simulated point: rows, or "N%" of the working set
    policies: tuple[str, ...] = ("lfu",)  # simulated; LRU comes from the curve at every size
    window: int = 16
    belady: bool = True
    hbm_target: float | None = None
    hit_target: float | None = None
    hbm_bytes: float | None = None
    ddr_bytes: float | None = None
    steps_per_s: float = 1.0
    row_bytes: int | None = None  # overrides the trace's
    seed: int = 0
    progress: bool | ProgressFactory = False  # True: tools/capacity_progress.py's bars
    iec: bool = False  # report bytes in KiB/MiB/GiB (the budget was given so), else kB/MB/GB
    memory_budget: int | None = None  # a store's memory_budget= (bytes): its split (tierstore.engine.memory) and what it hits
    admit_after: int | None = None  # predict admission (TableSpec.admit_after) with this sketch
    admit_width: int = 1 << 20
    admit_depth: int = 4

    def __post_init__(self):
        if self.shards_rate is not None and not 0 < self.shards_rate <= 1:
            raise SettingError(f"--shards rate must be in (0, 1], got {self.shards_rate}")
        for name in ("hbm_target", "hit_target"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1:
                raise SettingError(f"{name} must be a hit ratio in (0, 1], got {v}")
        asks = [what for what, given in (("hit-ratio targets", bool(self.hbm_target or self.hit_target)),
                                         ("byte budgets", self.hbm_bytes is not None or self.ddr_bytes is not None),
                                         ("a memory budget", self.memory_budget is not None)) if given]
        if len(asks) > 1:
            raise SettingError(f"give one of hit-ratio targets (per table), byte budgets (split across tables) or a store's "
                             f"memory budget, not {' and '.join(asks)}")
        check_int(self.memory_budget, "memory_budget", at_least=1, none=True)
        if self.hbm_target and self.hit_target and self.hit_target < self.hbm_target:
            raise SettingError(f"hit_target ({self.hit_target}) counts HBM and DDR hits, so it cannot be below hbm_target ({self.hbm_target})")
        for name in ("hbm_bytes", "ddr_bytes"):
            check_number(getattr(self, name), name, none=True)
        bad = [p for p in self.policies if p not in (*POLICIES, "lookahead")]
        if bad:
            raise SettingError(f"unknown policies {bad}; simulate {', '.join(sorted(POLICIES))} or lookahead")
        check_int(self.window, "window", at_least=1, meaning="batches")
        check_number(self.steps_per_s, "steps_per_s", above=True)
        check_number(self.row_bytes, "row_bytes", above=True, none=True)
        for h, d in self.sizes:
            _size_rows(h, 1)
            _size_rows(d, 1)
        if self.admit_after is not None:  # the store's own checks, with its messages
            from tierstore.spec import TableSpec
            TableSpec("t", None, 1, admit_after=self.admit_after, admit_width=self.admit_width, admit_depth=self.admit_depth)


def _size_rows(spec, working_set: float) -> int:
    s = str(spec).strip()
    try:
        v = math.ceil(float(s[:-1]) / 100 * working_set) if s.endswith("%") else int(s)
    except ValueError:
        v = -1
    if v < 0:
        raise SettingError(f"a size must be rows (int >= 0) or a percentage of the working set like '5%', got {spec!r}")
    return int(v)


def analyze(trace: Trace, config: CapacityConfig | None = None) -> dict:
    """The full report as a JSON-ready dict (see ``tierstore capacity --help``)."""
    cfg = config or CapacityConfig()
    names = list(cfg.tables) if cfg.tables else trace.table_names
    for n in names:
        trace.table_index(n)
    per_table = trace.accesses_per_table()
    empty = [n for n in names if per_table[trace.table_index(n)] == 0]
    if len(empty) == len(names):
        raise SettingError(f"the trace has no accesses{' to ' + ', '.join(map(repr, names)) if cfg.tables else ''} "
                         f"({trace.n_calls:,} calls): nothing to size. Record reads into it first "
                         "(a killed recorder keeps only what it synced), or pick tables that were read")
    n_steps = max(trace.n_steps, 1)
    per_s = cfg.steps_per_s / n_steps  # multiply a whole-trace count by this for a rate per second
    progress = bars if cfg.progress is True else cfg.progress or None
    t0 = time.perf_counter()
    need_streams = cfg.shards_rate is None or cfg.compare_exact or bool(cfg.policies) or cfg.belady  # replays need every use
    streams = build_streams(trace, names, progress) if need_streams else None
    t_streams = time.perf_counter() - t0
    report: dict = {
        "iec": cfg.iec,
        "notes": [f"table {n!r} has no accesses in this trace: its rows are zero" for n in empty],
        "trace": {"calls": trace.n_calls, "steps": trace.n_steps, "accesses": trace.n_accesses, "tables": len(names)},
        "steps_per_s": cfg.steps_per_s,
    }
    exact = None
    if cfg.shards_rate is None or cfg.compare_exact:
        te = time.perf_counter()
        dists = stack_distances(streams, progress)
        exact = [LruCurve.from_distances(s, d) for s, d in zip(streams, dists)]
        seconds = time.perf_counter() - te + t_streams  # the curve needs the streams too
        report["exact"] = {"seconds": seconds, "accesses_per_s": trace.n_accesses / max(seconds, 1e-9)}
    curves = exact
    if cfg.shards_rate is not None:
        sh = shards_curves(trace, cfg.shards_rate, names, cfg.seed, progress=progress)
        curves = sh.curves
        report["shards"] = {"rate": sh.rate, "table_rates": dict(zip(names, sh.table_rates)),
                            "min_sample_rows": MIN_SAMPLE_ROWS, "sampled_accesses": sh.sampled_accesses,
                            "seconds": sh.seconds, "accesses_per_s": trace.n_accesses / max(sh.seconds, 1e-9),
                            "error_bound": dict(zip(names, sh.max_bound)), "error_bound_mean": dict(zip(names, sh.mean_bound))}
        if exact is not None:
            report["shards"]["measured_mae"] = {c.name: mean_abs_error(a, c) for a, c in zip(sh.curves, exact)}
            report["shards"]["measured_max_error"] = {
                c.name: float(np.abs(a.hit_ratio(g) - c.hit_ratio(g)).max()) for a, c, g in zip(sh.curves, exact, sh.error_sizes)}
    report["method"] = "exact" if cfg.shards_rate is None else f"shards@{cfg.shards_rate:g}"
    row_bytes = [_row_bytes(trace.tables[trace.table_index(n)], cfg.row_bytes) for n in names]

    tables = []
    for i, c in enumerate(curves):
        grid = np.unique(np.concatenate([[0], np.geomspace(1, max(c.working_set, 1), 120).round()])).astype(np.int64)
        ratios = c.hit_ratio(grid)
        t = {
            "name": c.name, "accesses": c.n_accesses, "uses": _num(c.n_uses), "calls": c.n_calls,
            "working_set": _num(c.working_set), "uses_per_step": c.n_uses / n_steps,
            "row_bytes": row_bytes[i], "max_hit_ratio": c.max_hit_ratio(),
            "curve": {"rows": grid.tolist(), "hit_ratio": ratios.tolist(),
                      **({"error_bound": sh.bound(i, grid).tolist()} if cfg.shards_rate is not None else {})},
            "reuse_histogram": c.reuse_histogram(),
            "reuse_by_decade": _decade_shares(c),
            "ssd_no_cache": _rate(c.n_uses, per_s, row_bytes[i]),
        }
        if exact is not None and exact is not curves:
            t["exact_curve"] = {"rows": grid.tolist(), "hit_ratio": exact[i].hit_ratio(grid).tolist()}
        tables.append(t)

    # recommendations: targets per table, or a byte budget split across tables
    recs = None
    if cfg.hbm_target or cfg.hit_target:
        recs = [rows_for_targets(c, cfg.hbm_target, cfg.hit_target) for c in curves]
    if cfg.hbm_bytes is not None or cfg.ddr_bytes is not None:
        h = split_budget(curves, row_bytes, cfg.hbm_bytes or 0)
        d = split_budget(curves, row_bytes, cfg.ddr_bytes or 0, start=h)
        recs = [{"hbm_rows": hi, "ddr_rows": di, "reachable": True, "max_hit_ratio": c.max_hit_ratio()}
                for hi, di, c in zip(h, d, curves)]
        report["budget"] = {"hbm_bytes": cfg.hbm_bytes or 0, "ddr_bytes": cfg.ddr_bytes or 0,
                            "hbm_bytes_used": int(sum(x * b for x, b in zip(h, row_bytes))),
                            "ddr_bytes_used": int(sum(x * b for x, b in zip(d, row_bytes)))}
        full = all(float(c.hits(hi + di)) >= float(c.hits(math.ceil(c.working_set))) for c, hi, di in zip(curves, h, d))
        for tier, asked in (("HBM", cfg.hbm_bytes or 0), ("DDR", cfg.ddr_bytes or 0)):
            used = report["budget"][f"{tier.lower()}_bytes_used"]
            if asked > used and full:
                report["notes"].append(f"the {tier} budget {fmt_bytes(asked, cfg.iec)} is beyond what the tables can use: "
                                       f"{fmt_bytes(used, cfg.iec)} of it already get every hit the trace allows")
    if cfg.memory_budget is not None:
        split = store_split(trace, names, cfg.memory_budget, cfg.row_bytes)
        recs = [{"hbm_rows": split.hbm_rows[n], "ddr_rows": split.ddr_rows[n], "reachable": True,
                 "max_hit_ratio": c.max_hit_ratio()} for n, c in zip(names, curves)]
        report["memory_budget"] = {"budget": cfg.memory_budget, "parts": {k: p.bytes for k, p in split.parts.items()},
                                   "txn_rows": split.txn_rows, "writeback_rows": split.writeback_rows}
    if recs is not None:
        for t, c, r, rb in zip(tables, curves, recs, row_bytes):
            tiers = c.tiers(r["hbm_rows"], r["ddr_rows"])
            r.update(_tier_summary(tiers, c.n_uses, per_s, rb))
            r["hbm_bytes"], r["ddr_bytes"] = r["hbm_rows"] * rb, r["ddr_rows"] * rb
            t["recommendation"] = r

    # simulations at chosen sizes (default: the recommendation, else 1% / 10% of the working set)
    for i, (t, c) in enumerate(zip(tables, curves)):
        points = [(_size_rows(h, c.working_set), _size_rows(d, c.working_set)) for h, d in cfg.sizes]
        if not points:
            points = [(t["recommendation"]["hbm_rows"], t["recommendation"]["ddr_rows"])] if "recommendation" in t else \
                [(_size_rows("1%", c.working_set), _size_rows("10%", c.working_set))]
        sims = []
        for ask in points:
            h, d = clamp_sizes(*ask, c.working_set)
            if (h, d) != ask:
                report["notes"].append(
                    f"table {c.name!r}: {ask[0]:,}:{ask[1]:,} rows is beyond its working set of {fmt_count(c.working_set)} rows "
                    f"(more rows cannot hit more); reported as {h:,}:{d:,}")
            # LRU needs no replay: the curve gives every size
            sims.append({"policy": "lru", "hbm_rows": h, "ddr_rows": d, "predicted": "curve" if c.exact else report["method"],
                         **_tier_summary(c.tiers(h, d), c.n_uses, per_s, row_bytes[i])})
            if streams is None:
                continue
            s = streams[i]
            for pol in cfg.policies:
                counts = simulate(s, h, d, pol, cfg.window, progress=progress)
                hh, dh = counts.hbm_hits, counts.ddr_hits
                sims.append({"policy": pol if pol != "lookahead" else f"lookahead(window={cfg.window}, base=lru)",
                             "hbm_rows": h, "ddr_rows": d, "predicted": "simulated",
                             **_tier_summary({"hbm_hits": hh, "ddr_hits": dh, "misses": s.n_uses - hh - dh}, s.n_uses, per_s, row_bytes[i])})
            if cfg.belady:
                bh = simulate(s, h, 0, "belady", progress=progress).hbm_hits if h else 0
                bt = simulate(s, h + d, 0, "belady", progress=progress).hbm_hits if h + d else 0
                sims.append({"policy": "belady (bound)", "hbm_rows": h, "ddr_rows": d, "predicted": "simulated",
                             **_tier_summary({"hbm_hits": bh, "ddr_hits": bt - bh, "misses": s.n_uses - bt}, s.n_uses, per_s, row_bytes[i])})
        t["simulations"] = sims
    report["tables"] = tables
    if cfg.admit_after is not None:
        report["admission"] = {n: predict_admission(trace, n, cfg.admit_after, cfg.admit_width, cfg.admit_depth) for n in names}
    report["total"] = _totals(tables, per_s)
    report["total"]["curve"] = total_curve(curves, row_bytes)
    report["seconds"] = time.perf_counter() - t0
    return report


def store_split(trace: Trace, names: list[str], budget: int, row_bytes: int | None = None) -> MemorySplit:
    """The memory split (tierstore.engine.memory.split_memory) of a new store of the trace's tables
    ``names`` opened with ``memory_budget=budget``: its tiers, staging, queue, row index."""
    specs = []
    for n in names:
        t = trace.tables[trace.table_index(n)]
        width = (row_bytes or t.row_bytes or 0) // 4
        if t.dim is None and not width:
            raise SettingError(f"a memory budget's split needs table {n!r}'s row size, which this trace does not record "
                             "(a store's recorded trace does): give --row-bytes (4 x (dim + optimizer state floats))")
        dim = t.dim or width
        specs.append(TableSpec(n, t.num_rows, dim, state_dim=max(width - dim, 0)))
    # a new store puts bounded tables in the log layout, which keeps a row index in memory
    return split_memory(budget, specs, indexed_tables=[s.name for s in specs if s.num_rows is not None])


DECADES = [10**k for k in range(1, 8)]


def _decade_shares(c: LruCurve) -> list[float]:
    """Share of uses with stack distance < 10, in [10, 100), ... >= 1e7, then first touches."""
    n = c.n_uses
    if not n:
        return [0.0] * (len(DECADES) + 2)
    below = np.asarray(c.hits(np.array(DECADES)), dtype=np.float64) / n
    reuses = 1.0 - c.working_set / n
    return np.maximum(np.diff(np.concatenate([[0.0], below, [reuses]])), 0.0).tolist() + [c.working_set / n]


def _row_bytes(table, override) -> int:
    if override:
        return int(override)
    if table.row_bytes:
        return int(table.row_bytes)
    if table.dim:
        return 4 * int(table.dim)
    return DEFAULT_ROW_BYTES


def _num(x):
    return int(round(x)) if float(x).is_integer() else float(x)


def _rate(rows: float, per_s: float, row_bytes: int) -> dict:
    r = float(rows) * per_s
    return {"rows_per_s": r, "mb_per_s": r * row_bytes / 1e6}


def _tier_summary(tiers: dict, uses: float, per_s: float, row_bytes: int) -> dict:
    uses = float(uses) or 1.0
    hh, dh, m = (float(tiers[k]) for k in ("hbm_hits", "ddr_hits", "misses"))
    out = {"hbm_hits": _num(hh), "ddr_hits": _num(dh), "misses": _num(m),
           "hbm_hit_ratio": hh / uses, "hit_ratio": (hh + dh) / uses}
    out["ssd"] = _rate(m, per_s, row_bytes)
    return out


def _totals(tables: list[dict], per_s: float) -> dict:
    out = {"accesses": sum(t["accesses"] for t in tables), "uses": sum(t["uses"] for t in tables),
           "working_set_rows": sum(t["working_set"] for t in tables),
           "working_set_bytes": sum(t["working_set"] * t["row_bytes"] for t in tables),
           "ssd_no_cache": {k: sum(t["ssd_no_cache"][k] for t in tables) for k in ("rows_per_s", "mb_per_s")}}
    if tables and all("recommendation" in t for t in tables):
        r = [t["recommendation"] for t in tables]
        uses = out["uses"] or 1
        out["recommendation"] = {
            "hbm_rows": sum(x["hbm_rows"] for x in r), "ddr_rows": sum(x["ddr_rows"] for x in r),
            "hbm_bytes": sum(x["hbm_bytes"] for x in r), "ddr_bytes": sum(x["ddr_bytes"] for x in r),
            "hbm_hit_ratio": sum(x["hbm_hits"] for x in r) / uses,
            "hit_ratio": sum(x["hbm_hits"] + x["ddr_hits"] for x in r) / uses,
            "ssd": {k: sum(x["ssd"][k] for x in r) for k in ("rows_per_s", "mb_per_s")},
        }
    return out


def fmt_count(x) -> str:
    """A count of rows, rounded, with thousands separators."""
    return f"{x:,.0f}"


def fmt_bytes(b: float, iec: bool = False) -> str:
    """Bytes in kB/MB/GB, or KiB/MiB/GiB when ``iec``."""
    step, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if iec else (1000, ("B", "kB", "MB", "GB", "TB"))
    for unit in units:
        if abs(b) < step or unit == units[-1]:
            return f"{b:,.1f} {unit}"
        b /= step
