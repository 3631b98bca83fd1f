"""One suite of checks run against every RowBackend (tierstore.io.backend): LmdbBackend in
both of its table layouts (log, for tables with num_rows; keyed, for unbounded ids) and
MemoryBackend. A new backend adds a Kind to KINDS and passes this file (docs/backends.md)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from tierstore.errors import TierstoreError
from tierstore.io import LmdbBackend, MemoryBackend, RowBackend, RowCodec, StoreCorruptError
from tierstore.io import memory_backend

ROWS = 1000


@dataclass(frozen=True)
class Kind:
    name: str
    open: Callable[..., RowBackend]  # (path, readonly=, create=, publish_at_flush=)
    num_rows: int | None  # what its tables are opened with
    durable: bool  # rows a sync covered survive the process (kill -9 included)
    # readers of a publish_at_flush writer see none of its rows until it publishes (else: each write)
    whole_publish: bool


KINDS = [
    Kind("lmdb-log", LmdbBackend, ROWS, durable=True, whole_publish=True),
    Kind("lmdb-keyed", LmdbBackend, None, durable=True, whole_publish=False),
    Kind("memory", MemoryBackend, ROWS, durable=False, whole_publish=True),
]


@pytest.fixture(params=KINDS, ids=[k.name for k in KINDS])
def kind(request, tmp_path):
    yield request.param
    memory_backend.forget(tmp_path / "s")
    memory_backend.forget(tmp_path / "copy")


@pytest.fixture
def opened(kind, tmp_path):
    """Open backends of the store at tmp_path/s; closes every one it opened."""
    backends = []

    def open_(readonly=False, publish_at_flush=False, create=True, tables=(("t", 8, 0, "float32", False),)):
        b = kind.open(tmp_path / "s", readonly=readonly, create=create, publish_at_flush=publish_at_flush)
        backends.append(b)
        for name, dim, state_dim, dtype, last_use in tables:
            if not readonly:
                b.write_meta({}, new_tables={name: (last_use, kind.num_rows)})
            b.open_table(name, dim, state_dim, dtype, last_use=last_use, create=not readonly, num_rows=kind.num_rows)
        return b
    yield open_
    for b in reversed(backends):
        b.close()


def rows_of(n: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def test_it_is_a_row_backend(opened):
    assert isinstance(opened(), RowBackend)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rows_read_as_written_in_their_dtype_and_missing_ones_are_reported_missing(opened, dtype):
    b = opened(tables=[("t", 8, 2, dtype, False)])
    ids = np.arange(0, 200, 2)
    rows = rows_of(len(ids), 10)
    assert b.put_rows([("t", ids, rows)]) > 0
    codec = RowCodec(8, 2, dtype)
    asked = np.arange(0, 300)
    got, found = b.get_rows("t", asked)
    assert (found == np.isin(asked, ids)).all()
    np.testing.assert_array_equal(got[found], codec.unpack(codec.pack(rows)))  # as the dtype rounds them
    out = np.full((len(ids), 10), np.nan, dtype=np.float32)
    got, found = b.get_rows("t", ids, out)
    assert got is out and found.all()
    np.testing.assert_array_equal(out, codec.unpack(codec.pack(rows)))
    assert (b.stored_ids("t") == ids).all() and b.table_stats()["t"] == len(ids)


def test_a_row_written_again_reads_as_its_last_write(opened):
    b = opened()
    ids = np.arange(100)
    b.put_rows([("t", ids, rows_of(100, 8, 1))])
    newer = rows_of(50, 8, 2)
    b.put_rows([("t", ids[::2], newer)])
    got, found = b.get_rows("t", ids)
    assert found.all()
    np.testing.assert_array_equal(got[::2], newer)
    np.testing.assert_array_equal(got[1::2], rows_of(100, 8, 1)[1::2])
    assert b.table_stats()["t"] == 100


def test_places_a_read_gives_are_hints_a_write_may_take_stale_or_not(opened):
    """get_rows fills ``places`` (-1 where it keeps none, and for rows not found); put_rows given
    them, some gone stale since (those rows written again, others deleted and written anew),
    writes as it would without."""
    b = opened()
    ids = np.arange(100)
    b.put_rows([("t", ids, rows_of(100, 8, 1))])
    places = np.zeros(120, dtype=np.int64)
    found = b.get_rows("t", np.arange(120), places=places)[1]
    assert ((places >= 0) <= found).all() and not found[100:].any()
    b.put_rows([("t", ids[::3], rows_of(34, 8, 2))])
    b.delete_rows("t", ids[1::3])
    newest = rows_of(120, 8, 3)
    b.put_rows([("t", np.arange(120), newest)], places={"t": places})
    got, found = b.get_rows("t", np.arange(120))
    assert found.all()
    np.testing.assert_array_equal(got, newest)
    assert b.table_stats()["t"] == 120 and (b.stored_ids("t") == np.arange(120)).all()
    for bad in (places[:10], places.astype(np.float64)):  # not a hint a row: refused, nothing written
        with pytest.raises(TierstoreError, match="places of table 't' must be integers, one a row"):
            b.put_rows([("t", np.arange(120), rows_of(120, 8, 4))], places={"t": bad})
    np.testing.assert_array_equal(b.get_rows("t", np.arange(120))[0], newest)


def test_the_backend_keeps_its_own_copy_of_written_rows(opened):
    b = opened()
    rows = rows_of(10, 8)
    b.put_rows([("t", np.arange(10), rows)])
    kept = rows.copy()
    rows[:] = 0
    np.testing.assert_array_equal(b.get_rows("t", np.arange(10))[0], kept)


def test_deletes_report_what_existed_and_are_recorded_when_asked(opened):
    b = opened()
    b.put_rows([("t", np.arange(100), rows_of(100, 8))])
    b.deleted = {}
    assert b.delete_rows("t", np.arange(90, 110)) == 10
    assert not b.get_rows("t", np.arange(90, 110))[1].any()
    assert b.get_rows("t", np.arange(90))[1].all()
    assert (b.stored_ids("t") == np.arange(90)).all() and b.table_stats()["t"] == 90
    assert (np.concatenate(b.deleted["t"]) == np.arange(90, 110)).all()
    assert b.delete_rows("t", np.arange(90, 110)) == 0


def test_last_use_steps_round_trip_and_are_required_where_kept(opened):
    b = opened(tables=[("t", 8, 0, "float32", True), ("plain", 4, 0, "float32", False)])
    assert b.keeps_last_use("t") and not b.keeps_last_use("plain")
    ids = np.arange(10)
    with pytest.raises(ValueError, match="last-use steps") as refused:
        b.put_rows([("t", ids, rows_of(10, 8))])
    assert isinstance(refused.value, TierstoreError)
    assert b.table_stats()["t"] == 0  # the refused write changed nothing
    b.put_rows([("t", ids, rows_of(10, 8))], last_use={"t": np.arange(10, 20)})
    assert (b.get_last_use("t", np.arange(5, 15)) == [15, 16, 17, 18, 19, -1, -1, -1, -1, -1]).all()


def test_sweeps_delete_idle_and_faded_rows_and_go_on_where_they_stopped(opened):
    b = opened(tables=[("t", 4, 0, "float32", True)])
    ids = np.arange(100)
    rows = np.ones((100, 4), np.float32)
    rows[90:] = 0.01  # faded: norm 0.02
    b.put_rows([("t", ids, rows)], last_use={"t": ids})  # row i last used at step i
    b.deleted = {}
    swept = [b.sweep("t", 19, 10) for _ in range(3)]  # bounded work: the first 10, then the next 10...
    assert sum(swept) <= 20 and b.sweep_all("t", 19) + sum(swept) == 20
    assert (b.stored_ids("t") == np.arange(20, 100)).all()
    assert b.sweep_all("t", None, l2_below=0.5) == 10
    assert (b.stored_ids("t") == np.arange(20, 90)).all()
    assert (np.sort(np.concatenate(b.deleted["t"])) == np.r_[0:20, 90:100]).all()


def test_metadata_and_sketches_round_trip(opened):
    b = opened()
    b.write_meta({"format": 1, "tables": [{"name": "t", "dim": 8}]})
    b.put_rows([("t", np.arange(3), rows_of(3, 8))], meta={"updates": {"t": 3}})
    assert b.get_sketch("t") is None
    b.put_sketches({"t": b"\x01\x02"})
    b.publish({"last_flush": 12.5}, {"t": b"\x03"})
    meta = b.read_meta()
    assert meta["format"] == 1 and meta["tables"] == [{"name": "t", "dim": 8}]
    assert meta["updates"] == {"t": 3} and meta["last_flush"] == 12.5
    assert b.get_sketch("t") == b"\x03"
    meta["format"] = 2  # a copy: the stored record does not change
    assert b.read_meta()["format"] == 1


def test_a_table_the_metadata_created_opens_and_a_missing_one_is_damage(opened, kind):
    b = opened(tables=[])
    b.write_meta({}, new_tables={"t": (False, kind.num_rows)})
    b.open_table("t", 8, create=False, num_rows=kind.num_rows)
    assert b.table_stats()["t"] == 0
    with pytest.raises(StoreCorruptError, match="missing"):
        b.open_table("never", 8, create=False, num_rows=kind.num_rows)


def test_a_reader_sees_what_the_writer_published(opened, kind):
    w = opened(publish_at_flush=True)
    w.put_rows([("t", np.arange(10), rows_of(10, 8))])
    w.publish()
    r = opened(readonly=True)
    w.put_rows([("t", np.arange(10, 20), rows_of(10, 8, 1))])
    if kind.whole_publish:
        assert r.get_rows("t", np.arange(20))[1].sum() == 10  # not before the publish
    w.publish()
    got, found = r.get_rows("t", np.arange(20))
    assert found.all()
    np.testing.assert_array_equal(got[10:], rows_of(10, 8, 1))
    with pytest.raises(PermissionError, match="readonly") as refused:
        r.put_rows([("t", np.arange(1), rows_of(1, 8))])
    assert isinstance(refused.value, TierstoreError)


def test_rows_survive_a_close_and_reopen(opened):
    b = opened(tables=[("t", 8, 0, "float32", True)])
    b.put_rows([("t", np.arange(50), rows_of(50, 8))], last_use={"t": np.full(50, 7)})
    b.delete_rows("t", np.arange(5))
    b.publish({"last_flush": 1.0}, {"t": b"s"})
    b.sync()
    b.close()
    b = opened(tables=[("t", 8, 0, "float32", True)])
    got, found = b.get_rows("t", np.arange(50))
    assert (found == (np.arange(50) >= 5)).all()
    np.testing.assert_array_equal(got[5:], rows_of(50, 8)[5:])
    assert (b.get_last_use("t", np.arange(5, 50)) == 7).all()
    assert b.read_meta()["last_flush"] == 1.0 and b.get_sketch("t") == b"s"


CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from tierstore.io import LmdbBackend
    num_rows = None if sys.argv[2] == "None" else int(sys.argv[2])
    b = LmdbBackend(sys.argv[1], publish_at_flush=True)
    b.write_meta({}, new_tables={"t": (False, num_rows)})
    b.open_table("t", 8, num_rows=num_rows)
    b.put_rows([("t", np.arange(100), np.full((100, 8), 3, np.float32))])
    b.publish({"last_flush": 2.0})
    b.sync()
    b.put_rows([("t", np.arange(100, 200), np.full((100, 8), 4, np.float32))])  # never published
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_what_sync_covered_survives_kill_9_of_the_writer(opened, kind, tmp_path):
    if not kind.durable:
        pytest.skip(f"{kind.name} keeps rows in its process only")
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "s"), str(kind.num_rows)], capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
    b = opened()
    got, found = b.get_rows("t", np.arange(100))
    assert found.all() and (got == 3).all()
    assert b.read_meta()["last_flush"] == 2.0


def test_a_copy_opens_as_a_store_with_the_same_rows(opened, kind, tmp_path):
    b = opened()
    b.write_meta({"format": 1})
    b.put_rows([("t", np.arange(30), rows_of(30, 8))])
    b.publish()
    with pytest.raises(ValueError, match="onto itself") as refused:
        b.copy_to(tmp_path / "s")
    assert isinstance(refused.value, TierstoreError)
    dest = b.copy_to(tmp_path / "copy")
    c = kind.open(dest, readonly=True)
    try:
        c.open_table("t", 8, create=False, num_rows=kind.num_rows)
        got, found = c.get_rows("t", np.arange(30))
        assert found.all() and c.read_meta()["format"] == 1
        np.testing.assert_array_equal(got, rows_of(30, 8))
    finally:
        c.close()


def test_compaction_keeps_every_row_and_closes(opened):
    b = opened()
    b.put_rows([("t", np.arange(500), rows_of(500, 8))])
    b.delete_rows("t", np.arange(250))
    b.publish()
    before, after = b.compact()
    assert after <= before
    b = opened()
    got, found = b.get_rows("t", np.arange(500))
    assert (found == (np.arange(500) >= 250)).all()
    np.testing.assert_array_equal(got[250:], rows_of(500, 8)[250:])


def test_a_store_that_is_not_there_is_named_and_not_created(kind, tmp_path):
    with pytest.raises(FileNotFoundError, match="no tierstore at") as missing:
        kind.open(tmp_path / "s", readonly=True)
    assert isinstance(missing.value, TierstoreError)
    with pytest.raises(FileNotFoundError, match="no tierstore at"):
        kind.open(tmp_path / "s", create=False)
    assert not (tmp_path / "s").exists()
