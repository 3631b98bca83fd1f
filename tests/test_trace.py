"""Trace format, recorder, converters and the synthetic generator."""
from __future__ import annotations

import collections
import gzip
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore
from tierstore.tools.cli import main as cli_main
from tierstore.tools.synth import (BUCKET_EDGES, SynthConfig, ZipfSampler, batch_histograms, calibrate, expected_histograms,
                                   histogram_distance, parse_locality_stats, synth)
from tierstore.trace import Trace, TraceTable, from_csv, from_dlrm, gather_ranges

STATS_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "dlrm_datasets"

call_lists = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.lists(st.integers(0, 2**63 - 1), max_size=20)), max_size=30
)


def as_calls(trace: Trace):
    return [(s, t, ids.tolist()) for s, t, ids in trace.calls()]


@given(call_lists, st.sampled_from(["dir", "npz"]))
@settings(max_examples=30)
def test_save_load_round_trip(tmp_path_factory, calls, kind):
    calls = [(i // 2, t, ids) for i, (t, ids) in enumerate(calls)]
    trace = Trace.from_calls(calls, [TraceTable("a", None, 8, 32)])
    path = tmp_path_factory.mktemp("t") / ("trace.npz" if kind == "npz" else "trace")
    back = Trace.load(trace.save(path))
    assert as_calls(back) == calls
    assert back.tables[0] == TraceTable("a", None, 8, 32)
    assert back.complete


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 10)), max_size=20))
def test_gather_ranges_is_concatenated_slices(ranges):
    values = np.arange(100) * 3
    starts = np.array([s for s, _ in ranges], dtype=np.int64)
    lengths = np.array([n for _, n in ranges], dtype=np.int64)
    expect = np.concatenate([values[s : s + n] for s, n in ranges]) if ranges else np.empty(0)
    assert gather_ranges(values, starts, lengths).tolist() == expect.tolist()


def test_invalid_traces_are_rejected_with_the_reason(tmp_path):
    ok = dict(ids=np.array([1, 2, 3]), offsets=np.array([0, 2, 3]), call_table=np.array([0, 0]), call_step=np.array([0, 1]))
    with pytest.raises(ValueError, match="offsets must run from 0"):
        Trace((TraceTable("a"),), **{**ok, "offsets": np.array([0, 2, 4])})
    with pytest.raises(ValueError, match="non-decreasing"):
        Trace((TraceTable("a"),), **{**ok, "call_step": np.array([1, 0])})
    with pytest.raises(IndexError, match="negative id"):
        Trace((TraceTable("a"),), **{**ok, "ids": np.array([1, -2, 3])})
    with pytest.raises(IndexError, match="num_rows=3"):
        Trace((TraceTable("a", num_rows=3),), **ok)
    with pytest.raises(IndexError, match="2 tables|1 tables"):
        Trace((TraceTable("a"),), **{**ok, "call_table": np.array([0, 1])})
    with pytest.raises(TypeError, match="integers"):
        Trace((TraceTable("a"),), **{**ok, "ids": np.array([1.0, 2.0, 3.0])})
    with pytest.raises(FileNotFoundError, match="trace synth"):
        Trace.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trace.json"):
        Trace.load(tmp_path / "empty")
    Trace((TraceTable("a"),), **ok).save(tmp_path / "t")
    meta = json.loads((tmp_path / "t" / "trace.json").read_text())
    (tmp_path / "t" / "trace.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(ValueError, match="v99"):
        Trace.load(tmp_path / "t")


def test_store_records_every_read_call(tmp_path):
    rng = np.random.default_rng(0)
    specs = [tierstore.TableSpec("u", num_rows=1000, dim=4, state_dim=2), tierstore.TableSpec("v", num_rows=None, dim=8)]
    reads = []
    with tierstore.TieredStore(tmp_path / "s", tables=specs, hbm_rows=10, ddr_rows=20, device="cpu",
                               record_trace=tmp_path / "tr") as store:
        for i in range(30):
            table = "u" if rng.random() < 0.6 else "v"
            ids = rng.integers(0, 1000, int(rng.integers(0, 12)))
            store.read(table, torch.from_numpy(ids) if i % 2 else ids, with_state=(i % 3 == 0 and table == "u"))
            store.write(table, ids[:2], np.ones((len(ids[:2]), 4 if table == "u" else 8)))  # writes are not uses
            if len(ids):
                reads.append((table, ids.tolist()))
    trace = Trace.load(tmp_path / "tr")
    assert [(t, ids.tolist()) for _, t, ids in trace.calls()] == reads
    assert {t.name: (t.num_rows, t.dim, t.row_bytes) for t in trace.tables} == {"u": (1000, 4, 24), "v": (None, 8, 32)}
    # a new step starts when a table is read again within the current step
    steps, seen, step = [], set(), 0
    for table, _ in reads:
        if table in seen:
            step, seen = step + 1, set()
        seen.add(table)
        steps.append(step)
    assert trace.call_step.tolist() == steps


def test_recorder_refuses_a_used_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "something").write_text("hi")
    with pytest.raises(ValueError, match="not an empty directory"):
        tierstore.TieredStore(tmp_path / "s", tables=[tierstore.TableSpec("a", 10, 2)], device="cpu", record_trace=tmp_path / "x")
    # the store did not stay open: the LMDB lock is free again
    tierstore.TieredStore(tmp_path / "s", device="cpu").close()


def test_a_killed_recorder_leaves_a_trace_up_to_its_last_sync(tmp_path):
    """A real process records 10 calls, syncing every 4, then dies without closing."""
    script = textwrap.dedent(f"""
        import os, numpy as np
        from tierstore.trace import TraceRecorder, TraceTable
        rec = TraceRecorder({str(tmp_path / 'tr')!r}, [TraceTable('a', None, 2, 8)], sync_every=4)
        for i in range(10):
            rec.record('a', np.arange(i + 1))
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    trace = Trace.load(tmp_path / "tr")
    assert not trace.complete
    assert [ids.tolist() for _, _, ids in trace.calls()] == [list(range(i + 1)) for i in range(8)]


def test_csv_converter(tmp_path):
    rows = [(0, "user", 5), (0, "user", 7), (0, "item", 1), (1, "user", 5), (1, "item", 2), (1, "item", 2), (2, "item", 9)]
    f = tmp_path / "t.csv"
    f.write_text("id,step,table,extra\n" + "".join(f"{i},{s},{t},x\n" for s, t, i in rows))
    trace = from_csv(f, dim=16)
    assert as_calls(trace) == [(0, "user", [5, 7]), (0, "item", [1]), (1, "user", [5]), (1, "item", [2, 2]), (2, "item", [9])]
    assert trace.tables[0] == TraceTable("user", None, 16, 64)
    (tmp_path / "bad.csv").write_text("step,table\n0,a\n")
    with pytest.raises(ValueError, match="missing \\['id'\\]"):
        from_csv(tmp_path / "bad.csv")


@pytest.mark.parametrize("gz", [False, True])
def test_dlrm_converter(tmp_path, gz):
    rng = np.random.default_rng(1)
    T, B = 3, 8
    lengths = torch.from_numpy(rng.integers(0, 4, (T, B)))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.reshape(-1), 0)])
    indices = torch.from_numpy(rng.integers(0, 100, int(offsets[-1])))
    f = tmp_path / ("b.pt.gz" if gz else "b.pt")
    if gz:
        with gzip.open(f, "wb") as fh:
            torch.save((indices, offsets, lengths), fh)
    else:
        torch.save((indices, offsets, lengths), f)
    trace = from_dlrm([f, f], batch_size=5)
    expect = []
    for step, (s0, s1) in enumerate([(0, 5), (5, 8), (0, 5), (5, 8)]):
        for t in range(T):
            expect.append((step, f"t{t}", indices[offsets[t * B + s0] : offsets[t * B + s1]].tolist()))
    assert as_calls(trace) == expect
    assert cli_main(["trace", "convert", str(f), "-o", str(tmp_path / "out.npz")]) == 0
    assert Trace.load(tmp_path / "out.npz").n_calls == T


def test_trace_cli_synth_info(tmp_path, capsys):
    out = tmp_path / "syn"
    assert cli_main(["trace", "synth", str(out), "--table", "a:5000:1.1:2", "--table", "b:300", "--batch-size", "16",
                     "--steps", "5", "--seed", "3"]) == 0
    assert "1,440 accesses" in capsys.readouterr().out
    trace = Trace.load(out)
    assert np.diff(trace.offsets).tolist() == [32, 256] * 5
    assert cli_main(["trace", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [t["accesses"] for t in info["tables"]] == [160, 1280]
    assert cli_main(["trace", "synth", str(out), "--table", "a"]) == 2
    assert "NAME:ROWS" in capsys.readouterr().err


# -- the synthetic generator -------------------------------------------------------------------------------
@pytest.mark.parametrize("n,alpha", [(1, 1.0), (7, 0.5), (40, 1.0), (40, 1.3), (1000, 0.9)])
def test_zipf_sampler_matches_the_pmf(n, alpha):
    ranks = ZipfSampler(n, alpha).sample(np.random.default_rng(0), 400_000)
    assert ranks.min() >= 1 and ranks.max() <= n
    p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    emp = np.bincount(ranks, minlength=n + 1)[1:] / len(ranks)
    # within 5 standard errors everywhere
    assert np.all(np.abs(emp - p) <= 5 * np.sqrt(p * (1 - p) / len(ranks)) + 1e-9)


def test_synth_is_deterministic_and_drift_moves_popularity():
    cfg = SynthConfig(tables=(("a", 10_000),), alpha=1.2, batch_size=256, pooling=4, steps=20, drift=500, seed=5)
    t1, t2 = synth(cfg), synth(cfg)
    assert np.array_equal(t1.ids, t2.ids)
    assert t1.ids.max() < 10_000 and t1.ids.min() >= 0
    top = lambda ids: collections.Counter(ids.tolist()).most_common(1)[0][0]  # noqa: E731
    calls = [ids for _, _, ids in t1.calls()]
    assert top(calls[0]) != top(calls[-1])  # the hottest row moved
    still = synth(SynthConfig(tables=(("a", 10_000),), alpha=1.2, batch_size=256, pooling=4, steps=20, seed=5))
    calls = [ids for _, _, ids in still.calls()]
    assert top(calls[0]) == top(calls[-1])
    with pytest.raises(ValueError, match="alpha"):
        SynthConfig(alpha=0)


def test_batch_histograms_bucket_like_the_dlrm_report():
    ids = np.array([1] + [2] * 2 + [3] * 3 + [4] * 40000)
    rows, idx = batch_histograms(ids)
    counts = collections.Counter(ids.tolist()).values()
    expect_rows = np.zeros(len(BUCKET_EDGES))
    expect_idx = np.zeros(len(BUCKET_EDGES))
    for c in counts:
        b = next((i for i in range(len(BUCKET_EDGES) - 1) if BUCKET_EDGES[i] < c <= BUCKET_EDGES[i + 1]), len(BUCKET_EDGES) - 1)
        expect_rows[b] += 1
        expect_idx[b] += c
    assert np.allclose(rows, expect_rows / expect_rows.sum()) and np.allclose(idx, expect_idx / expect_idx.sum())
    assert histogram_distance(rows, rows) == 0 and histogram_distance([1, 0], [0, 1]) == 1


@pytest.mark.parametrize("n,alpha,m", [(100_000, 0.9, 1_000_000), (10_000_000, 1.1, 200_000), (3000, 0.5, 300_000)])
def test_expected_histograms_match_sampled_batches(n, alpha, m):
    rows, ids = expected_histograms(n, alpha, m)
    sampled = ZipfSampler(n, alpha).sample(np.random.default_rng(1), m)
    rh, ih = batch_histograms(sampled)
    assert rows.sum() == pytest.approx(len(np.unique(sampled)), rel=0.01)
    assert ids.sum() == pytest.approx(m, rel=1e-3)
    assert histogram_distance(rows / rows.sum(), rh) < 0.02  # 3000 rows: sampling noise alone is ~0.01
    assert histogram_distance(ids / ids.sum(), ih) < 0.05


@pytest.mark.skipif(not STATS_DIR.exists(), reason="dlrm_datasets stats not present")
def test_calibration_fits_the_published_histograms():
    sections = parse_locality_stats(STATS_DIR / "2021_locality_stats.txt")
    assert len(sections) == 17 and sections[0].tables == 856 and sections[0].batch_size == 65536
    assert sections[0].rows_hist.sum() == pytest.approx(1, abs=0.01)
    target = sections[0]
    one = calibrate(target, 1, quick=True)
    two = calibrate(target, 2, quick=True)
    # the figures are measured on generated batches; the model agrees with them
    assert abs(two.rows_tv - two.model_tv[0]) < 0.02
    assert two.rows_tv + two.index_tv < one.rows_tv + one.index_tv
    assert two.rows_tv < 0.05 and two.index_tv < 0.1
    assert sum(w for _, _, w in two.classes) == pytest.approx(1)
    assert "--table c0:" in two.synth_args()
