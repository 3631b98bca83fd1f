"""The saved capacity plots (tools/capacity_plots.py), read back from their PNG files:
pixels for the colours, the PNG's text chunks for the labels, legend and axis ranges."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="plots need the optional peer matplotlib (pip install 'tierstore[plot]')")
from matplotlib import colors as mcolors  # noqa: E402
from matplotlib import image as mimage  # noqa: E402
from PIL import Image  # noqa: E402 (matplotlib's own dependency)

from tierstore.tools.capacity import CapacityConfig, analyze, plot_report  # noqa: E402
from tierstore.tools.capacity_report import bandwidth_unit  # noqa: E402
from tierstore.tools.synth import SynthConfig, SynthTable, synth  # noqa: E402


@pytest.fixture(scope="module")
def plots(tmp_path_factory):
    # two tables of near sizes: the case where a policy's points must show whose they are
    trace = synth(SynthConfig(tables=(SynthTable("a", 20_000), SynthTable("b", 22_000)), batch_size=64, pooling=4,
                              steps=60, dim=16))
    report = analyze(trace, CapacityConfig(hbm_target=0.3, hit_target=0.5, policies=("lfu", "lookahead")))
    out = tmp_path_factory.mktemp("plots")
    return report, {p.name: p for p in plot_report(report, out)}


def pixels_of(path, colour: str) -> int:
    rgb = mimage.imread(path)[..., :3]
    return int((np.abs(rgb - np.array(mcolors.to_rgb(colour))).max(axis=-1) < 2 / 255).sum())


def about(path) -> dict[str, str]:
    text = Image.open(path).text
    return {"title": text["Title"], **dict(line.split(": ", 1) for line in text["Description"].splitlines())}


def test_policy_points_take_their_tables_colour(plots):
    _, files = plots
    png = files["miss_ratio.png"]
    # tables a and b draw in matplotlib's first two colours, and so must every point of theirs;
    # the policies' own colours (LFU red, lookahead purple) would tell policies apart, not tables
    assert pixels_of(png, "tab:blue") > 0 and pixels_of(png, "tab:orange") > 0
    assert pixels_of(png, "tab:red") == 0 and pixels_of(png, "tab:purple") == 0


def test_the_legend_explains_the_dashed_lines_and_the_y_label_is_plain(plots):
    _, files = plots
    info = about(files["miss_ratio.png"])
    assert "recommended sizes (dashed" in info["legend"]
    assert "'miss ratio (share of row lookups not served)'" in info["axes"]


def test_the_total_curve_axis_starts_where_the_curve_rises(plots):
    report, files = plots
    curve = report["total"]["curve"]
    div, _ = bandwidth_unit(report)  # the axis's unit
    x = np.maximum(np.array(curve["bytes"]), 1) / div
    hit = np.array(curve["hit_ratio"])
    rises = x[np.flatnonzero(hit >= 0.01 * hit.max())[0]]
    hbm = report["total"]["recommendation"]["hbm_bytes"] / div
    info = about(files["total_miss_ratio.png"])
    left = float(info["axes"].split(" from ", 1)[1].split(" ", 1)[0])
    # an octave below the first of the curve's rise and the recommended HBM bytes, not decades of flat start
    assert left == pytest.approx(min(rises, hbm) / 2, rel=1e-3)
    assert x[0] < left  # this trace's curve has sampled sizes below its rise (else the test shows nothing)
    # without a byte budget the recommended sizes are drawn, and named in the legend
    assert "HBM recommended" in info["legend"] and "HBM + DDR recommended" in info["legend"]
