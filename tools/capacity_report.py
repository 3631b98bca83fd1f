"""``tierstore capacity``'s report (tools/capacity_analysis.py) as terminal tables or JSON."""
from __future__ import annotations

import json

import numpy as np

from tierstore.capacity.shards import ERROR_SIGMAS, SUB_SAMPLES
from tierstore.tools.capacity_analysis import DECADES, fmt_bytes, fmt_count


def format_report(report: dict) -> str:
    """A terminal table per section."""
    lines = []
    iec = report.get("iec", False)
    div, unit = bandwidth_unit(report)
    tr = report["trace"]
    lines.append(f"trace: {tr['accesses']:,} accesses, {tr['calls']:,} calls, {tr['steps']:,} steps, {tr['tables']} tables; "
                 f"curves: {report['method']}; rates at {report['steps_per_s']:g} steps/s")
    if "exact" in report:
        lines.append(f"exact LRU curve: {report['exact']['seconds']:.2f} s ({report['exact']['accesses_per_s'] / 1e6:.1f}M accesses/s)")
    if "shards" in report:
        s = report["shards"]
        worst = lambda d: max([v for v in d.values() if v == v], default=float("nan"))  # noqa: E731
        raised = {n: r for n, r in s["table_rates"].items() if r > s["rate"]}
        line = (f"SHARDS rate {s['rate']:g}: {s['sampled_accesses']:,} sampled accesses, {s['seconds']:.2f} s "
                f"({s['accesses_per_s'] / 1e6:.1f}M accesses/s)")
        if raised:
            line += (f"; rate raised to sample >= {s['min_sample_rows']:,} rows in {len(raised)} table(s) ("
                     + ", ".join(f"{n} {r:.3g}" for n, r in list(raised.items())[:5]) + (", ..." if len(raised) > 5 else "") + ")")
        lines.append(line)
        line = (f"SHARDS miss-ratio error bound ({ERROR_SIGMAS:g} sigma of {SUB_SAMPLES} sub-samples + resolution, worst table): "
                f"<= {worst(s['error_bound']):.4f} at any size, {worst(s['error_bound_mean']):.4f} on average")
        if "measured_mae" in s:
            line += f"; measured max {worst(s['measured_max_error']):.4f}, mean {worst(s['measured_mae']):.4f}"
        lines.append(line)
    lines += [f"note: {n}" for n in report.get("notes", [])]
    lines.append("")
    head = ["table", "accesses", "uses/step", "working set", "max hit", "hit@1%", "hit@10%", f"SSD {unit}/s no cache"]
    rows = []
    for t in report["tables"]:
        rows_grid, ratio = np.array(t["curve"]["rows"]), np.array(t["curve"]["hit_ratio"])
        at = lambda f: float(np.interp(f * t["working_set"], rows_grid, ratio))  # noqa: E731
        rows.append([t["name"], f"{t['accesses']:,}", f"{t['uses_per_step']:,.0f}", f"{fmt_count(t['working_set'])} rows",
                     f"{t['max_hit_ratio']:.3f}", f"{at(0.01):.3f}", f"{at(0.10):.3f}", f"{t['ssd_no_cache']['mb_per_s'] * 1e6 / div:,.1f}"])
    lines += _table(head, rows)
    lines.append("")
    lines.append("reuse distances (share of uses by LRU stack distance, rows; first touch = cold miss at any size):")
    head = ["table"] + [f"<{_fmt_rows(d)}" for d in DECADES] + [f">={_fmt_rows(DECADES[-1])}", "first touch"]
    rows = [[t["name"]] + [f"{x:.3f}" for x in t["reuse_by_decade"]] for t in report["tables"]]
    lines += _table(head, rows)
    if any("recommendation" in t for t in report["tables"]):
        lines.append("")
        kind = ", byte budget split" if "budget" in report else ", the memory budget's split" if "memory_budget" in report else ", targets"
        lines.append("recommendation (LRU" + kind + "):")
        budget = report.get("memory_budget")
        if budget:
            lines.append(f"  memory_budget={fmt_bytes(budget['budget'], iec)} splits as: "
                         + ", ".join(f"{k} {fmt_bytes(v, iec)}" for k, v in budget["parts"].items() if v)
                         + f"; LMDB write transactions of {budget['txn_rows']:,} rows")
        head = ["table", "HBM rows", "DDR rows", "HBM hit", "hit", "SSD rows/s", f"SSD {unit}/s", "note"]
        rows = []
        for t in report["tables"]:
            r = t.get("recommendation")
            if r:
                rows.append([t["name"], f"{r['hbm_rows']:,}", f"{r['ddr_rows']:,}", f"{r['hbm_hit_ratio']:.3f}", f"{r['hit_ratio']:.3f}",
                             f"{r['ssd']['rows_per_s']:,.0f}", f"{r['ssd']['mb_per_s'] * 1e6 / div:,.1f}",
                             "" if r["reachable"] else f"target unreachable (max {r['max_hit_ratio']:.3f}: first touches)"])
        tot = report["total"].get("recommendation")
        if tot:
            rows.append(["TOTAL", f"{tot['hbm_rows']:,}", f"{tot['ddr_rows']:,}", f"{tot['hbm_hit_ratio']:.3f}", f"{tot['hit_ratio']:.3f}",
                         f"{tot['ssd']['rows_per_s']:,.0f}", f"{tot['ssd']['mb_per_s'] * 1e6 / div:,.1f}",
                         f"{fmt_bytes(tot['hbm_bytes'], iec)} HBM + {fmt_bytes(tot['ddr_bytes'], iec)} DDR"])
        lines += _table(head, rows)
    if any("simulations" in t for t in report["tables"]):
        lines.append("")
        lines.append("at chosen sizes (LRU read off the curve, other policies replayed; hits as the store counts them):")
        head = ["table", "policy", "HBM rows", "DDR rows", "HBM hit", "hit", "SSD rows/s", f"SSD {unit}/s"]
        rows = []
        for t in report["tables"]:
            for s in t.get("simulations", []):
                name = s["policy"] if s["predicted"] == "simulated" or "belady" in s["policy"] else f"{s['policy']} ({s['predicted']})"
                rows.append([t["name"], name, f"{s['hbm_rows']:,}", f"{s['ddr_rows']:,}", f"{s['hbm_hit_ratio']:.3f}",
                             f"{s['hit_ratio']:.3f}", f"{s['ssd']['rows_per_s']:,.0f}", f"{s['ssd']['mb_per_s'] * 1e6 / div:,.1f}"])
        lines += _table(head, rows)
    if "admission" in report:
        lines.append("")
        first = next(iter(report["admission"].values()))
        lines.append(f"admission (admit_after {first['admit_after']}, sketch {first['sketch']['width']:,} x {first['sketch']['depth']}, "
                     f"{fmt_bytes(first['sketch']['bytes'], iec)} a table; uses kept / dropped, rows that get storage):")
        head = ["table", "distinct rows", "rows stored", "uses kept", "uses dropped", "sketch fill", "exact: rows stored", "uses dropped"]
        rows = [[n, f"{a['distinct_rows']:,}", f"{a['rows_admitted']:,}", f"{a['admitted']:,}", f"{a['rejected']:,}",
                 f"{a['sketch']['fill']:.3f}", f"{a['exact_rows_admitted']:,}", f"{a['exact_rejected']:,}"]
                for n, a in report["admission"].items()]
        lines += _table(head, rows)
    tot = report["total"]
    lines.append("")
    lines.append(f"total: working set {fmt_count(tot['working_set_rows'])} rows ({fmt_bytes(tot['working_set_bytes'], iec)}); "
                 f"SSD demand with no cache {tot['ssd_no_cache']['mb_per_s'] * 1e6 / div:,.1f} {unit}/s")
    tc = tot.get("curve")
    if tc and tc["hit_ratio"]:
        ratio, spent = np.array(tc["hit_ratio"]), np.array(tc["bytes"])
        top = float(ratio.max())
        marks = [f"{q:.0%} of the max at {fmt_bytes(float(spent[np.argmax(ratio >= q * top - 1e-12)]), iec)}" for q in (0.5, 0.8, 0.9, 0.99)]
        lines.append(f"total LRU hit ratio with a cache split well across tables: max {top:.3f}; " + ", ".join(marks))
    return "\n".join(lines)


def _table(head, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _fmt_rows(n: int) -> str:
    return f"{n // 10**6}M" if n >= 10**6 else f"{n // 1000}k" if n >= 1000 else str(n)


def bandwidth_unit(report: dict) -> tuple[float, str]:
    """The unit of the report's bandwidths: MiB/s when bytes were given in binary units."""
    return (2**20, "MiB") if report.get("iec") else (1e6, "MB")


def to_json(report: dict) -> str:
    """The report as indented JSON (numpy scalars as numbers)."""
    return json.dumps(report, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))
