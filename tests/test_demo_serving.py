"""The demo's serving step and its trace, run as real processes."""
import re
import subprocess
import sys

import pytest
import torch

import tierstore
from tierstore.trace import Trace
from tierstore.capacity.trace_streams import trace_counts

from test_demo import TINY, demo


def test_the_demo_serves_its_held_out_batches_from_int8_and_float32_exports(tmp_path):
    d = tmp_path / "demo"
    r = demo("--dir", str(d), *TINY, "--no-progress")
    assert r.returncode == 0, r.stderr
    held_out = float(re.search(r"held-out ([\d.]+)", r.stdout).group(1))
    m = re.search(r"serving    int8 .*held-out loss ([\d.]+), accuracy ([\d.]+)% against float32 serving ([\d.]+), ([\d.]+)% "
                  r"\(equals training's held-out\); ([\d,]+) rows stored", r.stdout)
    assert m, r.stdout
    q_loss, f_loss = float(m.group(1)), float(m.group(3))
    assert f_loss == held_out  # float32 serving pools the trained rows: the trained model's loss, to the digits printed
    assert abs(q_loss - f_loss) < 0.01  # int8 row-wise: each weight within half a step of its row's range / 255
    # the stores it names are there and hold the trained rows, quantized
    with tierstore.TieredStore(d / "store", readonly=True) as trained, \
            tierstore.ServingStore(d / "serving-int8") as int8, tierstore.ServingStore(d / "serving-float32") as f32:
        assert int8.dtype("cat0") == "int8" and f32.dtype("cat0") == "float32"
        ids = torch.arange(3000)
        weights = trained.read("cat0", ids)
        assert torch.equal(f32.rows("cat0", ids), weights)
        assert torch.allclose(int8.rows("cat0", ids), weights, atol=float((weights.amax(1) - weights.amin(1)).max()) / 255)
        stored = sum(t["rows"] for t in int8.meta["tables"])
    assert f"{stored:,} rows stored" in r.stdout


def test_the_demo_records_a_trace_that_capacity_reads_and_no_serve_skips_serving(tmp_path):
    d, tr = tmp_path / "demo", tmp_path / "trace"
    r = demo("--dir", str(d), *TINY, "--no-progress", "--no-serve", "--record-trace", str(tr))
    assert r.returncode == 0, r.stderr
    assert "serving" not in r.stdout and not (d / "serving-int8").exists()  # --no-serve
    trace = Trace.load(tr)
    served = int(re.search(r"of ([\d,]+) row lookups", r.stdout).group(1).replace(",", ""))
    uses, _ = trace_counts(trace, trace.table_names)  # ids per call, repeats within a call merged, as the tiers count
    assert trace.complete and sum(uses) == served  # every lookup the tiers counted, and only those
    assert trace.n_steps == 12 + 4  # the training steps, then the held-out batches
    assert sorted(t.name for t in trace.tables) == ["cat0", "cat1", "cat2"]
    assert f"{trace.n_accesses:,} ids looked up in 16 steps" in r.stdout and f"tierstore capacity {tr}" in r.stdout
    cap = subprocess.run([sys.executable, "-m", "tierstore.tools.cli", "capacity", str(tr), "--hbm-hit", "0.5"],
                         capture_output=True, text=True, timeout=240)
    assert cap.returncode == 0, cap.stderr
    assert f"trace: {trace.n_accesses:,} accesses" in cap.stdout
    # a trace left from another run is not overwritten: the demo refuses before it trains
    again = demo("--dir", str(tmp_path / "demo2"), *TINY, "--record-trace", str(tr))
    assert again.returncode == 2 and f"--record-trace {tr} exists" in again.stderr
    assert not (tmp_path / "demo2" / "store").exists()


def test_a_rerun_records_its_trace_inside_its_own_directory_again(tmp_path):
    d = tmp_path / "demo"
    for _ in range(2):
        r = demo("--dir", str(d), *TINY, "--no-progress", "--no-serve", "--record-trace", str(d / "trace"))
        assert r.returncode == 0, r.stderr
    assert Trace.load(d / "trace").n_steps == 16


def test_record_trace_is_for_one_process():
    from tierstore.tools.demo import DemoConfig

    with pytest.raises(ValueError, match="--record-trace records one process's store"):
        DemoConfig(world_size=2, batch=32, record_trace="t")
