"""Streaming updates: deletions in the training store travel in deltas to a
replica in another process. Real LMDB, a real replica process."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import tierstore.io.lmdb_backend as lmdb_backend
from tierstore import RowInit, TableSpec, TieredStore
from tierstore.io.serving_layout import RowFormat
from tierstore.serving.stream import Publisher

REPLICA = """
import sys, numpy as np
from tierstore.serving.stream import Replica
replica = Replica(sys.argv[1], hbm_rows=64, ddr_rows=64, device="cpu")
for line in sys.stdin:  # a file to write every row to, after applying what is published
    version = replica.poll()
    np.savez(line.strip(), **{n: replica.rows(n, np.arange(s.num_rows)).numpy() for n, s in replica.store.tables.items()})
    print(version, flush=True)
"""


class ReplicaProcess:
    def __init__(self, directory, tmp_path):
        self.tmp_path, self.asked = tmp_path, 0
        self.proc = subprocess.Popen([sys.executable, "-c", REPLICA, str(directory)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def rows(self) -> tuple[int, dict[str, np.ndarray]]:
        """(version served, every table's rows) once the replica has applied what is published."""
        self.asked += 1
        out = self.tmp_path / f"rows-{self.asked}.npz"
        self.proc.stdin.write(f"{out}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()[-3000:]
        with np.load(out) as got:
            return int(line), dict(got)

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0, self.proc.stderr.read()[-3000:]


@pytest.mark.parametrize("layout", ["log", "keyed"])
def test_deleted_evicted_and_expired_rows_leave_a_replica_in_another_process(tmp_path, monkeypatch, layout):
    """Rows evicted, expired by TTL (idle ttl_steps steps: the store's sweep deletes them) and
    below evict_l2_below on the training store: the replica, which had served their trained
    values, serves what the store reads for them (their initial values) after the next delta.
    Both LMDB layouts: each deletes rows its own way."""
    monkeypatch.setattr(lmdb_backend, "NEW_TABLE_LAYOUT", layout)
    specs = [TableSpec("evict", 200, 8, state_dim=8, init=RowInit.normal(0, 0.1, seed=1)),
             TableSpec("ttl", 200, 8, init=RowInit.uniform(-1, 1, seed=2), ttl_steps=2),
             TableSpec("l2", 200, 8, init=RowInit.uniform(1, 2, seed=3), evict_l2_below=0.5)]
    rng = np.random.default_rng(0)
    with TieredStore(tmp_path / "train", tables=specs, hbm_rows=16, ddr_rows=16, device="cpu") as store:
        pub = Publisher(store, tmp_path / "pub", dtype="float32")
        replica = ReplicaProcess(tmp_path / "pub", tmp_path)
        try:
            for s in specs:
                store.write(s.name, np.arange(150), rng.normal(0, 3, (150, 8)).astype(np.float32))
            trained = {s.name: store.peek(s.name, np.arange(200)).numpy() for s in specs}
            version = pub.publish()
            served, rows = replica.rows()
            assert served == version
            for name in trained:
                assert np.array_equal(rows[name], trained[name]), name

            assert store.evict("evict", np.arange(0, 150, 3)) == 50
            for _ in range(3):  # rows 0..99 of "ttl" idle for 3 steps > ttl_steps
                store.read("ttl", np.arange(100, 150))
            store.write("l2", np.arange(0, 40), np.full((40, 8), 0.01, np.float32))  # below evict_l2_below
            now = {s.name: store.peek(s.name, np.arange(200)).numpy() for s in specs}
            gone = {name: (now[name] != trained[name]).any(axis=1).sum() for name in now}
            assert gone == {"evict": 50, "ttl": 100, "l2": 40}  # what the store reads as initial now
            version = pub.publish()
            served, rows = replica.rows()
            assert served == version
            for name in now:
                assert np.array_equal(rows[name], now[name]), f"table {name!r}: the replica serves rows the store deleted"
        finally:
            replica.close()


def test_a_tier_holding_the_whole_table_pools_on_the_ids(tmp_path, monkeypatch):
    """A tier with room for every row keeps row id in slot id: once all are resident a lookup
    neither maps ids to slots nor marks their use (the int8 lookup's bookkeeping beside the
    kernel), and gives the rows a store without tiers gives, deltas applied included."""
    import tierstore.serving.store as serving
    from tierstore import ServingStore, export

    with TieredStore(tmp_path / "train", tables=[TableSpec("t", 300, 8)], device="cpu") as store:
        store.write("t", np.arange(0, 300, 2), np.random.default_rng(0).normal(0, 1, (150, 8)).astype(np.float32))
    export(tmp_path / "train", tmp_path / "serve", dtype="int8")
    ids, offsets = torch.randint(0, 300, (500,), generator=torch.Generator().manual_seed(0)), torch.arange(0, 501, 5)
    with ServingStore(tmp_path / "serve", hbm_rows=300, device="cpu") as whole, ServingStore(tmp_path / "serve") as plain:
        whole.rows("t", np.random.default_rng(1).permutation(300))  # every row resident, in no order

        def unused(*args):
            raise AssertionError("a whole tier looked ids up or marked their use")
        monkeypatch.setattr(serving._Tier, "lookup", unused)
        monkeypatch.setattr(serving._Tier, "mark", unused)
        assert torch.equal(whole.lookup("t", ids, offsets), plain.lookup("t", ids, offsets))
        monkeypatch.undo()
        packed = RowFormat(8, "int8").encode(np.full((3, 8), 5.0, np.float32))
        for s in (whole, plain):
            s.apply(1, {"t": (np.array([1, 2, 3]), packed, np.array([4]))})
        assert torch.equal(whole.lookup("t", ids, offsets), plain.lookup("t", ids, offsets))
        assert torch.equal(whole.rows("t", np.arange(300)), plain.rows("t", np.arange(300)))
        assert whole.stats()["t"]["hbm_resident"] == 300


# -- hostile deltas and directories: each ends in a named error, the version served kept whole ---------

import json  # noqa: E402
import os  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import tierstore.io.serving_layout as serving_layout  # noqa: E402
from tierstore.serving.stream import DeltaCorruptError, DeltaGapError, Replica, encode_delta  # noqa: E402


def two_tables(tmp_path):
    """A store of tables "a" and "b" (100 x 8), its Publisher (float32) and version 1 published:
    every row of both tables 1.0."""
    store = TieredStore(tmp_path / "train", tables=[TableSpec("a", 100, 8), TableSpec("b", 100, 8)], device="cpu")
    pub = Publisher(store, tmp_path / "pub", dtype="float32")
    for name in ("a", "b"):
        store.write(name, np.arange(100), np.ones((100, 8), np.float32))
    assert pub.publish() == 1
    return store, pub


def with_header(data: bytes, change) -> bytes:
    """The delta ``data`` with its JSON header changed by ``change(header)``, its CRC-32 made right again."""
    n = struct.unpack_from("<I", data, 8)[0]
    header = json.loads(data[12: 12 + n])
    change(header)
    head = json.dumps(header).encode()
    body = data[:8] + struct.pack("<I", len(head)) + head + data[12 + n: -4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_delta_that_does_not_fit_the_tables_is_refused_whole(tmp_path):
    """Deltas whose checksum is right but whose contents do not fit the replica's tables: an id
    past num_rows in the second table (the first table's rows would be applied before it was
    found), negative, unsorted or repeated ids, deleted ids out of range or also written, an
    unknown table, rows of another size or dtype, no version. Each raises DeltaCorruptError naming
    the file; the replica serves version 1 whole, in every tier, and applies the next good delta."""
    store, pub = two_tables(tmp_path)
    fmt = RowFormat(8, "float32")
    twos, none = fmt.encode(np.full((2, 8), 2.0, np.float32)), np.zeros(0, np.int64)

    def delta(**tables):
        return encode_delta(2, time.time(), {n: ("float32", *t) for n, t in tables.items()})
    good_a = (np.array([1, 2]), twos, none)
    bad = {
        "id past num_rows in the second table": delta(a=good_a, b=(np.array([1, 100]), twos, none)),
        "negative id": delta(a=(np.array([-1, 2]), twos, none)),
        "unsorted ids": delta(a=(np.array([5, 2]), twos, none)),
        "repeated id": delta(a=(np.array([2, 2]), twos, none)),
        "deleted id out of range": delta(a=good_a, b=(none, fmt.encode(np.zeros((0, 8), np.float32)), np.array([100]))),
        "id written and deleted": delta(a=(np.array([1, 2]), twos, np.array([2]))),
        "unknown table": delta(a=good_a, c=good_a),
        "rows of another size": encode_delta(2, time.time(), {"a": ("float16", np.array([1, 2]), twos[:, :16], none)}),
        "rows of another dtype": with_header(delta(a=good_a), lambda h: h["tables"][0].update(dtype="int8")),
        "no version": with_header(delta(a=good_a), lambda h: h.pop("version")),
        "a version that is no integer": with_header(delta(a=good_a), lambda h: h.update(version="2")),
    }
    path = tmp_path / "pub" / "delta-00000002.bin"
    try:
        for hbm in (0, 100):  # no tier, and every row in the HBM tier (updated in place)
            replica = Replica(tmp_path / "pub", hbm_rows=hbm, device="cpu")
            replica.rows("a", np.arange(100)), replica.rows("b", np.arange(100))
            for what, data in bad.items():
                path.write_bytes(data)
                with pytest.raises(DeltaCorruptError, match="delta-00000002.bin is damaged") as e:
                    replica.poll()
                assert type(e.value) is DeltaCorruptError, what
                assert replica.version == 1, what
                for name in ("a", "b"):
                    assert (replica.rows(name, np.arange(100)).numpy() == 1).all(), f"{what}: table {name} changed"
            path.write_bytes(delta(a=good_a, b=good_a))
            assert replica.poll() == 2
            assert np.array_equal(replica.rows("b", [0, 1, 2]).numpy()[:, 0], [1, 2, 2])
            replica.close()
            path.unlink()
    finally:
        store.close()


def test_a_replica_opens_at_the_version_before_a_damaged_delta_and_leaks_nothing(tmp_path, monkeypatch):
    """A Replica opened while the next delta is damaged serves the last version it could apply;
    poll() raises until the delta is whole. A replica whose opening fails otherwise closes its
    serving store (no LMDB environment left open)."""
    store, pub = two_tables(tmp_path)
    try:
        store.write("a", [5], np.full((1, 8), 2.0, np.float32))
        pub.publish()
        path = tmp_path / "pub" / "delta-00000002.bin"
        whole = path.read_bytes()
        path.write_bytes(whole[:-10])
        replica = Replica(tmp_path / "pub", device="cpu")
        assert replica.version == 1 and (replica.rows("a", np.arange(100)).numpy() == 1).all()
        with pytest.raises(DeltaCorruptError, match="delta-00000002.bin is damaged"):
            replica.poll()
        path.write_bytes(whole)
        assert replica.poll() == 2 and float(replica.rows("a", [5])[0, 0]) == 2.0
        replica.close()
        assert not serving_layout._OPEN

        def fails(self):
            raise OSError("injected: the directory went away")
        monkeypatch.setattr(Replica, "_poll", fails)
        with pytest.raises(OSError, match="injected"):
            Replica(tmp_path / "pub", device="cpu")
        assert not serving_layout._OPEN, "a replica that failed to open left its serving store open"
    finally:
        store.close()


def test_a_missing_delta_between_published_ones_is_a_named_gap(tmp_path):
    """Delta 2 deleted, 3 and 4 published, no export after 1: poll() raises DeltaGapError (a
    DeltaCorruptError) naming the missing delta and those after it, the replica serves version 1,
    and lag_seconds is the age of delta 3, the oldest file published after it. A compaction
    lets the replica catch up."""
    store, pub = two_tables(tmp_path)
    try:
        for k in (2, 3, 4):
            store.write("a", [k], np.full((1, 8), float(k), np.float32))
            pub.publish()
        now = time.time()
        for k, age in ((3, 300), (4, 100)):
            os.utime(tmp_path / "pub" / f"delta-{k:08d}.bin", (now - age, now - age))
        (tmp_path / "pub" / "delta-00000002.bin").unlink()
        replica = Replica(tmp_path / "pub", device="cpu")
        assert replica.version == 1
        for _ in range(2):  # every poll, not only the first
            with pytest.raises(DeltaGapError, match=r"delta-00000002.bin is missing, but deltas 3 to 4 .* serving version 1"):
                replica.poll()
        m = replica.metrics()
        assert (m["version"], m["published_version"], m["lag_versions"]) == (1, 4, 3)
        assert 300 <= m["lag_seconds"] < 400, m
        assert pub.compact() == 4
        assert replica.poll() == 4
        assert np.array_equal(replica.rows("a", [1, 2, 3, 4]).numpy()[:, 0], [1, 2, 3, 4])
        assert replica.metrics()["lag_seconds"] == 0.0
        replica.close()
    finally:
        store.close()


def test_a_replica_names_a_bad_policy_and_a_missing_directory(tmp_path):
    from tierstore import errors
    from tierstore.serving.stream import Replica

    with pytest.raises(errors.PathNotFoundError, match=r"nothing is not a directory; pass the directory a .*Publisher"):
        Replica(tmp_path / "nothing")
    with pytest.raises(errors.SettingError, match="unknown eviction policy 'mru'"):
        Replica(tmp_path, policy="mru")  # checked before the directory is read: it holds no export
    with pytest.raises(errors.PathNotFoundError, match="no export in"):
        Replica(tmp_path)
