"""``tierstore capacity`` never loses an analysis: options that would fail after
it (--plot without matplotlib, a --plot folder that cannot be made) fail before
the trace is even loaded, and the report is printed before the plots are written."""
from __future__ import annotations

import errno

import pytest

from tierstore.tools import capacity as cap
from tierstore.tools.cli import main as cli_main
from tierstore.tools.synth import SynthConfig, synth
from tierstore.trace import Trace


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "t.npz"
    synth(SynthConfig(tables=(("a", 3000),), batch_size=32, pooling=4, steps=20)).save(path)
    return path


@pytest.fixture
def work(monkeypatch):
    """Counts of the work a run does: trace loads and analyses (the real ones still run)."""
    counts = {"load": 0, "analyze": 0}
    load, analyze = Trace.load.__func__, cap.analyze

    def counting_load(cls, *a, **k):
        counts["load"] += 1
        return load(cls, *a, **k)

    def counting_analyze(*a, **k):
        counts["analyze"] += 1
        return analyze(*a, **k)

    monkeypatch.setattr(Trace, "load", classmethod(counting_load))
    monkeypatch.setattr(cap, "analyze", counting_analyze)
    return counts


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierstore: error: "), err
    return lines[0]


def test_plot_without_matplotlib_fails_before_the_analysis(trace_path, tmp_path, capsys, work, no_matplotlib):
    assert cli_main(["capacity", str(trace_path), "--plot", str(tmp_path / "plots")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and work == {"load": 0, "analyze": 0}
    line = one_error_line(err)
    assert "--plot" in line and "pip install 'tierstore[plot]'" in line


@pytest.mark.parametrize("where", ["the folder is a file", "a parent is a file"])
def test_a_plot_folder_that_cannot_be_made_fails_before_the_analysis(where, trace_path, tmp_path, capsys, work):
    (tmp_path / "taken").write_text("not a folder")
    plots = tmp_path / "taken" if where == "the folder is a file" else tmp_path / "taken" / "plots"
    assert cli_main(["capacity", str(trace_path), "--plot", str(plots)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and work == {"load": 0, "analyze": 0}
    line = one_error_line(err)
    assert f"--plot {plots}" in line and "is a file" in line and "folder" in line
    assert (tmp_path / "taken").read_text() == "not a folder"


def test_a_plot_where_a_folder_stands_fails_before_the_analysis(trace_path, tmp_path, capsys, work):
    (tmp_path / "plots" / "miss_ratio.png").mkdir(parents=True)
    assert cli_main(["capacity", str(trace_path), "--plot", str(tmp_path / "plots")]) == 2
    assert work == {"load": 0, "analyze": 0}
    assert "miss_ratio.png is a folder" in one_error_line(capsys.readouterr().err)


def test_the_report_is_printed_before_the_plots_are_written(trace_path, tmp_path, monkeypatch, capsys, work):
    pytest.importorskip("matplotlib", reason="plots need the optional peer matplotlib")

    def disk_full(report, out_dir):  # an injected fault in the last step
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir))

    monkeypatch.setattr(cap, "plot_report", disk_full)
    assert cli_main(["capacity", str(trace_path), "--plot", str(tmp_path / "plots")]) == 2
    out, err = capsys.readouterr()
    assert "recommendation" in out or "reuse distances" in out  # the report is there to read
    assert "no space left on device" in one_error_line(err).lower() and work["analyze"] == 1


def test_a_memory_budget_is_split_and_predicted_as_the_store_does(tmp_path, capsys):
    """`tierstore capacity TRACE --memory-budget SIZE`: the split a store opened with that budget
    gets, and, at its DDR rows, the hits and misses that store measures on the same reads, to the
    row (the store records the trace it is checked against)."""
    import json

    import numpy as np
    from prometheus_client import CollectorRegistry

    import tierstore

    budget = "12MiB"
    rng = np.random.default_rng(5)
    store = tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("t", 200_000, 16)], memory_budget=budget,
                                  record_trace=tmp_path / "trace", registry=CollectorRegistry())
    for _ in range(40):
        store.read("t", (rng.zipf(1.05, 3_000) * 7919) % 200_000)
    measured, ddr_rows = store.stats()["ddr"], store.memory().parts["ddr"].rows
    store.close()
    assert 0 < ddr_rows and measured["evictions"] > 0  # the tier is full and evicting: a real test

    assert cli_main(["capacity", str(tmp_path / "trace"), "--memory-budget", budget, "--policies", "lru", "--no-belady", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (t,) = report["tables"]
    assert (t["recommendation"]["hbm_rows"], t["recommendation"]["ddr_rows"]) == (0, ddr_rows)
    lru_curve, lru_replay = t["simulations"][:2]
    uses = measured["hits"] + measured["misses"]
    for predicted in (lru_curve, lru_replay):
        assert round(predicted["hit_ratio"] * uses) == measured["hits"], (predicted, measured)
    assert report["memory_budget"]["parts"]["ddr"] == tierstore.engine.memory.split_memory(
        12 << 20, [tierstore.TableSpec("t", 200_000, 16)], indexed_tables=["t"]).parts["ddr"].bytes

    assert cli_main(["capacity", str(tmp_path / "trace"), "--memory-budget", budget, "--policies", "", "--no-belady"]) == 0
    out = capsys.readouterr().out
    assert "the memory budget's split" in out and "memory_budget=12.0 MiB splits as: ddr" in out


def test_a_memory_budget_with_targets_is_refused_naming_both(trace_path, capsys):
    assert cli_main(["capacity", str(trace_path), "--memory-budget", "1GiB", "--hit", "0.9"]) == 2
    assert "not hit-ratio targets and a memory budget" in capsys.readouterr().err
