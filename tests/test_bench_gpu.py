"""`tierstore bench gpu` end to end on the CPU at a small size: every figure, check and
test count in its JSON; and the op counter it reports a step's ops with."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from tierstore.tools.bench_gpu import _tests_path
from tierstore.tools.cli import main
from tierstore.tools.dispatch_count import OpCounter

MARKED = '''
import pytest

@pytest.mark.gpu
def test_passes():
    pass

@pytest.mark.gpu
def test_fails():
    assert 1 == 2

@pytest.mark.gpu
@pytest.mark.skip(reason="needs 2 GPUs")
def test_skips():
    pass

def test_unmarked():
    pass
'''


def test_bench_gpu_on_the_cpu_reports_every_figure_in_its_json(tmp_path, capsys):
    tests = tmp_path / "marked"
    tests.mkdir()
    (tests / "test_marked.py").write_text(textwrap.dedent(MARKED))
    path = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--device", "cpu", "--quick", "--rows", "4096", "--batch", "1024", "--cache-rows", "40000", "--repeat", "2",
                 "--steps", "2", "--backend", "aot_eager", "--dir", str(tmp_path), "--tests", str(tests), "--json", str(path)]) == 0
    out = capsys.readouterr().out
    got = json.loads(path.read_text())
    assert set(got) == {"machine", "settings", "resident", "read", "cache", "compile", "ops", "tests", "goals", "errors",
                        "seconds"}
    assert got["errors"] == {}
    m = got["machine"]
    assert (m["device"], m["gpu"], m["torch"]) == ("cpu", None, torch.__version__)
    assert {"driver", "cuda", "commit", "date", "cpus"} <= set(m)

    for name in ("SGD", "Adagrad"):  # the resident step against torch's optimizers: the same rows, to rounding
        r = got["resident"][name]
        assert r["tierstore_ms"] > 0 and r["torch_ms"] > 0 and r["ratio"] == pytest.approx(r["tierstore_ms"] / r["torch_ms"])
        assert r["max_abs_diff_from_torch"] < 1e-4 and r["hbm_misses_timed"] == 0
    read = got["read"]
    assert read["rows_equal"] and read["ratio"] == pytest.approx(read["index_select_ms"] / read["tierstore_ms"])
    cache = got["cache"]
    assert (cache["rows"], cache["hbm_rows"], cache["ddr_rows"], cache["depth"]) == (40_000, 2_000, 4_000, 2)
    assert [(r["hbm_rows"], r["depth"]) for r in cache["runs"]] == [(40_000, 0), (2_000, 2), (2_000, 0)]
    assert cache["bit_identical"] and cache["max_abs_diff"] == 0.0
    assert cache["ratio"] == pytest.approx(cache["cached_ms"] / cache["resident_ms"])
    # how the misses went up: on CUDA from pinned staging on a side stream; here in place
    assert [r["side_stream"] for r in cache["runs"]] == [False] * 3 and "misses copied in place (no stream)" in out

    for step in ("resident", "cached"):  # counted by OpCounter; CUDA's sync debug mode only on CUDA
        ops = got["ops"][step]
        assert ops["aten_ops"] == sum(n for op, n in ops["ops"].items() if op.startswith("aten."))
        assert ops["sync_debug_warnings"] is None and ops["device_to_host"] == 0
        assert ops["aten_ops"] + ops["other_ops"] > 0
        # the device step (held, or resolved ahead at depth 2), its custom ops' insides counted: no wait, static shapes
        assert ops["host_syncs"] == ops["data_dependent"] == 0 and 0 < ops["aten_ops"] <= ops["leaf_ops"] <= 12, ops
        assert {"tierstore.bag_lookup", "tierstore.bag_update_"} <= set(ops["ops"]), ops["ops"]

    for name in ("compile", "export"):  # the demo DLRM over held tables (the device step): captured whole, equal to eager
        done = got["compile"][name]
        assert done["ok"] and done["equal"], done

    t = got["tests"]  # pytest -m gpu: the marked tests only, counted
    assert (t["passed"], t["failed"], t["skipped"], t["deselected"], t["error"]) == (1, 1, 1, 1, 0)
    assert t["returncode"] == 1 and not t["timed_out"]
    assert len(t["failures"]) == 1 and t["failures"][0].startswith("FAILED ") and "test_marked.py::test_fails" in t["failures"][0]

    goals = got["goals"]
    assert set(goals) == {"resident_sgd", "resident_adagrad", "read", "cache", "bit_identical", "sync_free_resident",
                          "sync_free_cached", "resident_ops", "compile_equals_eager", "export_equals_eager"}
    assert goals["resident_sgd"]["value"] == got["resident"]["SGD"]["ratio"] and goals["bit_identical"]["met"] is True
    assert all(isinstance(g["met"], bool) for g in goals.values())
    for line in ("== resident training step", "== read", "== the HBM tier as a cache", "== compile and export", "== tests marked gpu",
                 "== gpu summary", "1 passed, 1 failed, 0 errors, 1 skipped"):
        assert line in out, line


def test_bench_gpu_refuses_a_missing_gpu_and_unknown_parts(tmp_path, capsys):
    if not torch.cuda.is_available():
        assert main(["bench", "gpu", "--dir", str(tmp_path)]) == 2
        assert "--device cuda: torch sees no GPU here; run with --device cpu" in capsys.readouterr().err
    assert main(["bench", "gpu", "--device", "cpu", "--only", "read,nope", "--dir", str(tmp_path)]) == 2
    assert "--only: no part 'nope'; choose from resident, read, cache, compile, tests" in capsys.readouterr().err
    assert main(["bench", "gpu", "--device", "cpu", "--backend", "nope", "--dir", str(tmp_path)]) == 2
    assert "--backend 'nope': torch.compile has no such backend; use inductor" in capsys.readouterr().err


def test_bench_gpu_runs_the_tests_of_its_checkout():
    assert _tests_path(None) == Path(__file__).resolve().parent
    assert _tests_path("none") is None


def test_op_counter_counts_syncs_and_data_dependent_ops():
    x = torch.tensor([3, 0, 3, 1])
    with OpCounter() as c:
        x.nonzero()
        torch.unique(x)
        x.sum().item()
        x + 1
    s = c.summary()
    assert (s["aten_ops"], s["leaf_ops"], s["host_syncs"], s["data_dependent"], s["device_to_host"]) == (5, 5, 1, 2, 0)
    assert s["ops"] == {"aten.nonzero": 1, "aten._unique2": 1, "aten.sum": 1, "aten._local_scalar_dense": 1, "aten.add": 1}
