"""Prefetch: no stale data under races, errors at the step they concern, no leaks,
bit-identical training whatever the depth, and a window that shrinks instead of deadlocking."""
import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import pytest
import torch

import tierstore
from tierstore import TableSpec, TieredStore
from tierstore.engine.hashindex import DenseIndex, make_index
from tierstore.engine.prefetch import LookaheadLoader, PrefetchConfig


def slow_reads(monkeypatch, store, delay=lambda: random.uniform(0, 0.004), fail=None):
    """Delay reads made by prefetch threads (main-thread reads stay fast); optionally fail some."""
    real = store._backend.get_rows  # latency and fault injection into LMDB's reads

    def get_rows(table, ids, out, places=None):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(delay())
            if fail is not None and fail(ids):
                raise lmdb.ReadersFullError("injected LMDB failure")
        return real(table, ids, out, places)

    monkeypatch.setattr(store._backend, "get_rows", get_rows)


def no_prefetch_threads():
    return not [t for t in threading.enumerate() if t.name.startswith("tierstore-prefetch")]


def slow_commits(monkeypatch, store, delay=lambda: random.uniform(0, 0.004)):
    real = store._backend.put_rows  # latency injection into LMDB's commits

    def put_rows(*args, **kwargs):
        time.sleep(delay())
        return real(*args, **kwargs)

    monkeypatch.setattr(store._backend, "put_rows", put_rows)


# group_rows 0 commits each write at once; 64 commits every few steps, so rows sit
# in the write-back queue while their batches are announced and fetched
@pytest.mark.parametrize("eviction, group_rows", [("policy", 0), ("lookahead", 0), ("policy", 64), ("lookahead", 64)])
def test_prefetch_racing_with_reads_writes_evictions_never_serves_stale_rows(tmp_path, monkeypatch, eviction, group_rows):
    random.seed(1)
    rng = np.random.default_rng(1)
    n = 400
    store = TieredStore(tmp_path, [TableSpec("t", n, 4, state_dim=1)], hbm_rows=16, ddr_rows=40, device="cpu",
                        eviction=eviction, prefetch=PrefetchConfig(workers=4, staged_rows=120, sync_read_us=0), writeback_group_rows=group_rows)
    slow_reads(monkeypatch, store)
    slow_commits(monkeypatch, store)
    model = np.zeros((n, 5), dtype=np.float32)
    tickets = []
    try:
        for step in range(400):
            op = rng.integers(0, 6)
            ids = rng.choice(n, rng.integers(1, 30))
            if op == 0:
                tickets.append(store.prefetch("t", ids))
            elif op in (1, 2):
                got = store.read("t", ids, with_state=True)
                assert torch.equal(got, torch.from_numpy(model[ids])), f"stale row at step {step}"
            elif op == 3:
                vals = rng.standard_normal((len(ids), 5)).astype(np.float32)
                store.write("t", ids, vals, with_state=True)
                _, last = np.unique(ids[::-1], return_index=True)
                uniq = np.unique(ids)
                model[uniq] = vals[::-1][last]
            elif op == 4:
                store.flush()
            elif tickets:
                tickets.pop(random.randrange(len(tickets))).release()
        for t in tickets:
            t.wait()
        assert torch.equal(store.read("t", np.arange(n), with_state=True), torch.from_numpy(model))
        assert store.prefetch_stats()["tables"]["t"]["served_rows"] > 0  # the race was real
    finally:
        store.close()
    assert no_prefetch_threads()


def make_bag(path, num_rows=2000, dim=8, optimizer=None, init=tierstore.RowInit.normal(0, 0.1, seed=3), staged_rows=None, **tiers):
    """A bag on a store of its own (close it with emb.store.close()). sync_read_us 0: read ahead however
    fast LMDB is (these tests slow only the prefetch threads' reads; the step's stay fast, which could stop
    read-ahead)."""
    optimizer = optimizer or tierstore.optim.Adagrad(lr=0.1)
    spec = TableSpec("t0", num_rows, dim, init=init, state_dim=optimizer.state_dim(dim))
    store = TieredStore(path, [spec], device="cpu", prefetch=PrefetchConfig(staged_rows=staged_rows, sync_read_us=0), **tiers)
    return tierstore.TieredEmbeddingBag(num_rows, dim, mode="sum", store=store, table="t0", optimizer=optimizer)


def batches(count=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = (torch.rand(64, generator=g) ** 3 * 2000).long()
        out.append((ids, torch.arange(0, 64, 4)))
    return out


def train(emb, loader):
    for ids, offsets in loader:
        emb(ids, offsets).pow(2).sum().backward()


def test_training_is_bit_identical_for_depth_0_1_8(tmp_path, monkeypatch):
    final = {}
    for depth in (0, 1, 8):
        emb = make_bag(tmp_path / f"d{depth}", hbm_rows=16, ddr_rows=64)
        slow_reads(monkeypatch, emb.store)
        train(emb, LookaheadLoader(batches(), emb, depth=depth))
        final[depth] = emb.store.read(emb.table, torch.arange(2000), with_state=True)
        assert emb.store.prefetch_stats()["staged_rows"] == 0
        if depth:
            assert emb.store.prefetch_stats()["tables"][emb.table]["served_rows"] > 0
        emb.store.close()
    assert torch.equal(final[0], final[1]) and torch.equal(final[0], final[8])


@pytest.mark.parametrize("bad, match, cause", [
    (torch.tensor([1, 5000, 3, 4]), "5000", IndexError),
    (torch.tensor([1.0, 2.5, 3.0, 4.0]), "'indices'", TypeError),
])
def test_bad_id_in_a_future_batch_is_raised_at_its_step(tmp_path, bad, match, cause):
    emb = make_bag(tmp_path, ddr_rows=64)
    data = batches(10)
    data[6] = (bad, torch.tensor([0, 2]))
    seen = []
    with pytest.raises(cause, match=match) as at_depth_0:  # what prefetch must not change
        emb(*data[6])
    with pytest.raises(cause, match=match) as info:
        for i, (ids, offsets) in enumerate(LookaheadLoader(data, emb, depth=4)):
            seen.append(i)
            emb(ids, offsets).sum().backward()
    assert seen == [0, 1, 2, 3, 4, 5, 6]  # raised by batch 6's own forward
    assert type(info.value) is type(at_depth_0.value) and str(info.value) == str(at_depth_0.value)
    assert emb.store.prefetch_stats()["outstanding"] == 0
    emb.store.close()


def test_background_lmdb_failure_is_raised_at_its_step(tmp_path, monkeypatch):
    emb = make_bag(tmp_path, ddr_rows=64)
    data = batches(12)
    poisoned = max(set(range(2000)) - set(torch.cat([ids for ids, _ in data]).tolist()))  # in batch 7 only
    data[7] = (torch.tensor([poisoned, 2, 3, 4]), torch.tensor([0, 2]))
    slow_reads(monkeypatch, emb.store, delay=lambda: 0.001, fail=lambda ids: poisoned in ids)
    seen = []
    with pytest.raises(lmdb.ReadersFullError, match=r"injected LMDB failure \(raised by the prefetch of table 't0' for batch 7\)"):
        for i, (ids, offsets) in enumerate(LookaheadLoader(data, emb, depth=3)):
            seen.append(i)
            emb(ids, offsets).sum().backward()
    assert seen == list(range(7))
    emb.store.close()


def test_unwaited_background_failure_surfaces_at_the_next_read(tmp_path, monkeypatch):
    with TieredStore(tmp_path, [TableSpec("t", 100, 2)], ddr_rows=10, device="cpu", prefetch=PrefetchConfig(sync_read_us=0)) as s:
        slow_reads(monkeypatch, s, delay=lambda: 0, fail=lambda ids: True)
        ticket = s.prefetch("t", [1, 2, 3])
        while not ticket.done():
            time.sleep(0.001)
        with pytest.raises(lmdb.ReadersFullError, match="injected"):
            s.read("t", [7])
        assert s.read("t", [7]).shape == (1, 2)  # delivered once


@pytest.mark.parametrize("how", ["end", "break", "raise", "forward_only"])
def test_nothing_leaks_however_the_loop_ends(tmp_path, monkeypatch, how):
    emb = make_bag(tmp_path, hbm_rows=8, ddr_rows=32)
    slow_reads(monkeypatch, emb.store, delay=lambda: 0.002)
    try:
        for i, (ids, offsets) in enumerate(LookaheadLoader(batches(12), emb, depth=4)):
            out = emb(ids, offsets)
            if how == "forward_only":
                continue
            out.sum().backward()
            if i == 3 and how == "break":
                break
            if i == 3 and how == "raise":
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    # fetches in flight may still land: they must unpin themselves
    deadline = time.time() + 10
    while emb.store.prefetch_stats()["inflight"] and time.time() < deadline:
        time.sleep(0.01)
    state = emb.store.prefetch_stats()
    assert (state["inflight"], state["staged_rows"], state["window_batches"], state["outstanding"]) == (0, 0, 0, 0), state
    emb.store.close()
    assert no_prefetch_threads()


def test_window_larger_than_staging_shrinks_instead_of_deadlocking(tmp_path):
    emb = make_bag(tmp_path, 10_000, 4, tierstore.optim.SGD(lr=0.1), ddr_rows=64, staged_rows=100)  # room for about two batches
    g = torch.Generator().manual_seed(0)
    data = [(torch.randperm(10_000, generator=g)[:40], torch.tensor([0, 20])) for _ in range(20)]
    loader = LookaheadLoader(data, emb, depth=8)
    depths = []
    for ids, offsets in loader:
        depths.append(loader.effective_depth)
        emb(ids, offsets).sum().backward()
    assert len(depths) == 20
    assert max(depths) < 8 and max(depths) >= 1
    assert loader.shrunk_steps > 0
    assert emb.store.prefetch_stats()["tables"][emb.table]["shrunk_steps"] == loader.shrunk_steps
    emb.store.close()


def test_cached_rows_take_no_staging_room(tmp_path):
    # each batch reads 60 hot rows (cached) and 20 new ones: only the 20 need room,
    # so a staging area of 100 rows holds the whole window of 4
    emb = make_bag(tmp_path, 10_000, 4, tierstore.optim.SGD(lr=0.1), ddr_rows=200, staged_rows=100)
    hot = torch.arange(60)
    data = [(torch.cat([hot, torch.arange(100 + 20 * i, 120 + 20 * i)]), torch.tensor([0, 40])) for i in range(12)]
    emb(*data[0]).sum().backward()  # the hot rows are cached from here on
    loader = LookaheadLoader(data[1:], emb, depth=4)
    depths = []
    for ids, offsets in loader:
        depths.append(loader.effective_depth)
        emb(ids, offsets).sum().backward()
    assert depths[:-4] == [4] * (len(data) - 5) and loader.shrunk_steps == 0
    emb.store.close()


def test_rows_queued_for_lmdb_are_staged_from_the_queue(tmp_path, monkeypatch):
    # a batch announced while its rows wait in the write-back queue: once the queue
    # commits them only LMDB has them, so they are staged from the queue at once
    with TieredStore(tmp_path, [TableSpec("t", 1000, 2)], ddr_rows=10, device="cpu", prefetch=PrefetchConfig(staged_rows=50, sync_read_us=0)) as s:
        ids = np.arange(100, 150)
        values = np.random.default_rng(0).standard_normal((50, 2)).astype(np.float32)
        s.write("t", ids, values)  # not cached: queued
        assert s.snapshot().writeback_queued_rows == 50
        s.prefetch("t", ids).wait()
        s.flush()  # commits the queue

        def no_lmdb_reads(*args):  # fault injection: any LMDB read now fails the test
            raise AssertionError(f"rows {args[1]} were read from LMDB")
        monkeypatch.setattr(s._backend, "get_rows", no_lmdb_reads)
        assert torch.equal(s.read("t", ids), torch.from_numpy(values))
        assert s.prefetch_stats()["tables"]["t"]["served_rows"] == 50


def test_a_read_releases_a_ticket_only_when_it_covers_the_ticket(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 1000, 2)], ddr_rows=100, device="cpu", prefetch=PrefetchConfig(sync_read_us=0)) as s:
        ticket = s.prefetch("t", [7, 3, 9, 3, 500])
        ticket.wait()
        assert s.prefetch_stats()["window_batches"] == 1
        s.read("t", [3, 9, 500, 11])  # 7 is missing: the batch is not done with
        assert s.prefetch_stats()["window_batches"] == 1
        s.read("t", [500, 9, 8, 7, 3, 3])  # unsorted, repeated, with extra ids
        assert s.prefetch_stats()["window_batches"] == 0


def test_cold_reads_spread_over_the_pool(tmp_path, monkeypatch):
    with TieredStore(tmp_path, [TableSpec("t", 50_000, 2)], ddr_rows=50_000, device="cpu",
                     prefetch=PrefetchConfig(workers=4, sync_read_us=0)) as s:
        names = set()
        real = s._backend.get_rows  # latency injection: each LMDB read takes 10 ms

        def get_rows(table, ids, out, places=None):
            names.add(threading.current_thread().name)
            time.sleep(0.01)
            return real(table, ids, out, places)

        monkeypatch.setattr(s._backend, "get_rows", get_rows)
        s.prefetch("t", np.arange(4_000)).wait()
        assert len(names) == 4


def test_prefetch_threads_wait_while_the_trainer_is_in_the_store(tmp_path, monkeypatch):
    with TieredStore(tmp_path, [TableSpec("t", 50_000, 2)], ddr_rows=50_000, device="cpu",
                     prefetch=PrefetchConfig(workers=4, sync_read_us=0)) as s:
        reads_while_held = []
        held = threading.Event()
        real = s._backend.get_rows  # notes each LMDB read's moment: during the injected hold below or not

        def get_rows(table, ids, out, places=None):
            reads_while_held.append(held.is_set())
            return real(table, ids, out, places)

        monkeypatch.setattr(s._backend, "get_rows", get_rows)
        with s._lock:  # latency injection: the store held for 0.2 s, as a trainer's read or write holds it
            held.set()
            ticket = s.prefetch("t", np.arange(4_000))
            time.sleep(0.2)
            held.clear()
        ticket.wait()
        assert reads_while_held and not any(reads_while_held)


@pytest.mark.parametrize("trainer_step, threads_at_the_end", [(1000.0, 1), (1e-6, 4)])
def test_a_fetch_takes_the_threads_it_needs_to_land_before_its_batch(tmp_path, monkeypatch, trainer_step, threads_at_the_end):
    from tierstore.engine import prefetch as prefetch_module

    parts = []
    real = prefetch_module.read_rows_async

    def spy(*args, **kwargs):
        parts.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(prefetch_module, "read_rows_async", spy)
    with TieredStore(tmp_path, [TableSpec("t", 100_000, 2)], ddr_rows=50_000, device="cpu",
                     prefetch=PrefetchConfig(workers=4, sync_read_us=0)) as s:
        slow_reads(monkeypatch, s, delay=lambda: 0.002)
        ticks = (i * trainer_step for i in itertools.count())
        batches = [torch.arange(i * 1000, (i + 1) * 1000) for i in range(6)]
        for b in LookaheadLoader(batches, s, depth=2, ids=lambda b: {"t": b}, clock=lambda: next(ticks)):
            s.read("t", b)
    assert parts[0] == 4  # nothing measured yet: every thread
    assert parts[-1] == threads_at_the_end  # a slow trainer leaves one thread time enough


def residents_after(tmp_path, eviction, announce, num_rows=100):
    """DDR of 3 holding 1, 2, 3 (1 least recent), batches `announce` announced, then a read of 4."""
    with TieredStore(tmp_path / f"{eviction}{announce}", [TableSpec("t", num_rows, 2)], ddr_rows=3, device="cpu", eviction=eviction) as s:
        assert isinstance(make_index(3, num_rows), DenseIndex) == (num_rows <= 32 * 3)  # the index a 3-row tier takes
        for x in (1, 2, 3):
            s.read("t", [x])
        tickets = [s.prefetch("t", ids) for ids in announce]
        s.read("t", [4])
        resident = set(s.cached_ids("t")["ddr"].tolist())
        for t in tickets:
            t.release()
        return resident


INDEXES = pytest.mark.parametrize("num_rows", [10, 100], ids=["dense-index", "hash-index"])  # the window's lookup differs


@INDEXES
@pytest.mark.parametrize("eviction", ["policy", "lookahead"])
def test_rows_in_the_window_are_pinned(tmp_path, eviction, num_rows):
    assert residents_after(tmp_path, eviction, [], num_rows) == {2, 3, 4}  # plain LRU
    assert residents_after(tmp_path, eviction, [[1]], num_rows) == {1, 3, 4}  # 1 pinned: the next LRU row goes


@INDEXES
def test_lookahead_evicts_the_farthest_next_use_among_pinned_rows(tmp_path, num_rows):
    # all three pinned, next used in the order 1, 2, 3: LRU would drop 1, lookahead drops 3
    assert residents_after(tmp_path, "policy", [[1], [2], [3]], num_rows) == {2, 3, 4}
    assert residents_after(tmp_path, "lookahead", [[1], [2], [3]], num_rows) == {1, 2, 4}


@pytest.mark.parametrize("num_rows", [1000, 100_000], ids=["dense-index", "hash-index"])
def test_lookahead_evicts_by_each_cached_rows_earliest_announced_step(tmp_path, num_rows):
    """Prefetcher.next_use, with a dense and a hashed index, seen in what lookahead eviction
    keeps: a full DDR tier's rows are announced by 4 batches (a row's first batch is its next use; later
    batches name it again) but for a few rows, none; a read of new rows evicts first the rows no batch
    names, then those whose next use is the last batch, and nothing else."""
    rng = np.random.default_rng(num_rows)
    with TieredStore(tmp_path, [TableSpec("t", num_rows, 2)], ddr_rows=200, device="cpu", eviction="lookahead") as s:
        cached = rng.choice(num_rows, 200, replace=False)
        s.read("t", cached)
        assert sorted(s.cached_ids("t")["ddr"].tolist()) == sorted(cached.tolist())
        unannounced, groups = cached[:10], np.split(cached[10:], [50, 100, 150])  # groups[k]: first named by batch k
        uncached = np.setdiff1d(np.arange(num_rows), cached)
        batches = [np.concatenate([groups[k], rng.choice(cached[10:10 + 50 * k], 20 * k, replace=False),
                                   rng.choice(uncached[:100], 10, replace=False)]) for k in range(4)]
        tickets = [s.prefetch("t", rng.permutation(b)) for b in batches]
        for t in tickets:
            t.wait()
        new = rng.choice(uncached[100:], len(unannounced) + len(groups[3]), replace=False)
        s.read("t", new)
        kept = set(s.cached_ids("t")["ddr"].tolist())
        assert kept == set(cached.tolist()) - set(unannounced.tolist()) - set(groups[3].tolist()) | set(new.tolist())
        assert isinstance(make_index(200, num_rows), DenseIndex) == (num_rows <= 32 * 200)  # the index searched
        for t in tickets:
            t.release()


@pytest.mark.parametrize("num_rows", [300, 4000], ids=["dense-index", "hash-index"])
def test_asking_the_window_about_victims_evicts_as_ranking_every_slot(tmp_path, monkeypatch, num_rows):
    """The planner asks the window about its victims alone (Prefetcher.in_window) and ranks every
    slot by its next use only where that does not settle it; over 80 steps, with the window holding
    more rows than the tier and announced rows evicted (evict()) and cached again elsewhere, the
    tier holds what ranking every slot each step gives (in_window switched off: the oracle)."""
    from tierstore.engine import step as step_module

    rng = np.random.default_rng(num_rows)
    batches = [(rng.random(10) ** 2 * num_rows).astype(np.int64) for _ in range(80)]  # skewed: rows come back
    evicted = [rng.permutation(np.unique(b))[:3] for b in batches]

    def residents(store_dir) -> list[list[int]]:
        seen = []
        with TieredStore(tmp_path / store_dir, [TableSpec("t", num_rows, 2)], ddr_rows=12, device="cpu", eviction="lookahead") as s:
            tickets = [s.prefetch("t", b) for b in batches[:4]]
            for i, b in enumerate(batches):
                if i + 4 < len(batches):
                    tickets.append(s.prefetch("t", batches[i + 4]))
                s.read("t", b)
                tickets[i].release()
                if i % 3 == 0 and i + 2 < len(batches):
                    s.evict("t", evicted[i + 2])  # announced rows leave, to come back in another slot
                seen.append(sorted(s.cached_ids("t")["ddr"].tolist()))
            assert isinstance(make_index(12, num_rows), DenseIndex) == (num_rows <= 32 * 12)  # the index searched
        return seen

    asked = residents("asked")
    monkeypatch.setattr(step_module, "PIN_ROUNDS", 0)  # the oracle switch: every slot ranked by its next use
    assert asked == residents("ranked")
    assert len({tuple(r) for r in asked}) > 40  # the tier's rows changed step after step


def test_bad_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="eviction"):
        TieredStore(tmp_path, [TableSpec("t", 10, 2)], eviction="belady")
    with pytest.raises(ValueError, match="workers"):
        PrefetchConfig(workers=0)
    with pytest.raises(ValueError, match="depth"):
        LookaheadLoader([], TieredStore(tmp_path / "x", [TableSpec("t", 10, 2)], device="cpu"), depth=-1)


def test_module_prefetch_stages_the_rows_forward_reads(tmp_path):
    emb = make_bag(tmp_path / "bag", ddr_rows=64)
    ids, offsets = batches(1)[0]
    emb.prefetch(ids, offsets).wait()
    assert emb.store.prefetch_stats()["staged_rows"] == min(64, len(torch.unique(ids)))
    emb(ids, offsets).sum().backward()
    assert emb.store.prefetch_stats()["tables"][emb.table]["served_rows"] > 0
    emb.store.close()
    ebc = tierstore.TieredEmbeddingBagCollection(
        tables=[TableSpec("a", 100, 4), TableSpec("b", 100, 4)], path=tmp_path / "ebc", ddr_rows=50,
        optimizer=tierstore.optim.SGD(lr=0.1), device="cpu",
    )
    features = {"a": (torch.tensor([1, 2, 3]), torch.tensor([0])), "b": (torch.tensor([7]), torch.tensor([0]))}
    group = ebc.prefetch(features)
    group.wait()
    assert [t.table for t in group.tickets] == ["a", "b"]
    assert ebc.store.prefetch_stats()["staged_rows"] == 4
    group.release()
    ebc.close()


def test_a_batch_the_module_cannot_read_raises_at_its_own_step(tmp_path):
    ebc = tierstore.TieredEmbeddingBagCollection([TableSpec("a", 100, 4), TableSpec("b", 100, 4)], path=tmp_path,
                                                 ddr_rows=20, device="cpu", optimizer=tierstore.optim.SGD(lr=0.1))
    data = [{"a": (torch.tensor([i, i + 1]), torch.tensor([0]))} for i in range(8)]
    data[5] = {"nope": (torch.tensor([1]), torch.tensor([0]))}
    seen = []
    with pytest.raises(KeyError, match="unknown table 'nope'"):  # as without prefetch, not 3 batches early
        for i, batch in enumerate(LookaheadLoader(data, ebc, depth=3)):
            seen.append(i)
            ebc(batch)["a"].sum().backward()
    assert seen == [0, 1, 2, 3, 4, 5]
    ebc.close()


@pytest.mark.parametrize("row_seconds, chunk", [(None, 256), (50e-6, 256), (1e-6, 500), (1e-8, 2048)])
def test_reading_threads_take_rows_in_chunks_of_about_half_a_millisecond(tmp_path, monkeypatch, row_seconds, chunk):
    """Chunks of ~0.5 ms of reads, 256 to 2048 rows: smaller ones cost the threads
    more CPU (a transaction, the pause, GIL hand-offs) than the gets."""
    from tierstore.io import LmdbBackend, workers
    from tierstore.engine.prefetch import chunk_rows

    assert chunk_rows(row_seconds) == chunk
    calls, pauses = [], []
    backend = LmdbBackend(tmp_path)
    try:
        backend.open_table("t", 2)
        real = backend.get_rows
        monkeypatch.setattr(backend, "get_rows", lambda table, ids, out, places=None: (calls.append(len(ids)), real(table, ids, out, places))[1])
        done = threading.Event()
        ids = np.arange(0, 9_000, 3)
        with ThreadPoolExecutor(1) as pool:
            workers.read_rows_async(backend, "t", ids, 2, pool, 1, lambda *a: done.set(), lambda: pauses.append(1), chunk=chunk)
            assert done.wait(30)
    finally:
        backend.close()
    assert calls == [min(chunk, len(ids) - a) for a in range(0, len(ids), chunk)]
    assert len(pauses) == len(calls)


def test_reading_threads_that_do_not_pause_read_a_part_in_one_call(tmp_path, monkeypatch):
    """Without a pause (direct reads wait without the GIL) a thread reads its whole part in
    one call: one read transaction and one index lookup, not one per chunk."""
    from tierstore.io import LmdbBackend, workers

    calls = []
    backend = LmdbBackend(tmp_path)
    try:
        backend.open_table("t", 2)
        real = backend.get_rows
        monkeypatch.setattr(backend, "get_rows", lambda table, ids, out, places=None: (calls.append(len(ids)), real(table, ids, out, places))[1])
        got = []
        done = threading.Event()
        with ThreadPoolExecutor(3) as pool:
            workers.read_rows_async(backend, "t", np.arange(0, 9_000, 3), 2, pool, 3, lambda *a: (got.append(a), done.set()), None, chunk=256)
            assert done.wait(30)
    finally:
        backend.close()
    assert sorted(calls) == [1000, 1000, 1000]
    assert got[0][2] is None and got[0][1].shape == (3000,)


def test_releasing_a_batch_unstages_what_it_did_not_read_unless_a_later_batch_needs_it(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 1000, 2)], ddr_rows=100, device="cpu", prefetch=PrefetchConfig(sync_read_us=0)) as s:
        staged = lambda: s.prefetch_stats()["tables"]["t"]["staged_rows"]  # noqa: E731
        first = s.prefetch("t", [1, 2, 3, 4])
        first.wait()
        second = s.prefetch("t", [3, 4, 5])  # 3 and 4 are staged already: pinned on, until this batch is done
        second.wait()
        s.read("t", [1])  # taken out of staging into the cache
        assert staged() == 4
        first.release()
        assert staged() == 3  # 2 went; 3 and 4 wait for the second batch
        second.release()
        assert staged() == 0


def test_rows_are_read_ahead_only_while_lmdb_is_slow_and_train_the_same_either_way(tmp_path, monkeypatch):
    """PrefetchConfig.sync_read_us: while LMDB serves rows fast (the page cache), the
    step reads them itself and prefetch reads nothing; when reads slow down (here
    1 ms a row injected, in every thread), it reads ahead again. The trained rows
    equal a run without prefetch, bit for bit. The threshold (300 us a row) is far from
    both: LMDB's own reads of a table this small take a few us a row, and a loaded
    machine's stalls stay well under the threshold on average."""
    slow = [True]
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 5000, (64,), generator=g), torch.arange(0, 64, 8)) for _ in range(48)]
    final, phases = {}, []
    for depth in (0, 2):
        store = TieredStore(tmp_path / str(depth), [TableSpec("t", 5000, 4)], ddr_rows=100, device="cpu",
                            prefetch=PrefetchConfig(workers=2, sync_read_us=300))
        emb = tierstore.TieredEmbeddingBag(5000, 4, mode="sum", store=store, table="t", optimizer=tierstore.optim.SGD(lr=0.1))
        real = emb.store._backend.get_rows  # latency injection: 1 ms a row while slow[0]

        def get_rows(table, ids, out, places=None, real=real):
            if slow[0]:
                time.sleep(len(ids) * 1e-3)
            return real(table, ids, out, places)

        monkeypatch.setattr(emb.store._backend, "get_rows", get_rows)
        loader = iter(LookaheadLoader(data, emb, depth=depth))
        for phase in ("slow", "fast", "slow again"):
            slow[0] = phase != "fast"
            issued, left = [], []
            for ids, offsets in itertools.islice(loader, 16):
                emb(ids, offsets).sum().backward()
                counters = emb.store.prefetch_stats()["tables"][emb.table]
                issued.append(counters["issued_rows"])
                left.append(counters["step_read_batches"])
            if depth:
                phases.append((phase, emb.store.prefetch_stats()["reading_ahead"], issued[-1] - issued[-7], left[-1] - left[-7]))
        final[depth] = emb.store.read(emb.table, torch.arange(5000), with_state=True)
        emb.store.close()
    (_, ahead_1, issued_1, left_1), (_, ahead_2, issued_2, left_2), (_, ahead_3, issued_3, left_3) = phases
    assert ahead_1 and issued_1 > 0 and left_1 == 0, phases  # slow: read ahead
    assert not ahead_2 and issued_2 == 0 and left_2 == 6, phases  # fast: the last 6 batches were left to the step
    assert ahead_3 and issued_3 > 0, phases  # slow again: read ahead again
    assert torch.equal(final[0], final[2])


@pytest.mark.parametrize("slow", [False, True])
def test_a_fresh_store_times_a_read_of_the_first_batch_before_reading_ahead(tmp_path, monkeypatch, slow):
    """Whether to read ahead is known from the first announced batch: the prefetcher
    times a read of some of its rows in the caller's thread first. LMDB fast (the page
    cache): the step reads its rows itself from the first batch on; slow (200 us a row,
    in every thread): the first batch is read ahead."""
    with TieredStore(tmp_path, [TableSpec("t", 5000, 4)], ddr_rows=100, device="cpu",
                     prefetch=PrefetchConfig(workers=2, staged_rows=2000, sync_read_us=50)) as s:
        s.write("t", np.arange(5000), np.ones((5000, 4), dtype=np.float32))
        s.flush()
        real, calls = s._backend.get_rows, []  # latency injection (200 us a row if slow); notes each read's thread

        def get_rows(table, ids, out, places=None):
            calls.append((threading.current_thread() is threading.main_thread(), len(ids)))
            if slow:
                time.sleep(len(ids) * 200e-6)
            return real(table, ids, out, places)

        monkeypatch.setattr(s._backend, "get_rows", get_rows)
        s.prefetch("t", np.arange(0, 5000, 3)).wait()
        counters = s.prefetch_stats()["tables"]["t"]
        assert s.prefetch_stats()["reading_ahead"] == slow
        assert (counters["issued_rows"], counters["step_read_batches"]) == ((1667, 0) if slow else (0, 1))
        assert calls[0] == (True, 512)  # the timed read, in the caller's thread
        assert all(not in_main for in_main, _ in calls[1:]) and len(calls) > 1 if slow else len(calls) == 1
        assert torch.equal(s.read("t", np.arange(0, 5000, 3)), torch.ones(1667, 4))


def test_sync_read_us_is_validated():
    with pytest.raises(ValueError, match="sync_read_us must be a number >= 0"):
        PrefetchConfig(sync_read_us=-1)
