"""One suite of checks run against every implementation of tierstore.EmbeddingStore: the
embedded TieredStore and the daemon client (DaemonStore, attached to a real `tierstore
prefetchd` process over its Unix socket). Each is checked against a plain model of the
rows, and the two against each other."""
from __future__ import annotations

import pickle
import signal

import numpy as np
import pytest
import torch

import tierstore
from tierstore.spec import initial_rows

from test_daemon import ITEM, USER, Daemon, _embedded, no_daemon_outlives_its_test, sockdir  # noqa: F401 (fixtures)


@pytest.fixture(params=["embedded", "daemon"])
def opened(request, tmp_path, sockdir):  # noqa: F811
    """(open a store of USER and ITEM, stop everything) for one implementation."""
    path = tmp_path / "store"
    _embedded(path, tables=[USER, ITEM]).close()
    daemons = []

    def open_(**options):
        if request.param == "embedded":
            return _embedded(path, **options)
        if not daemons:
            daemons.append(Daemon(path, sockdir / "d.sock"))
        return tierstore.open_store(path, daemon=str(daemons[0].sock), claim=["user", "item"], **options)

    def stop():
        for d in daemons:
            d.stop(signal.SIGTERM)
        daemons.clear()
    yield path, open_, stop
    stop()


def test_it_is_an_embedding_store_of_its_tables(opened):
    path, open_, _ = opened
    with open_() as s:
        assert isinstance(s, tierstore.EmbeddingStore)
        if isinstance(s, tierstore.daemon.client.DaemonStore):  # each implements the interface itself
            assert not isinstance(s, tierstore.TieredStore)
        assert s.tables == {"user": USER, "item": ITEM} and s.spec("item") == ITEM
        assert s.device == torch.device("cpu") and s.path == path and s.readonly is False


def test_a_module_takes_any_embedding_store_and_names_the_interface_otherwise(opened):
    path, open_, _ = opened
    with open_() as s:
        bag = tierstore.TieredEmbeddingBag(10_000, 8, store=s, table="user", mode="sum").eval()
        assert torch.equal(bag(torch.tensor([3, 4]), torch.tensor([0])), s.read("user", [3, 4]).sum(0, keepdim=True))
    with pytest.raises(TypeError, match=r"store must be a tierstore.StoreConfig .*an open store.*got dict"):
        tierstore.TieredEmbeddingBag(10_000, 8, store={"user": USER}, table="user")


def test_pickling_it_says_what_to_do(opened):
    path, open_, _ = opened
    with open_() as s:
        with pytest.raises(TypeError, match=r"cannot be pickled or deep-copied.*state_dict\(\)"):
            pickle.dumps(s)


def test_rows_read_as_written_then_as_initial_once_evicted(opened):
    path, open_, _ = opened
    rng = np.random.default_rng(0)
    model = {}
    with open_() as s:
        for _ in range(5):
            ids = rng.integers(0, 10_000, 300)
            values = rng.standard_normal((300, 8)).astype(np.float32)
            s.write("user", ids, values)
            for i, v in zip(ids, values):  # the last of repeated ids wins
                model[int(i)] = v
        probe = np.concatenate([np.array(sorted(model))[:200], rng.integers(0, 10_000, 100)])
        expect = np.stack([model[i] if i in model else initial_rows(USER, np.array([i]))[0] for i in probe.tolist()])
        assert np.array_equal(s.read("user", probe).numpy(), expect)
        out = torch.empty((len(probe), 8))
        assert s.read("user", probe, out=out) is out and np.array_equal(out.numpy(), expect)
        gone = np.array(sorted(model))[:50]
        assert s.evict("user", np.concatenate([gone, gone[:5]])) == 50
        assert np.array_equal(s.read("user", gone).numpy(), initial_rows(USER, gone))


def test_state_travels_with_the_rows_and_survives_a_reopen_after_flush(opened):
    path, open_, stop = opened
    ids = np.array([5, 2**40, 7])
    rows = np.arange(18, dtype=np.float32).reshape(3, 6)  # 4 weights + 2 state floats
    with open_() as s:
        s.write("item", ids, rows, with_state=True)
        s.flush()
        assert np.array_equal(s.read("item", ids, with_state=True).numpy(), rows)
        assert np.array_equal(s.read("item", ids).numpy(), rows[:, :4])
    stop()
    with _embedded(path, readonly=True) as oracle:  # the file itself, opened in this process
        assert np.array_equal(oracle.read("item", ids, with_state=True).numpy(), rows)


def test_a_prefetched_read_equals_a_plain_one(opened):
    path, open_, _ = opened
    ids = torch.arange(0, 4000, 7)
    with open_() as s:
        s.write("user", ids[:100], np.ones((100, 8), dtype=np.float32))
        ticket = s.prefetch("user", ids)
        ticket.wait()
        assert torch.equal(s.read("user", ids), torch.from_numpy(np.concatenate(
            [np.ones((100, 8), dtype=np.float32), initial_rows(USER, ids[100:].numpy())])))


def test_a_training_module_gets_one_trainer_per_table(opened):
    """store.trainer(table), the seam tierstore.nn and tierstore.distributed use beside read and write."""
    from tierstore.precision import update_key
    from tierstore.engine.trainer import TableTrainer

    path, open_, _ = opened
    with open_() as s:
        t = s.trainer("item")
        assert isinstance(t, TableTrainer) and t.table == "item" and s.trainer("item") is t
        with pytest.raises(KeyError, match="unknown table 'nope'.*item"):
            s.trainer("nope")
        uid = torch.tensor([1, 3, 5])
        assert t.admitted(uid) is None  # no admission: every update is kept
        rows = torch.arange(18, dtype=torch.float32).reshape(3, 6)
        t.write_update(uid, rows)
        assert t.written == 1
        assert torch.equal(t.reread(uid), rows) and torch.equal(s.read("item", uid, with_state=True), rows)
        assert [t.update_key(), t.update_key()] == [update_key("item", 0), update_key("item", 1)]
        with t.resident(uid) as hit:  # pinned rows where the store holds them itself, else None: the caller reads
            assert hit is None or torch.equal(hit.tier.weights[hit.slots], rows[:, :4])


def test_its_tables_step_over_a_row_source_that_gives_back_what_it_was_given(opened):
    """Below each store's tiers, a tierstore.engine.source.RowSource: the embedded store's
    backend rows (staging, write-back queue, LMDB) or a daemon client's daemon. Both
    stores run TableStore's one step over theirs."""
    from tierstore.engine.source import RowSource
    from tierstore.engine.table import TableStore

    path, open_, _ = opened
    with open_(hbm_rows=16) as s:
        t = s._hbm["item"] if isinstance(s, tierstore.daemon.client.DaemonStore) else s._table("item")
        source = t._shared.source
        assert isinstance(t, TableStore) and isinstance(source, RowSource)
        with s._lock:  # as a table calls it
            ids = torch.tensor([5, 7, 2**40])  # sorted unique, in no tier
            initial = initial_rows(ITEM, ids.numpy())
            assert np.array_equal(source.fetch(t, ids, None).numpy(), initial)
            rows = np.arange(18, dtype=np.float32).reshape(3, 6)  # 4 weights + 2 state floats
            source.write_back(t, ids.numpy(), rows)
            out = np.empty((3, 6), dtype=np.float32)
            assert np.array_equal(source.fetch(t, ids, out).numpy(), rows) and np.array_equal(out, rows)
            source.write(t, ids[:2], torch.full((2, 4), -1.0), 4)  # weights only: each row keeps its state
            expect = rows.copy()
            expect[:2, :4] = -1.0
            assert np.array_equal(source.fetch(t, ids, None).numpy(), expect)
        assert np.array_equal(s.read("item", ids, with_state=True).numpy(), expect)  # the store's own step sees them
        assert s.resident_rows("item")["hbm"] == 3


def test_bad_calls_are_named_and_change_nothing(opened):
    path, open_, _ = opened
    with open_() as s:
        before = s.read("user", np.arange(10))
        with pytest.raises(KeyError, match="user"):
            s.read("nope", [1])
        with pytest.raises(TypeError, match="integers"):
            s.read("user", torch.tensor([1.5]))
        with pytest.raises(ValueError):
            s.write("user", [1, 2], np.ones((3, 8), dtype=np.float32))
        assert torch.equal(s.read("user", np.arange(10)), before)
        stats = s.stats()
        assert {"hbm", "ddr", "ssd"} <= set(stats)
        # a daemon client's DDR tier is the daemon's: it counts only the tier it holds
        held = {"hbm"} if isinstance(s, tierstore.daemon.client.DaemonStore) else {"hbm", "ddr"}
        assert set(s.resident_rows("user")) == held
    s.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        s.read("user", [1])
