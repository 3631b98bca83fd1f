"""``tierstore capacity --plot``: PNG plots of the report (tools/capacity_analysis.py).

The command checks :func:`pyplot` and :func:`check_plot_dir` before the
analysis starts, so a missing extra or a bad folder costs nothing."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from tierstore.tools.capacity_analysis import fmt_bytes
from tierstore.tools.capacity_report import bandwidth_unit
from tierstore.errors import MissingDependencyError

PLOT_FILES = ("miss_ratio.png", "total_miss_ratio.png", "ssd_bandwidth.png")  # what plot_report writes, in order


def pyplot():
    """matplotlib's pyplot on a file-only backend, or an ImportError that names the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("--plot needs matplotlib: pip install 'tierstore[plot]'") from None
    return plt


def check_plot_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a Path, if the plots can be written there: an existing folder
    we may write in (no folder where a plot file goes), or one that can be created
    under the nearest existing folder. Raises an OSError naming the path and the fix;
    creates nothing."""
    given = Path(out_dir)
    path = Path(os.path.abspath(given))
    if os.path.lexists(path) and not path.is_dir():
        raise NotADirectoryError(f"--plot {given}: {path} is a file, not a folder; name a folder for the plots "
                                 "(it is created if missing)")
    parent = path
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"--plot {given}: {parent} is a file, so the folder cannot be created under it; "
                                 "name another folder for the plots")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"--plot {given}: no permission to write in {parent}; name a folder you can write to")
    in_the_way = [f for f in PLOT_FILES if (path / f).is_dir()]
    if in_the_way:
        raise IsADirectoryError(f"--plot {given}: {path / in_the_way[0]} is a folder where a plot goes; "
                                "remove it or name another folder")
    return given


# a replayed policy's marker; its colour is its table's, so tables of near sizes stay apart
_POLICY_STYLE = {
    "lru": ("o", "simulated LRU"),
    "lfu": ("s", "LFU"),
    "lookahead": ("^", "lookahead"),
    "belady": ("x", "Belady bound"),
}
# what the tables' points mean, under the axes (the y label only says what is measured)
POINTS_NOTE = "Points: at a table's HBM rows, the HBM tier's miss ratio; at its HBM + DDR rows, both tiers' (misses that go to LMDB)."


_OTHER_MARKERS = "DvP*<>"  # for policies registered beyond these


def _policy_style(name: str) -> tuple[str, str]:
    key = next((k for k in _POLICY_STYLE if name.startswith(k)), None)
    if key is not None:
        return _POLICY_STYLE[key]
    return _OTHER_MARKERS[sum(map(ord, name)) % len(_OTHER_MARKERS)], name


def plot_report(report: dict, out_dir: str | Path) -> list[Path]:
    """PNG plots: the miss-ratio curves, the total curve against bytes, and the SSD bandwidth per table."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    tables = report["tables"]
    div, mb = bandwidth_unit(report)
    iec = report.get("iec", False)
    plain = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")

    fig, ax = plt.subplots(figsize=(9, 5.5))
    seen: dict[str, str] = {}  # label -> marker
    for t in tables[:20]:
        rows = np.maximum(np.array(t["curve"]["rows"]), 1)
        miss = 1 - np.array(t["curve"]["hit_ratio"])
        (line,) = ax.plot(rows, miss, label=t["name"])
        if "error_bound" in t["curve"]:
            err = np.array(t["curve"]["error_bound"])
            ax.fill_between(rows, np.clip(miss - err, 0, 1), np.clip(miss + err, 0, 1), color=line.get_color(), alpha=0.15, lw=0)
        if "exact_curve" in t:
            ax.plot(rows, 1 - np.array(t["exact_curve"]["hit_ratio"]), "k:", lw=0.8)
        r = t.get("recommendation")
        if r:  # the recommended sizes: HBM alone and HBM + DDR
            for size, ratio, mk in ((r["hbm_rows"], r["hbm_hit_ratio"], "v"), (r["hbm_rows"] + r["ddr_rows"], r["hit_ratio"], "*")):
                ax.plot(max(size, 1), 1 - ratio, mk, color=line.get_color(), ms=12, mec="black", mew=0.8, zorder=5)
                ax.axvline(max(size, 1), color=line.get_color(), ls="--", lw=0.8, alpha=0.7)
        for s in t.get("simulations", []):
            if s["predicted"] != "simulated":
                continue
            marker, label = _policy_style(s["policy"])
            for size, ratio in ((s["hbm_rows"], s["hbm_hit_ratio"]), (s["hbm_rows"] + s["ddr_rows"], s["hit_ratio"])):
                if size:  # HBM hits at the HBM size, all cache hits at HBM + DDR
                    ax.plot(size, 1 - ratio, marker, ms=8, mew=1.5, zorder=6, color=line.get_color(),
                            mfc="none" if marker != "x" else None)
            seen[label] = marker
    for label, marker in seen.items():  # legend entries for the point styles used, in a neutral colour: the shape is the policy
        ax.plot([], [], marker, color="gray", mfc="none" if marker != "x" else None, ms=8, mew=1.5, ls="none", label=label)
    if any(t.get("recommendation") for t in tables):
        ax.plot([], [], "v", color="gray", mec="black", ms=10, ls="none", label="recommended HBM rows")
        ax.plot([], [], "*", color="gray", mec="black", ms=12, ls="none", label="recommended HBM + DDR rows")
        ax.plot([], [], color="gray", ls="--", lw=0.8, label="recommended sizes (dashed, table's colour)")
    if any("exact_curve" in t for t in tables):
        ax.plot([], [], "k:", lw=0.8, label="exact LRU")
    if any("error_bound" in t["curve"] for t in tables):
        ax.fill_between([], [], [], color="gray", alpha=0.15, label="SHARDS error bound")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plain)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("cache rows (HBM + DDR), per table")
    ax.set_ylabel("miss ratio (share of row lookups not served)")
    ax.set_title(f"Miss ratio against cache rows per table ({report['method']})")
    ax.legend(fontsize=7, loc="lower left", ncol=2 if len(tables) > 6 else 1)
    ax.grid(True, which="both", alpha=0.3)
    fig.text(0.01, -0.02, POINTS_NOTE, fontsize=8, ha="left", va="top")
    files.append(out / PLOT_FILES[0])
    _save(fig, ax, files[-1], plt)

    tc = report.get("total", {}).get("curve")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = []
    if tc and tc["bytes"]:
        x, hit = np.maximum(np.array(tc["bytes"]), 1) / div, np.array(tc["hit_ratio"])
        # the sampled sizes as dots, so a long straight segment reads as interpolation
        ax.plot(x, 1 - hit, "k.-", ms=3, label="LRU, bytes split for the most hits")
        xs.append(_rise_start(x, hit))
    sizes = report.get("budget") or report.get("total", {}).get("recommendation")
    if sizes:  # the byte budget given, else the bytes of the recommended rows: HBM alone, then HBM + DDR
        kind = "budget" if report.get("budget") else "recommended"
        for x, label, colour in ((sizes["hbm_bytes"], f"HBM {kind}", "tab:green"),
                                 (sizes["hbm_bytes"] + sizes["ddr_bytes"], f"HBM + DDR {kind}", "tab:orange")):
            if x > 0:
                ax.axvline(x / div, color=colour, ls="--", lw=1.5, label=f"{label} {fmt_bytes(x, iec)}")
                xs.append(x / div)
    ax.set_xscale("log")
    if xs:
        ax.set_xlim(left=min(xs) / 2)
    ax.xaxis.set_major_formatter(plain)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"cache {mb} (HBM + DDR), split across tables for the most hits")
    ax.set_ylabel("miss ratio, all tables (LRU)")
    ax.set_title("Miss ratio of the whole trace against cache bytes")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    files.append(out / PLOT_FILES[1])
    _save(fig, ax, files[-1], plt)

    files.append(out / PLOT_FILES[2])
    _plot_bandwidth(report, files[-1], plt, plain, div, mb)
    return files


def _rise_start(x: np.ndarray, hit: np.ndarray) -> float:
    """The first sampled size with 1% of the most hits: below it the curve is flat, or one
    straight segment across decades where nothing was sampled, which a log axis would spread
    over half its width."""
    rising = np.flatnonzero(hit >= 0.01 * hit.max())
    return float(x[rising[0]] if len(rising) else x[0])


def _save(fig, ax, path: Path, plt) -> None:
    """Save the PNG with what it shows in its text chunks (title, axis labels and ranges, legend),
    for tools and readers that cannot see it."""
    legend = ax.get_legend()
    about = {"axes": f"x {ax.get_xlabel()!r} from {ax.get_xlim()[0]:g} to {ax.get_xlim()[1]:g}; "
                     f"y {ax.get_ylabel()!r} from {ax.get_ylim()[0]:g} to {ax.get_ylim()[1]:g}",
             "legend": "; ".join(t.get_text() for t in legend.get_texts()) if legend else ""}
    fig.savefig(path, dpi=120, bbox_inches="tight",
                metadata={"Title": ax.get_title(), "Description": "\n".join(f"{k}: {v}" for k, v in about.items())})
    plt.close(fig)


def _plot_bandwidth(report: dict, path: Path, plt, plain, div: float, mb: str) -> None:
    """SSD reads per table and in total, with no cache and with the recommended tiers:
    a log axis (demands span decades) whose bars start a decade below the smallest,
    so a small bar still shows, with the value written on each."""
    tables = report["tables"]
    names = [t["name"] for t in tables] + ["TOTAL"]
    series = [("no cache", [t["ssd_no_cache"]["mb_per_s"] for t in tables] + [report["total"]["ssd_no_cache"]["mb_per_s"]], "tab:gray")]
    rec = report["total"].get("recommendation")
    if rec:
        series.append(("recommended tiers", [t["recommendation"]["ssd"]["mb_per_s"] for t in tables] + [rec["ssd"]["mb_per_s"]], "tab:blue"))
    values = np.array([v for _, vs, _ in series for v in vs]) * 1e6 / div
    positive = values[values > 0]
    bottom = 10 ** math.floor(math.log10(positive.min())) / 10 if len(positive) else 0.1
    top = max(positive.max() if len(positive) else 1.0, bottom * 10) * 4
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) + 2), 4.5))
    x = np.arange(len(names))
    width = 0.8 / len(series)
    for i, (label, vs, colour) in enumerate(series):
        v = np.array(vs) * 1e6 / div
        pos = x - 0.4 + width * (i + 0.5)
        ax.bar(pos, np.maximum(v, bottom) - bottom, width, bottom=bottom, label=label, color=colour)
        for px, val in zip(pos, v):
            ax.text(px, max(val, bottom) * 1.15, f"{val:.2g}" if val < 1 else f"{val:,.1f}" if val < 100 else f"{val:,.0f}", ha="center", va="bottom", fontsize=7)
    ax.axvline(len(names) - 1.5, color="black", lw=0.6)
    ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    ax.yaxis.set_major_formatter(plain)
    ax.set_xticks(x, names, rotation=90 if len(names) > 10 else 0, fontsize=8)
    ax.set_ylabel(f"SSD reads, {mb}/s")
    ax.set_title(f"SSD read bandwidth per table and in total at {report['steps_per_s']:g} steps/s")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    _save(fig, ax, path, plt)
