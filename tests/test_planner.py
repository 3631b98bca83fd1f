"""The sharding planner against independent oracles: every rank's SSD reads
replayed through the capacity simulator and through real TieredStores holding
only that rank's shards, a round-robin placement, and the plan's own checks."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import tierstore
from tierstore.capacity.planner import plan, predict
from tierstore.training.sharding import PlanMismatchError, Shard, ShardingPlan, TablePlan, row_hash
from tierstore.tools import capacity as cap
from tierstore.tools.cli import main
from tierstore.tools.synth import SynthConfig, SynthTable, synth
from tierstore.trace import Trace, TraceTable

DIM = 16


@pytest.fixture(scope="module")
def trace() -> Trace:
    """One small hot table, one large cold one, three ordinary ones."""
    return synth(SynthConfig(tables=(SynthTable("hot", 2_000, 1.2, 20.0), SynthTable("cold", 200_000, 0.6, 4.0),
                                     SynthTable("a", 5_000), SynthTable("b", 7_000), SynthTable("c", 3_000)),
                             batch_size=64, pooling=4, steps=40, dim=DIM, seed=3))


def specs_of(trace: Trace) -> list[tierstore.TableSpec]:
    return [tierstore.TableSpec(t.name, t.num_rows, DIM) for t in trace.tables]


def owned_ids(tp: TablePlan, shard: Shard, ids: np.ndarray) -> np.ndarray:
    """The ids a shard holds, by the definitions in tierstore.training.sharding (not TablePlan.owner)."""
    if tp.sharding == "row" and shard.row_start is None:
        return ids[row_hash(torch.from_numpy(ids)).numpy() % len(tp.shards) == tp.shards.index(shard)]
    if shard.row_start is not None:
        return ids[(ids >= shard.row_start) & (ids < shard.row_stop)]
    return ids


def rank_trace(trace: Trace, p: ShardingPlan, rank: int) -> Trace:
    """What rank ``rank``'s store reads: each call's ids that its shards own, sorted and
    unique, twice (the sharded module's forward fetch and backward update)."""
    calls = []
    for step, table, ids in trace.calls():  # a test oracle: a loop per call
        for s in p.tables[table].shards:
            if s.rank == rank:
                calls += [(step, table, np.unique(owned_ids(p.tables[table], s, ids)))] * 2
    return Trace.from_calls(calls, [t for t in trace.tables if rank in p.ranks_of(t.name)])


def max_over_mean(predicted, key) -> float:
    v = np.array([r[key] for r in predicted], dtype=np.float64)
    return float(v.max() / v.mean())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("with_trace", [False, True])
def test_the_plan_covers_every_table_exactly_once(trace, world_size, with_trace):
    specs = specs_of(trace) + [tierstore.TableSpec("unbounded", None, 8), tierstore.TableSpec("tiny", 2, 3),
                               tierstore.TableSpec("narrow", 100, 2)]
    p = plan(specs, world_size, trace=trace if with_trace else None, hbm_bytes=20_000, ddr_bytes=80_000,
             sharding={"narrow": "column"})
    p.check(specs)
    assert set(p.tables) == {s.name for s in specs} and len(p.predicted) == world_size
    for tp in p.tables.values():
        assert len(set(tp.ranks)) == len(tp.ranks), f"{tp.table}: two shards on one rank"
    assert p.tables["unbounded"].sharding == ("row" if world_size > 1 else "table")
    assert len(p.tables["tiny"].shards) <= 2 and len(p.tables["narrow"].shards) == min(world_size, 2)
    # every id of the trace has exactly one owner among a row table's shards
    for name in trace.table_names:
        tp = p.tables[name]
        if tp.sharding == "row":
            ids = trace.table_calls(trace.table_index(name))[0]
            assert sum(len(owned_ids(tp, s, ids)) for s in tp.shards) == len(ids)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_hot_small_table_and_a_cold_large_one_are_balanced_better_than_round_robin(trace, world_size):
    specs = specs_of(trace)
    budget = dict(hbm_bytes=20_000, ddr_bytes=100_000)
    p = plan(specs, world_size, trace=trace, **budget)
    rr = ShardingPlan(world_size, {s.name: TablePlan(s.name, "table", (Shard(i % world_size, None, None, 0, DIM),))
                                   for i, s in enumerate(specs)})
    naive = predict(rr, specs, trace=trace, **budget)
    for key in ("lookups_per_step", "ssd_reads_per_step", "bytes"):
        assert max_over_mean(p.predicted, key) < 1.25, (key, p)
        assert max_over_mean(p.predicted, key) < max_over_mean(naive, key), (key, p, naive)
    # the planner's prediction of its own plan is predict()'s
    assert p.predicted == predict(p, specs, trace=trace, **budget)


def test_from_sizes_alone_bytes_are_balanced(trace):
    specs = [tierstore.TableSpec(f"t{i}", rows, 32, state_dim=1) for i, rows in enumerate([10**6, 10**5, 9 * 10**4, 5 * 10**4, 4 * 10**4, 3 * 10**4])]
    p = plan(specs, 3)
    assert p.tables["t0"].sharding == "row"  # over a third of the bytes alone
    assert all(p.tables[f"t{i}"].sharding == "table" for i in range(1, 6))
    assert max_over_mean(p.predicted, "bytes") < 1.1
    assert sum(r["bytes"] for r in p.predicted) == sum(s.num_rows * s.row_bytes for s in specs)
    assert "lookups_per_step" not in p.predicted[0]
    # an optimizer's state counts in a row's bytes
    q = plan(specs, 3, optimizer=tierstore.optim.Adam(lr=0.1))
    assert sum(r["bytes"] for r in q.predicted) == sum(s.num_rows * 4 * (32 + 2 * 32 + 1) for s in specs)


def test_predicted_ssd_reads_equal_the_simulator_and_real_stores_per_rank(trace, tmp_path):
    specs = specs_of(trace)
    p = plan(specs, 3, trace=trace, hbm_bytes=6_000, ddr_bytes=30_000, sharding={"hot": "column"})
    steps = trace.n_steps
    assert {tp.sharding for tp in p.tables.values()} == {"row", "column", "table"}
    for rank in range(3):
        pred, sub = p.predicted[rank], rank_trace(trace, p, rank)
        tiers = {name: tuple(t) for name, t in pred["tiers"].items()}
        assert set(tiers) == set(sub.table_names)
        streams = cap.build_streams(sub)
        sim = {s.name: cap.simulate(s, *tiers[s.name], policy="lru") for s in streams}
        misses = sum(s.n_uses - sim[s.name].hbm_hits - sim[s.name].ddr_hits for s in streams)
        assert pred["ssd_reads_per_step"] == pytest.approx(misses / steps, rel=1e-12)
        assert pred["lookups_per_step"] == pytest.approx(sum(s.n_uses for s in streams) / 2 / steps, rel=1e-12)
        shard_dim = {name: next(s.dim for s in p.tables[name].shards if s.rank == rank) for name in tiers}
        shard_specs = [tierstore.TableSpec(name, trace.tables[trace.table_index(name)].num_rows, shard_dim[name]) for name in tiers]
        # the module's pattern: read, read again and write back the update; writes committed at once
        # (writeback_rows=0), since the write-back queue would serve some re-reads of written rows
        with tierstore.TieredStore(tmp_path / f"rank-{rank}", tables=shard_specs, policy="lru", device="cpu",
                                   hbm_rows={n: h for n, (h, _) in tiers.items()},
                                   ddr_rows={n: d for n, (_, d) in tiers.items()}, writeback_rows=0) as store:
            for i, (_, table, ids) in enumerate(sub.calls()):  # calls come in pairs
                rows = store.read(table, ids)
                if i % 2:
                    store.write(table, ids, rows + 1)
            assert store.stats()["ssd"]["reads"] == misses


def test_json_round_trip_and_determinism(trace):
    specs = specs_of(trace)
    a = plan(specs, 4, trace=trace, hbm_bytes=20_000, ddr_bytes=100_000, batch_size=64)
    b = plan(specs, 4, trace=trace, hbm_bytes=20_000, ddr_bytes=100_000, batch_size=64)
    assert a == b and a.to_json() == b.to_json()
    back = ShardingPlan.from_json(a.to_json())
    assert back == a and back.predicted == a.predicted and back.to_json() == a.to_json()
    assert "predicted per rank" in str(a) and "ssd_reads_per_step" in str(a)


def test_forced_types_are_honoured(trace):
    specs = specs_of(trace)
    forced = {"cold": "table", "hot": "row", "a": "column"}
    p = plan(specs, 4, trace=trace, sharding=forced)
    assert {name: p.tables[name].sharding for name in forced} == forced
    assert len(p.tables["hot"].shards) == 4 and len(p.tables["a"].shards) == 4
    assert [s.dim for s in p.tables["a"].shards] == [4, 4, 4, 4]


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(world_size=0), ValueError, "world_size must be an int >= 1"),
    (dict(world_size=-2), ValueError, "world_size must be an int >= 1"),
    (dict(world_size=True), ValueError, "world_size must be an int >= 1"),
    (dict(world_size=2, sharding={"nope": "row"}), KeyError, "'nope'"),
    (dict(world_size=2, sharding={"a": "rows"}), ValueError, "sharding types must be one of"),
    (dict(world_size=2, hbm_bytes=10, ddr_bytes=10), ValueError, "cannot hold one row"),
    (dict(world_size=2, hbm_bytes=-1), ValueError, "hbm_bytes must be an int >= 0"),
    (dict(world_size=2, batch_size=0), ValueError, "batch_size must be an int >= 1"),
    (dict(world_size=2, trace="trace.npz"), TypeError, "Trace.load"),
])
def test_bad_input_is_named(kwargs, error, words):
    specs = [tierstore.TableSpec("a", 100, 8), tierstore.TableSpec("b", 100, 8)]
    with pytest.raises(error, match=words.replace("(", r"\(")):
        plan(specs, **kwargs)


def test_bad_tables_are_named():
    with pytest.raises(ValueError, match="duplicate table names"):
        plan([tierstore.TableSpec("a", 10, 4)] * 2, 2)
    with pytest.raises(TypeError, match="list of tierstore.TableSpec"):
        plan([("a", 10, 4)], 2)
    with pytest.raises(PlanMismatchError, match="tables without a plan"):
        predict(plan([tierstore.TableSpec("a", 10, 4)], 2), [tierstore.TableSpec("b", 10, 4)])


# -- tierstore plan ------------------------------------------------------------------------------------------
CLI = [sys.executable, "-W", "error", "-m", "tierstore.tools.cli"]


def test_the_cli_prints_the_plan_and_its_json_is_the_planners(tmp_path, capsys):
    trace = synth(SynthConfig(tables=(SynthTable("hot", 2000, 1.2, 20.0), SynthTable("cold", 200_000, 0.6, 4.0), SynthTable("a", 5000)),
                              batch_size=32, pooling=4, steps=10, dim=16))
    trace.save(tmp_path / "t.npz")
    argv = ["plan", str(tmp_path / "t.npz"), "--world-size", "3", "--hbm-bytes", "8k", "--ddr-bytes", "32KiB", "--sharding", "a=column"]
    out = subprocess.run([*CLI, *argv, "--json"], check=True, capture_output=True, text=True, timeout=120).stdout
    specs = [tierstore.TableSpec(t.name, t.num_rows, 16) for t in trace.tables]
    expect = plan(specs, 3, trace=trace, hbm_bytes=8000, ddr_bytes=32768, sharding={"a": "column"})
    got = ShardingPlan.from_json(out)
    assert got == expect and got.predicted == expect.predicted
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert str(expect) in text and "predicted per rank" in text


def test_predicted_exchange_and_lookups_equal_what_the_sharded_module_does(tmp_path):
    """2 gloo ranks train through ShardedEmbeddingBagCollection: the bytes each sends (counted at
    torch.distributed) and its store's unique rows a step are the plan's, exactly."""
    from tierstore.tools.bench_sharded import KINDS, WARMUP, ShardedBenchConfig, measure

    cfg = ShardedBenchConfig(tables=(("cold", 50_000, 0.6), ("hot", 500, 1.3), ("mid", 4_000, 1.0)), dim=8, batch=64,
                             pooling=4, steps=3, hbm_bytes=4096, ddr_bytes=16384)
    run = measure(cfg, str(tmp_path), world_sizes=(2,))["runs"][2]
    steps = WARMUP + cfg.steps
    for got, pred in zip(run["ranks"], run["plan"].predicted):
        assert got["counts"]["sent"] / steps == pytest.approx(pred["exchange_bytes_per_step"], rel=1e-12)
        assert got["counts"]["lookups"] / steps == pytest.approx(pred["lookups_per_step"], rel=1e-12)
        # the write-back queue serves some re-reads of written rows: at most the plan's SSD reads
        assert 0 < got["counts"]["ssd_reads"] / steps <= pred["ssd_reads_per_step"] + 1e-9
    assert run["ranks"][0]["counts"]["sent"] > 0
    # what the module counts as received, by kind, is what torch.distributed was handed to send
    assert sum(r["counts"][k] for r in run["ranks"] for k in KINDS) == sum(r["counts"]["sent"] for r in run["ranks"])


@pytest.mark.parametrize("argv, expect", [
    (["--world-size", "0"], "argument --world-size: must be an integer >= 1, got 0"),
    (["--world-size", "2", "--sharding", "hot"], "--sharding 'hot': expected TABLE=TYPE"),
    (["--world-size", "2", "--sharding", "nope=row"], "sharding names tables ['nope'] that are not planned"),
    (["--world-size", "2", "--sharding", "hot=diagonal"], "sharding types must be one of ('table', 'row', 'column')"),
    (["--world-size", "2", "--hbm-bytes", "12", "--optimizer", "adam"], "cannot hold one row"),
    (["--world-size", "2", "--hbm-bytes", "lots"], "argument --hbm-bytes: must be a size, got 'lots'; write a number of bytes"),
])
def test_cli_mistakes_are_one_line(tmp_path, capsys, argv, expect):
    Trace.from_calls([(0, "hot", [1, 2]), (0, "cold", [3])], [TraceTable("hot", 10, 4), TraceTable("cold", 10, 4)]).save(tmp_path / "t")
    try:
        code = main(["plan", str(tmp_path / "t"), *argv])
    except SystemExit as e:  # argparse's own
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(("tierstore: error: ", "tierstore plan: error: ")) and expect in err, err


def test_run_ranks_returns_by_rank_and_names_a_failing_rank():
    import math

    from tierstore.tools.bench_sharded import run_ranks

    assert run_ranks(pow, 2) == [0, 1]  # rank ** world_size
    with pytest.raises(RuntimeError, match=r"rank 0 of 2 failed:(.|\n)*ValueError: math domain error"):
        run_ranks(math.log, 2)  # log(0, 2) on rank 0
