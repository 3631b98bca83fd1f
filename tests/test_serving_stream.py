"""Streaming updates (issue #34): deletions in the training store travel in deltas to a
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
from tierstore.serving_stream import Publisher

REPLICA = """
import sys, numpy as np
from tierstore.serving_stream import Replica
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
    import tierstore.serving as serving
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
