"""Public API, bad input and its errors, reopen, threads."""
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import tierstore
from tierstore import RowInit, TableSpec, TieredStore


@pytest.fixture
def store(tmp_path):
    s = TieredStore(tmp_path / "s", [TableSpec("user", 100, 4), TableSpec("item", None, 2, init=RowInit.normal(0, 1, seed=1))],
                    hbm_rows=3, ddr_rows={"user": 5, "item": 2}, device="cpu")
    yield s
    s.close()


def test_accepts_tensors_arrays_and_lists(store):
    a = store.read("user", [1, 2, 3])
    assert torch.equal(a, store.read("user", np.array([1, 2, 3], dtype=np.uint32)))
    assert torch.equal(a, store.read("user", torch.tensor([1, 2, 3], dtype=torch.int16)))
    assert store.read("user", []).shape == (0, 4)
    assert a.dtype == torch.float32 and a.device == store.device


def test_unbounded_ids_and_deterministic_init(store, tmp_path):
    big = [2**62, 5, 2**63 - 1]
    first = store.read("item", big)
    assert first.shape == (3, 2) and first.abs().sum() > 0
    # initial values depend only on table, id and seed: not on tiers or order
    with TieredStore(tmp_path / "other", [TableSpec("item", None, 2, init=RowInit.normal(0, 1, seed=1))], device="cpu") as other:
        assert torch.equal(other.read("item", big[::-1]), first.flip(0))
    with TieredStore(tmp_path / "seed2", [TableSpec("item", None, 2, init=RowInit.normal(0, 1, seed=2))], device="cpu") as other:
        assert not torch.equal(other.read("item", big), first)


def test_init_distributions_have_their_moments(tmp_path):
    ids = np.arange(20000)
    from tierstore.spec import initial_rows
    u = initial_rows(TableSpec("u", None, 8, init=RowInit.uniform(-2, 2, seed=3)), ids)[:, :8]
    n = initial_rows(TableSpec("n", None, 8, init=RowInit.normal(1, 3, seed=3)), ids)[:, :8]
    assert u.min() >= -2 and u.max() < 2 and abs(u.mean()) < 0.05
    assert abs(n.mean() - 1) < 0.05 and abs(n.std() - 3) < 0.05


@pytest.mark.parametrize("init, dtype, state_dim, digest", [
    (RowInit.normal(0.5, 2.0, seed=11), "float32", 1, "4b4b2025b4c26298"),
    (RowInit.uniform(-0.1, 0.3, seed=2), "bfloat16", 2, "1ece316393c035a1"),
    (RowInit(kind="normal", a=0.0, b=1.0, col_start=4), "float16", 0, "81b90514a814bc04"),
])
def test_initial_rows_keep_their_values(init, dtype, state_dim, digest):
    """A never-written row is never stored: a store reads it as initial_rows gives it, so
    these bytes are part of every existing store and must not change with the code."""
    import hashlib
    from tierstore.spec import initial_rows
    ids = np.array([0, 1, 7, 123456789, 2**62 + 5, -1], dtype=np.int64)
    rows = initial_rows(TableSpec("golden", None, 5, dtype=dtype, init=init, state_dim=state_dim), ids)
    assert hashlib.sha256(rows.tobytes()).hexdigest()[:16] == digest


def test_last_write_wins_and_write_keeps_state(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 10, 2, state_dim=2)], hbm_rows=2, device="cpu") as s:
        s.write("t", [1, 1, 2], torch.tensor([[1.0, 1], [9, 9], [2, 2]]))
        assert s.read("t", [1, 2]).tolist() == [[9, 9], [2, 2]]
        s.write("t", [3, 4], torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]]), with_state=True)
        s.write("t", [3, 4], torch.tensor([[0.0, 0], [1, 1]]))  # weights only: state kept
        assert s.read("t", [3, 4], with_state=True).tolist() == [[0, 0, 3, 4], [1, 1, 7, 8]]


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda s: s.read("user", [1, 100]), IndexError, ["100", "user", "num_rows=100"]),
        (lambda s: s.read("user", [-1]), IndexError, ["-1", "user"]),
        (lambda s: s.read("item", np.array([2**63], dtype=np.uint64)), IndexError, ["item"]),
        (lambda s: s.read("nope", [1]), KeyError, ["nope", "item", "user"]),
        (lambda s: s.read("user", [[1, 2]]), ValueError, ["1-D"]),
        (lambda s: s.read("user", [1.5]), TypeError, ["integers"]),
        (lambda s: s.read("user", torch.tensor([True])), TypeError, ["integers"]),
        (lambda s: s.write("user", [1, 2], torch.zeros(2, 3)), ValueError, ["shape", "(2, 4)"]),
        (lambda s: s.write("user", [1, 200], torch.zeros(2, 4)), IndexError, ["200"]),
        (lambda s: s.write("user", [1], [["a", "b", "c", "d"]]), TypeError, ["floating"]),
        (lambda s: s.read("user", [1], out=torch.empty(2, 4)), ValueError, ["out"]),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(store, call, exc, words):
    store.write("user", [1, 2], torch.ones(2, 4))
    store.read("user", [1, 2, 3])
    before_stats = store.stats()
    before = store.cached_ids("user")
    with pytest.raises(exc) as info:
        call(store)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert store.stats() == before_stats
    after = store.cached_ids("user")
    assert after.keys() == before.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert store.read("user", [1, 2]).tolist() == [[1.0] * 4] * 2


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(hbm_rows=-1), ["hbm_rows", ">= 0"]),
        (dict(ddr_rows={"user": 1.5}), ["ddr_rows", "user"]),
        (dict(policy="fifo"), ["fifo", "lfu", "lru"]),
        (dict(tables=[TableSpec("user", 100, 8)]), ["user", "dim=8", "dim=4"]),
        (dict(tables=[TableSpec("user", 50, 4)]), ["num_rows"]),
    ],
)
def test_bad_config_and_contradicting_specs(tmp_path, kwargs, words):
    TieredStore(tmp_path, [TableSpec("user", 100, 4)], device="cpu").close()
    with pytest.raises(ValueError) as info:
        TieredStore(tmp_path, device="cpu", **kwargs)
    for w in words:
        assert w in str(info.value)


def test_spec_validation():
    with pytest.raises(ValueError, match="dim"):
        TableSpec("t", 10, 0)
    with pytest.raises(ValueError, match="num_rows"):
        TableSpec("t", -5, 4)
    with pytest.raises(ValueError, match="float32"):
        TableSpec("t", 10, 4, dtype="int8")
    with pytest.raises(ValueError, match="a < b"):
        RowInit.uniform(1, 0)


def test_new_store_needs_tables(tmp_path):
    with pytest.raises(FileNotFoundError, match="TableSpec"):
        TieredStore(tmp_path / "empty", device="cpu")


def test_reopen_keeps_specs_and_rows_and_adds_tables(tmp_path):
    with TieredStore(tmp_path, [TableSpec("a", 10, 3, init=RowInit.uniform(0, 1, seed=4))], ddr_rows=4, device="cpu") as s:
        s.write("a", [0, 9], torch.full((2, 3), 7.0))
        init5 = s.read("a", [5])
    with TieredStore(tmp_path, [TableSpec("b", None, 2)], device="cpu") as s:
        assert set(s.tables) == {"a", "b"}
        assert s.tables["a"].init == RowInit.uniform(0, 1, seed=4)
        assert s.read("a", [0, 9]).tolist() == [[7.0] * 3] * 2
        assert torch.equal(s.read("a", [5]), init5)


def test_call_larger_than_every_tier_returns_correct_rows(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 1000, 2)], hbm_rows=3, ddr_rows=4, device="cpu") as s:
        ids = torch.arange(0, 1000, 7)
        s.write("t", ids, torch.stack([ids, -ids], 1).float())
        for _ in range(2):
            got = s.read("t", torch.cat([ids, ids.flip(0)]))
            assert torch.equal(got[:, 0], torch.cat([ids, ids.flip(0)]).float())
        assert s.resident_rows("t") == {"hbm": 3, "ddr": 4}
        # recency follows first position: HBM keeps the ids first seen last
        assert s.cached_ids("t")["hbm"].tolist() == sorted(ids[-3:].tolist())


def test_rows_read_from_lmdb_are_not_overwritten_by_later_reads(tmp_path):
    # cold reads go through a buffer the store reuses; what a read returned must not change
    values = torch.randn(6000, 3)
    with TieredStore(tmp_path, [TableSpec("t", 6000, 3)], ddr_rows=0, device="cpu") as s:
        s.write("t", torch.arange(6000), values)
    with TieredStore(tmp_path, ddr_rows=2500, device="cpu") as s:
        first = s.read("t", torch.arange(2500))
        second = s.read("t", torch.arange(2500, 5000))
        third = s.read("t", torch.arange(5000, 6000))
        assert torch.equal(first, values[:2500]) and torch.equal(second, values[2500:5000])
        assert torch.equal(third, values[5000:])


def test_lmdb_reads_span_chunks_with_absent_rows(tmp_path):
    # get_rows copies rows out a chunk at a time; rows never written are absent from LMDB
    written = np.arange(0, 7000, 3)
    with TieredStore(tmp_path, [TableSpec("t", 7000, 2, init=RowInit.uniform(-1, 1, seed=4))], device="cpu") as s:
        s.write("t", written, np.stack([written, -written], 1).astype(np.float32))
        s.flush()
        stored = s.stored_rows("t", np.arange(7000))
        assert stored.found.tolist() == [i % 3 == 0 for i in range(7000)]
        assert stored.rows[stored.found].tolist() == np.stack([written, -written], 1).tolist()
    with TieredStore(tmp_path, ddr_rows=100, device="cpu") as s:
        got = s.read("t", torch.arange(7000))
        from tierstore.spec import initial_rows
        expected = initial_rows(s.tables["t"], np.arange(7000))[:, :2]
        expected[written] = np.stack([written, -written], 1)
        assert torch.equal(got, torch.from_numpy(expected))


def test_clean_rows_are_never_written(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 1000, 4)], hbm_rows=2, ddr_rows=3, device="cpu") as s:
        for i in range(50):
            s.read("t", [i, i + 1, i + 2])
        s.flush()
        assert s.stats()["ssd"]["writes"] == 0
        assert s.stats()["rows"]["stored"] == 0 and s.stored_ids("t").tolist() == []


def test_dirty_rows_are_written_back_on_eviction(tmp_path, monkeypatch):
    with TieredStore(tmp_path, [TableSpec("t", 100, 2)], hbm_rows=1, ddr_rows=1, device="cpu") as s:
        gate = threading.Event()
        real = s._backend.put_rows  # latency injection: LMDB commits wait for the gate

        def held_put_rows(*args, **kwargs):  # an LMDB commit that takes as long as the test wants
            gate.wait(30)
            return real(*args, **kwargs)

        monkeypatch.setattr(s._backend, "put_rows", held_put_rows)
        s.read("t", [1])
        s.write("t", [1], torch.tensor([[5.0, 5]]))
        s.read("t", [2])
        s.read("t", [3])  # row 1 leaves the cache: queued for LMDB, the step does not wait
        st = s.stats()
        assert st["ddr"]["writebacks"] == 1 and st["ssd"]["writes"] == 1
        assert s.stored_ids("t").tolist() == []  # not committed yet
        assert s.read("t", [1]).tolist() == [[5.0, 5.0]]  # the queued value, not LMDB's older one
        gate.set()
        s.flush()
        assert s.stored_ids("t").tolist() == [1]
        assert s.stats()["ssd"]["writes"] == 1  # row 1 came back clean: nothing more to write
    with TieredStore(tmp_path, device="cpu") as s:
        assert s.read("t", [1]).tolist() == [[5.0, 5.0]]


def test_a_row_queued_twice_ends_with_its_newest_value(tmp_path, monkeypatch):
    with TieredStore(tmp_path, [TableSpec("t", 100, 2)], ddr_rows=1, device="cpu") as s:
        gate = threading.Event()
        real = s._backend.put_rows  # latency injection: LMDB commits wait for the gate
        monkeypatch.setattr(s._backend, "put_rows", lambda *a, **k: (gate.wait(30), real(*a, **k))[1])
        for value in (1.0, 2.0, 3.0):  # each round: row 5 cached, made dirty, evicted into the queue
            s.read("t", [5])
            s.write("t", [5], torch.full((1, 2), value))
            s.read("t", [6])
            assert s.read("t", [5]).tolist() == [[value, value]]  # from the queue: its newest value
            s.read("t", [6])
        assert s.snapshot().writeback_queued_rows == 3
        gate.set()
        s.flush()
        assert s.snapshot().writeback_queued_rows == 0
    with TieredStore(tmp_path, device="cpu") as s:
        assert s.read("t", [5]).tolist() == [[3.0, 3.0]]


def test_writeback_rows_bounds_the_queue(tmp_path, monkeypatch):
    with TieredStore(tmp_path, [TableSpec("t", 1000, 2)], ddr_rows=10, device="cpu", writeback_rows=0) as s:
        s.write("t", np.arange(100), np.ones((100, 2), dtype=np.float32))  # not cached: queued for LMDB
        s.read("t", [0])  # waits until the queue is under the limit first
        assert s.snapshot().writeback_queued_rows == 0 and s.stats()["rows"]["stored"] == 100
    with pytest.raises(ValueError, match="writeback_rows"):
        TieredStore(tmp_path, device="cpu", writeback_rows=-1)
    with pytest.raises(ValueError, match="writeback_group_rows"):
        TieredStore(tmp_path, device="cpu", writeback_group_rows=1.5)


def test_threads_share_a_store(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 4000, 4)], hbm_rows=50, ddr_rows=200, device="cpu") as s:
        errors = []

        def worker(k):
            try:
                rng = np.random.default_rng(k)
                mine = np.arange(k * 1000, (k + 1) * 1000)  # each thread owns its rows
                for step in range(40):
                    ids = rng.choice(mine, 64, replace=False)
                    s.write("t", ids, np.repeat(ids[:, None], 4, 1).astype(np.float32) + step)
                    got = s.read("t", ids)
                    assert torch.equal(got[:, 0], torch.from_numpy(ids).float() + step)
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors


@pytest.mark.parametrize("overwrite", ["evict", "write"])
def test_a_gather_outside_the_lock_sees_its_rows(tmp_path, monkeypatch, overwrite):
    # an all-resident read gathers after releasing the lock; a call that would
    # overwrite those tier slots meanwhile must wait for it
    with TieredStore(tmp_path, [TableSpec("t", 200, 2)], ddr_rows=100, device="cpu") as s:
        s.write("t", np.arange(200), np.repeat(np.arange(200, dtype=np.float32)[:, None], 2, 1))
        s.read("t", np.arange(100))  # rows 0..99 resident, filling the tier
        real, started = s._gather_tier, threading.Event()  # latency injection: other threads' gathers are slow

        def slow_gather(*args):
            if threading.current_thread() is not threading.main_thread():
                started.set()
                time.sleep(0.3)
            return real(*args)

        monkeypatch.setattr(s, "_gather_tier", slow_gather)
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault("rows", s.read("t", np.arange(100))))
        reader.start()
        assert started.wait(10)
        if overwrite == "evict":
            s.read("t", np.arange(100, 200))  # evicts every row the reader is gathering
        else:
            s.write("t", np.arange(100), np.full((100, 2), -1.0))
        reader.join()
        assert got["rows"][:, 0].tolist() == list(range(100))


def test_closed_store_refuses_calls(tmp_path):
    s = TieredStore(tmp_path, [TableSpec("t", 10, 2)], device="cpu")
    s.close()
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.read("t", [1])


def test_repr_names_the_store(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 10, 2)], device="cpu") as s:
        assert "TieredStore" in repr(s) and "t" in repr(s)
    assert tierstore.__version__


def _state(s):
    """Counts and residents. (SSD reads are left out: a row still queued for writing is read from the queue.)"""
    stats = s.stats()
    return {k: stats[k] for k in ("hbm", "ddr")}, {name: ids.tolist() for name, ids in s.cached_ids("t").items()}


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("hbm, ddr", [(150, 400), (0, 400), (400, 0)])
def test_planning_aside_a_long_fetch_changes_nothing(tmp_path, monkeypatch, policy, hbm, ddr):
    """Reads whose misses reach _PLAN_ASIDE_ROWS plan on a helper thread: same rows, counts and residents."""
    import tierstore.engine.table as table_module

    rng = np.random.default_rng(3)
    calls = [("read", rng.integers(0, 3000, 700)) if i % 3 else ("write", rng.integers(0, 3000, 300)) for i in range(24)]
    results = []
    for aside in (10**12, 1):
        monkeypatch.setattr(table_module, "_PLAN_ASIDE_ROWS", aside)
        with TieredStore(tmp_path / str(aside), [TableSpec("t", 3000, 3)], hbm_rows=hbm, ddr_rows=ddr, policy=policy, device="cpu") as s:
            got = []
            for i, (op, ids) in enumerate(calls):
                if op == "read":
                    got.append(s.read("t", ids))
                else:
                    s.write("t", ids, torch.full((len(ids), 3), float(i)))
            results.append((got, _state(s)))
    (rows_inline, state_inline), (rows_aside, state_aside) = results
    assert all(torch.equal(a, b) for a, b in zip(rows_inline, rows_aside))
    assert state_inline == state_aside


def test_a_failed_fetch_with_its_plan_aside_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    import tierstore.engine.table as table_module

    monkeypatch.setattr(table_module, "_PLAN_ASIDE_ROWS", 1)
    with TieredStore(tmp_path, [TableSpec("t", 1000, 2)], hbm_rows=20, ddr_rows=50, device="cpu") as s:
        s.write("t", np.arange(1000), np.arange(2000, dtype=np.float32).reshape(1000, 2))
        s.flush()  # in LMDB, not in the write-back queue: the next read must go to LMDB
        s.read("t", np.arange(100))
        before = _state(s)
        real = s._backend.get_rows  # fault injection: LMDB reads fail

        def failing(table, ids, out=None, places=None):
            time.sleep(0.05)  # the plan finishes first, while the read is still going
            raise OSError("injected read failure")

        monkeypatch.setattr(s._backend, "get_rows", failing)
        with pytest.raises(OSError, match="injected"):
            s.read("t", np.arange(100, 400))
        assert _state(s) == before
        monkeypatch.setattr(s._backend, "get_rows", real)
        assert torch.equal(s.read("t", [0, 399]), torch.tensor([[0.0, 1.0], [798.0, 799.0]]))


def test_tierstore_torchrec_without_torchrec_says_how_to_install():
    code = "import sys; sys.modules['torchrec'] = None  # as if not installed\nimport tierstore.torchrec"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert "ImportError: tierstore.torchrec needs TorchRec: pip install --no-deps torchrec==1.8.0" in out.stderr


def test_stored_ids_are_the_rows_in_lmdb_once_flushed(store):
    store.write("item", [2**40, 7], torch.ones(2, 2))
    store.read("user", [1, 2])  # read, never written: not stored
    store.flush()
    assert store.stored_ids("item").tolist() == [7, 2**40]
    assert store.stored_ids("user").tolist() == []
    with pytest.raises(KeyError, match="unknown table"):
        store.stored_ids("nope")


def test_cached_ids_say_which_tier_holds_each_row(tmp_path):
    """The exclusive LRU of README "Cache semantics": one list of hbm_rows + ddr_rows, its most recent
    hbm_rows in HBM; recency follows first position in a call."""
    with TieredStore(tmp_path, [TableSpec("t", 100, 2), TableSpec("d", 100, 2)], hbm_rows={"t": 2, "d": 0}, ddr_rows=3,
                     device="cpu") as s:
        s.read("t", [1, 2, 3, 4, 5, 1])  # 5 most recent, then 4; 1 is used once, at its first position
        before = s.stats()
        assert {k: v.tolist() for k, v in s.cached_ids("t").items()} == {"hbm": [4, 5], "ddr": [1, 2, 3]}
        assert s.stats() == before  # looking is no use: nothing counted, nothing moved
        s.read("t", [1])
        s.read("t", [9])  # 2, the least recent, leaves the cache
        assert {k: v.tolist() for k, v in s.cached_ids("t").items()} == {"hbm": [1, 9], "ddr": [3, 4, 5]}
        s.read("d", [7, 8])
        assert {k: v.tolist() for k, v in s.cached_ids("d").items()} == {"hbm": [], "ddr": [7, 8]}  # no HBM tier
        with pytest.raises(KeyError, match="unknown table 'nope'"):
            s.cached_ids("nope")
    with pytest.raises(RuntimeError, match="closed"):
        s.cached_ids("t")


def test_stored_rows_are_what_lmdb_holds_not_what_the_store_serves(tmp_path):
    table = TableSpec("t", 100, 2, state_dim=1, ttl_steps=50)
    with TieredStore(tmp_path, [table], hbm_rows=4, device="cpu") as s:
        s.write("t", [3, 5], np.array([[1, 1, 0.5], [2, 2, 0.5]], dtype=np.float32), with_state=True)
        s.flush()
        s.read("t", [5])  # step 1: 5 cached
        s.write("t", [5], np.full((1, 2), 9.0, dtype=np.float32))  # dirty in the tier: LMDB keeps its old value
        got = s.stored_rows("t", [5, 7, 3, 5])  # any order, repeats, a row never written
        assert got.found.tolist() == [True, False, True, True]
        assert got.rows[[0, 2, 3]].tolist() == [[2, 2, 0.5], [1, 1, 0.5], [2, 2, 0.5]] and np.isnan(got.rows[1]).all()
        assert got.last_use.tolist() == [0, -1, 0, 0]  # written before any step; the use at step 1 is not flushed yet
        s.flush()
        got = s.stored_rows("t", [5])
        assert got.rows.tolist() == [[9, 9, 0.5]] and got.last_use.tolist() == [1]
        with pytest.raises(IndexError, match="100"):
            s.stored_rows("t", [100])
    with TieredStore(tmp_path / "plain", [TableSpec("p", None, 2)], device="cpu") as s:
        assert s.stored_rows("p", []).rows.shape == (0, 2) and s.stored_rows("p", [1]).last_use is None  # no ttl_steps


def test_life_is_the_steps_updates_and_admission_counts_a_table_goes_by(tmp_path):
    table = TableSpec("t", 1000, 2, admit_after=3, admit_width=1024)
    with TieredStore(tmp_path, [table, TableSpec("p", 10, 2)], device="cpu") as s:
        for _ in range(2):
            s.read("t", [4, 4, 8])  # a step counts each id once
        s.trainer("t").update_key()
        life = s.life("t")
        assert (life.steps, life.updates) == (2, 1)
        assert life.sketch.shape == (table.admit_depth, 1024) and life.sketch.dtype == np.uint8
        assert life.sketch.sum() == 2 * 2 * table.admit_depth  # two ids, two steps, one counter a row of the sketch
        life.sketch[:] = 0  # a copy
        assert s.life("t").sketch.sum() > 0
        assert s.life("p") == tierstore.store.TableLife(0, 0, None)  # no admission
    with TieredStore(tmp_path, device="cpu") as s:  # durable at flush (close flushes)
        again = s.life("t")
        assert (again.steps, again.updates, int(again.sketch.sum())) == (2, 1, 2 * 2 * table.admit_depth)
