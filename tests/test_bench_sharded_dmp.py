"""`tierstore bench sharded --dmp` runs end to end at a small size: both sharders step the
same batches under DistributedModelParallel on 2 gloo ranks. The figures go to BENCHMARKS.md."""
from __future__ import annotations

import re
import statistics

import pytest

pytest.importorskip("torchrec", reason="TorchRec (optional peer) is not installed: see the README's TorchRec section")
pytest.importorskip("fbgemm_gpu", reason="FBGEMM (TorchRec's kernels, the baseline) is not installed")


def test_dmp_bench_steps_both_sharders_on_the_same_dists(tmp_path):
    from tierstore.tools import bench_sharded_dmp as dmp
    from tierstore.tools.bench_sharded import WARMUP, ShardedBenchConfig

    cfg = ShardedBenchConfig(tables=(("cold", 4_000, 0.6), ("hot", 200, 1.3)), dim=8, batch=64, pooling=4, steps=2)
    m = dmp.measure(cfg, str(tmp_path), world_sizes=(2,))
    timed = dmp.ROUNDS * (cfg.steps + WARMUP) - WARMUP
    for kind in dmp.KINDS:
        ranks = m[2, kind]
        assert len(ranks) == 2
        assert all(len(r["steps_s"]) == timed and min(r["steps_s"]) > 0 for r in ranks)
    # TorchRec's input dist moves the ids for both: each rank receives the same bytes under either sharder,
    # about its half of the global batch's ids (8 bytes an id) and a length per bag of every rank's samples
    ours, theirs = ([r["ids_bytes"] for r in m[2, kind]] for kind in dmp.KINDS)
    assert ours == theirs
    ids_a_step = cfg.batch * cfg.pooling * len(cfg.tables)
    assert 0 < statistics.mean(ours) < 8 * ids_a_step
    report = dmp.format_report(cfg, m)
    assert re.search(r"^\s+2\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\dx\s", report, re.M), report
