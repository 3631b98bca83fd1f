"""`tierstore bench serve` runs end to end at a small size: its client processes, both phases,
and the delta application. The figures themselves go to BENCHMARKS.md."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow  # ~50 s: spawns client processes, exports three stores
def test_bench_serve_reports_clients_phases_and_delta_apply(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tierstore.tools.cli", "bench", "serve", "--rows", "2000", "--repeat", "2",
                           "--clients", "2", "--seconds", "0.5", "--delta-rows", "20000", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "2 client processes" in out
    assert re.search(r"idle +p50 .*\n +deltas +p50 ", out)
    versions = re.search(r"p99 while deltas .* against idle: [\d.]+x .* versions served at the end \[(\d+), (\d+)\]", out)
    assert int(versions.group(1)) > 0 and int(versions.group(2)) > 0  # each client applied deltas while it looked up
    assert re.search(r"a delta of 1% of an int8 table of 20,000 x 64 \(200 rows.*\n.*median [\d.]+ s", out)
    assert list(tmp_path.iterdir()) == []  # the bench's stores are removed
