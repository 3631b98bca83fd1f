"""The write-back queue's writer: commits grouped batches in queue order, and
does not linger when someone waits for it."""
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierstore import TableSpec, TieredStore
from tierstore.io import LmdbBackend, WriteBack, rowlog
from tierstore.io.writeback import QueuedRows


def writer(tmp_path, **kwargs):
    backend = LmdbBackend(tmp_path)
    backend.open_table("t", 2)
    commits = []
    real = backend.put_rows

    def put_rows(batches, meta=None, **kw):
        commits.append(sum(len(ids) for _, ids, _ in batches))
        return real(batches, meta, **kw)

    backend.put_rows = put_rows  # a spy: the real LMDB write runs
    lock = threading.RLock()
    return backend, WriteBack(backend, lock, **kwargs), lock, commits


def rows(ids, value):
    return np.full((len(ids), 2), value, dtype=np.float32)


def test_batches_wait_for_a_group_then_commit_together_newest_value_last(tmp_path):
    backend, wb, lock, commits = writer(tmp_path, limit_rows=1000, group_rows=100, linger=60.0)
    with lock:
        wb.submit([("t", np.arange(0, 40), rows(range(40), 1.0))])
        wb.submit([("t", np.arange(20, 60), rows(range(40), 2.0))])  # 20..39 again, newer
    time.sleep(0.3)  # a writer that did not wait for the group would have committed by now
    with lock:
        assert commits == [] and wb.queued_rows == 80
        wb.submit([("t", np.arange(100, 120), rows(range(20), 3.0))])  # 100 rows queued: due
        wb._cond.wait_for(lambda: wb.queued_rows == 0, timeout=30)
        wb.reap()
    assert commits == [80]  # 20..39 once, with its newer value
    got, found = backend.get_rows("t", np.arange(0, 120))
    expected = np.concatenate([np.full(20, 1.0), np.full(40, 2.0), np.full(40, np.nan), np.full(20, 3.0)])
    assert np.array_equal(found, ~np.isnan(expected))
    assert np.array_equal(got[found, 0], expected[found])
    with lock:
        wb.stop()
    backend.close()


def test_a_caller_waiting_for_the_queue_does_not_wait_for_the_group(tmp_path):
    backend, wb, lock, commits = writer(tmp_path, limit_rows=1000, group_rows=100, linger=60.0)
    start = time.perf_counter()
    with lock:
        wb.submit([("t", np.arange(5), rows(range(5), 1.0))], meta={"k": 1})
        wb.drain()
    assert commits == [5] and time.perf_counter() - start < 30
    assert backend.read_meta() == {"k": 1}
    with lock:
        wb.stop()
    backend.close()


def test_a_lone_batch_commits_after_the_linger(tmp_path):
    backend, wb, lock, commits = writer(tmp_path, limit_rows=1000, group_rows=100, linger=0.05)
    with lock:
        wb.submit([("t", np.arange(5), rows(range(5), 1.0))])
        assert wb._cond.wait_for(lambda: wb.queued_rows == 0, timeout=30)
        wb.stop()
    assert commits == [5]
    backend.close()


@given(st.lists(st.tuples(st.booleans(), st.sets(st.integers(0, 40), max_size=12)), max_size=30))
def test_queued_rows_hold_the_newest_value_of_each_row_until_its_last_batch_commits(ops):
    """QueuedRows against a dict: put(batch) replaces values; dropping the oldest
    committed batches, one or several at once (the writer commits in order), forgets
    only their rows that no later batch queued again."""
    # capacity 4 grows; a batch of 8 or more rows is adopted as a segment of its own
    queued, model = QueuedRows(width=2, capacity=4, adopt_rows=8), {}  # id -> (seq, value)
    batches = []
    for seq, (is_put, ids) in enumerate(ops, 1):
        if is_put or not batches:
            ids = np.array(sorted(ids), dtype=np.int64)
            queued.put(ids, rows(ids, float(seq)), seq)
            model.update({int(i): (seq, float(seq)) for i in ids})
            batches.append((seq, ids))
        else:
            done, batches = batches[: 1 + len(ids) % len(batches)], batches[1 + len(ids) % len(batches):]
            old_seq, old_ids = done[-1][0], np.unique(np.concatenate([b for _, b in done]))
            queued.drop(old_ids, old_seq)
            model = {i: v for i, v in model.items() if not (v[0] <= old_seq and i in set(old_ids.tolist()))}
        probe = np.arange(0, 41)
        found, got = queued.get(probe)
        assert found.tolist() == [i in model for i in range(41)]
        assert (got[:, 0].tolist() if got is not None else []) == [model[i][1] for i in range(41) if i in model]
    assert len(queued) == len(model)

    if not model:  # every adopted write was committed or overwritten: only the pool is left
        assert queued.nbytes == queued.pool.nbytes


def test_a_bulk_write_is_adopted_not_copied_and_its_memory_leaves_when_it_commits():
    """A bulk write followed by small ones (an eviction's write-back) must not copy
    the bulk rows into a pool twice their size."""
    queued = QueuedRows(width=128, capacity=1024)
    bulk = np.random.default_rng(0).standard_normal((200_000, 128), dtype=np.float32)
    queued.put(np.arange(200_000), bulk, seq=1)
    small_ids = np.arange(300_000, 302_000)
    queued.put(small_ids, rows(small_ids, 2.0).repeat(64, axis=1), seq=2)  # 2000 new rows: the pool grows
    queued.put(np.array([5, 7]), np.full((2, 128), 3.0, dtype=np.float32), seq=3)  # overwrite two bulk rows
    assert queued.nbytes <= bulk.nbytes + 4096 * 128 * 4  # the bulk rows once, plus a small pool
    found, got = queued.get(np.array([4, 5, 7, 300_001, 400_000]))
    assert found.tolist() == [True, True, True, True, False]
    assert np.array_equal(got[0], bulk[4]) and (got[1:3] == 3.0).all() and (got[3] == 2.0).all()
    queued.drop(np.arange(200_000), seq=1)  # the bulk batch commits: rows 5 and 7 stay, newer
    assert queued.nbytes == queued.pool.nbytes and len(queued) == 2002
    assert (queued.get(np.array([5]))[1] == 3.0).all()


def test_the_pool_doubles_up_to_the_queues_limit_and_no_further():
    """Past the queue's limit the pool grows by what a put needs: doubling there held up to
    twice the rows the budget gave the queue."""
    def put_all(queued, n):
        for start in range(0, n, 100):  # a step's rows at a time
            ids = np.arange(start, start + 100)
            queued.put(ids, rows(ids, float(start)), seq=start + 1)

    queued = QueuedRows(width=2, capacity=100, limit_rows=1500)
    put_all(queued, 1500)
    assert len(queued.pool) == 1500  # 100, 200, 400, 800, then the limit
    put_all(queued, 1700)  # 200 rows past the limit: what they need, not twice the pool
    assert len(queued.pool) == 1700
    found, got = queued.get(np.array([0, 1499, 1500, 1699]))
    assert found.all() and got[:, 0].tolist() == [0.0, 1400.0, 1500.0, 1600.0]
    unlimited = QueuedRows(width=2, capacity=100)
    put_all(unlimited, 1700)
    assert len(unlimited.pool) == 3200


def test_drain_waits_for_a_batch_of_metadata_only(tmp_path):
    """flush() queues its metadata (last flush, step counts) even with no dirty rows:
    drain must wait for that commit too, or flush returns before it is durable."""
    backend, wb, lock, commits = writer(tmp_path, limit_rows=1000, linger=60.0)
    real = backend.put_rows

    def slow_put_rows(batches, meta=None, **kw):
        time.sleep(0.05)  # injected latency: the commit is still running when drain starts
        return real(batches, meta, **kw)

    backend.put_rows = slow_put_rows
    with lock:
        wb.submit([], meta={"steps": {"t": 7}})
        wb.drain()
        assert backend.read_meta()["steps"] == {"t": 7}
        wb.stop()
    backend.close()


def test_stored_ids_are_the_keys_of_the_rows_written_and_not_deleted(tmp_path):
    backend = LmdbBackend(tmp_path)
    backend.open_table("t", 2)
    backend.open_table("empty", 2)
    ids = np.array([2**63 - 1, 5, 0, 300, 2**32], dtype=np.int64)
    backend.put_rows([("t", ids, rows(ids, 1.0))])
    assert backend.delete_rows("t", np.array([5, 2**32])) == 2
    got = backend.stored_ids("t")
    assert got.dtype == np.int64 and got.tolist() == [0, 300, 2**63 - 1]
    assert backend.stored_ids("empty").tolist() == []
    backend.close()


@given(st.lists(st.lists(st.integers(-2**62, 2**62), max_size=40), max_size=6))
def test_unique_ids_equals_np_unique_for_merged_batches_and_any_ids(parts):
    from tierstore.io import unique_ids

    merged = np.concatenate([np.unique(np.array(p, dtype=np.int64)) for p in parts] or [np.empty(0, dtype=np.int64)])
    for ids in (merged, merged[::-1].copy()):
        got = unique_ids(ids)
        assert got.dtype == np.int64 and np.array_equal(got, np.unique(ids))


@pytest.mark.parametrize("prefetched", [False, True])
def test_dirty_rows_leaving_the_ddr_tier_hand_lmdb_the_places_their_read_found(tmp_path, monkeypatch, prefetched):
    """A row read from LMDB into the DDR tier (by the step, or staged by prefetch) keeps where
    LMDB had it; written back once dirty, that place is handed to the write, and LMDB's index is
    not asked where the row was (out of core, a page of a mapped index read a row). Every place
    handed over is still valid here, and the rows and the log's live counts come out right."""
    checked = []
    valid_hints = rowlog.RowLog.valid_hints
    monkeypatch.setattr(rowlog.RowLog, "valid_hints", lambda self, hints: checked.append(valid_hints(self, hints)) or checked[-1])
    with TieredStore(tmp_path, [TableSpec("t", 4096, 4)], ddr_rows=256, device="cpu") as s:
        s.write("t", np.arange(4096), np.ones((4096, 4), dtype=np.float32))  # no tier holds them: no place known
        s.flush()
        assert not checked
        for k in range(8):  # each batch read into the tier evicts the last one, dirty
            ids = np.arange(256 * k, 256 * (k + 1))
            if prefetched:
                s.prefetch("t", ids).wait()
            s.read("t", ids)
            s.write("t", ids, np.full((256, 4), k + 2, dtype=np.float32))
        s.flush()
        mask = np.concatenate(checked)
        assert len(mask) == 8 * 256 and mask.all()  # 7 batches evicted, the last one flushed
        expect = np.ones((4096, 4), dtype=np.float32)
        expect[: 8 * 256] = np.repeat(np.arange(2, 10), 256)[:, None]
        assert np.array_equal(s.read("t", np.arange(4096)).numpy(), expect)
        log = s._backend._logs["t"]
        places = log.index.get(np.arange(4096))
        assert log.live_rows == 4096 and np.bincount(places >> rowlog._SLOT_BITS, minlength=len(log.live)).tolist() == log.live.tolist()
