"""Errors of one type, naming the file, at every entry point: a
full disk is OSError ENOSPC wherever LMDB writes (commits, checkpoints, compaction);
bad ids get the store's ValueError/TypeError through the module and the daemon
client too; a damaged sharded checkpoint's tables.json and a table database lost
from data.mdb are StoreCorruptError naming them. Real LMDB, a real daemon process, a
real tmpfs, a real one-rank gloo checkpoint; faults are made on the files."""
from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import tierstore
from tierstore import StoreCorruptError, TableSpec, TieredEmbeddingBag, TieredStore

SPEC = TableSpec("t", 1000, 8)


def open_store(path, *args, **kwargs) -> TieredStore:
    return TieredStore(path, *args, device="cpu", registry=CollectorRegistry(), **kwargs)


def run_child(code: str, *args, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*wrapper, sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


# -- a full disk -------------------------------------------------------------------------

def test_checkpoint_and_compact_on_a_full_disk_raise_enospc_naming_the_file_and_change_nothing(tmp_path):
    """A real full disk (a 24 MiB tmpfs in a user namespace of the child, as
    test_faults.py's) with room for a flush but not for a copy of the store: checkpoint()
    and compact() raise OSError ENOSPC naming what they write, leave no copy behind and
    the store whole; with the space back both succeed."""
    r = run_child("""
        import os, subprocess, sys
        import numpy as np, torch
        from prometheus_client import CollectorRegistry
        from tierstore import TableSpec, TieredStore
        disk = sys.argv[1]
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tierstore-test", disk], check=True)
        path = os.path.join(disk, "s")
        def opened(**kw):
            return TieredStore(path, device="cpu", registry=CollectorRegistry(), **kw)
        with TieredStore(path, [TableSpec("t", None, 16)], device="cpu", registry=CollectorRegistry()) as s:
            s.write("t", np.arange(20000), torch.arange(20000.0).unsqueeze(1).expand(20000, 16))
        with open(os.path.join(disk, "ballast"), "wb") as f:  # all but 512 KiB: a flush fits, a copy does not
            st = os.statvfs(disk)
            f.write(bytes(st.f_bavail * st.f_frsize - (512 << 10)))
        def report(what, call):
            try:
                call()
                print(what, "OK")
            except OSError as e:
                print(what, type(e).__name__, e.errno, e.filename, "|", e)
            except Exception as e:
                print(what, "WRONG", type(e).__module__, type(e).__name__, e)
        with opened() as s:
            report("CHECKPOINT", lambda: s.checkpoint(os.path.join(disk, "ckpt")))
            report("CHECKPOINT-UNCOMPACTED", lambda: s.checkpoint(os.path.join(disk, "ckpt"), compact=False))
        report("COMPACT", lambda: TieredStore.compact(path))
        print("LEFT", sorted(os.listdir(disk)), sorted(os.listdir(path)))
        with opened(readonly=True) as s:
            print("WHOLE", bool((s.read("t", np.arange(20000))[:, 0] == torch.arange(20000.0)).all()))
        os.remove(os.path.join(disk, "ballast"))
        TieredStore.compact(path)
        with opened() as s:
            s.checkpoint(os.path.join(disk, "ckpt"))
        for p in (path, os.path.join(disk, "ckpt")):
            with TieredStore(p, readonly=True, device="cpu", registry=CollectorRegistry()) as s:
                print("AFTER", bool((s.read("t", np.arange(20000))[:, 0] == torch.arange(20000.0)).all()))
        """, tmp_path, wrapper=("unshare", "--user", "--map-root-user", "--mount"))
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith(("CHECKPOINT", "COMPACT")))
    store, ckpt = tmp_path / "s", tmp_path / "ckpt"
    for what, file in (("CHECKPOINT", ckpt / "data.mdb"), ("CHECKPOINT-UNCOMPACTED", ckpt / "data.mdb"),
                       ("COMPACT", store / "data.mdb.compacting")):
        # in the child's mount namespace the tmpfs is at tmp_path: the paths it names are these
        assert out[what].startswith(f"DiskFullError {errno.ENOSPC} {file} |"), (what, out[what])
        assert "disk full" in out[what] and str(file) in out[what] and "free disk space" in out[what], out[what]
    assert "LEFT ['ballast', 's'] ['data.mdb', 'lock.mdb', 'writer.lock']" in r.stdout, r.stdout
    assert "WHOLE True" in r.stdout and r.stdout.count("AFTER True") == 2, r.stdout


# -- ids the store refuses, through every entry point --------------------------------------

BAD_IDS = [
    ("meta", lambda: torch.tensor([1, 2], device="meta"), ValueError, "ids for table 't' are a tensor on the meta device"),
    ("float requiring grad", lambda: torch.tensor([1.0, 2.0], requires_grad=True), TypeError,
     "ids for table 't' must be integers, got a tensor of torch.float32"),
]


def test_bad_ids_through_the_module_get_the_stores_errors(tmp_path):
    emb = TieredEmbeddingBag(1000, 8, mode="sum", path=tmp_path / "s", hbm_rows=8, device="cpu", padding_idx=0,
                             optimizer=tierstore.optim.SGD(lr=0.1))
    emb(torch.tensor([1, 2, 3]), torch.tensor([0])).sum().backward()  # some cache state to keep
    before = (emb.store.stats(), emb.store.resident_rows("t0"))
    for name, ids, error, message in BAD_IDS:
        message = message.replace("'t'", "'t0'")
        for bags in ((ids(), torch.tensor([0])), (ids().reshape(1, 2),)):  # 1-D with offsets, 2-D
            with pytest.raises(error) as e:
                emb(*bags)
            if name == "meta":  # float ids: BagTypeError, a TypeError (and a RuntimeError, as torch's)
                assert message in str(e.value)
        with pytest.raises(error, match=message) as e:
            emb.prefetch(ids()).wait()  # padding_idx: the ids are masked first
        assert isinstance(e.value, tierstore.TierstoreError), type(e.value)
    assert (emb.store.stats(), emb.store.resident_rows("t0")) == before
    emb.close()


def test_meta_offsets_and_weights_through_the_module_are_named(tmp_path):
    emb = TieredEmbeddingBag(1000, 8, mode="sum", path=tmp_path / "s", device="cpu")
    with pytest.raises(ValueError, match="offsets for table 't0' are a tensor on the meta device"):
        emb(torch.tensor([1, 2]), torch.tensor([0], device="meta"))
    with pytest.raises(ValueError, match="per_sample_weights for table 't0' are a tensor on the meta device"):
        emb(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2, device="meta"))
    emb.close()


@pytest.fixture
def daemon_store(tmp_path):
    """A real `tierstore prefetchd` over a store with table "t", and its socket."""
    path = tmp_path / "store"
    with open_store(path, [SPEC]) as s:
        s.write("t", np.arange(10), np.ones((10, 8), dtype=np.float32))
    sockdir = Path(tempfile.mkdtemp(prefix="tse-"))  # short: Unix socket paths are limited to ~104 bytes
    sock = sockdir / "d.sock"
    proc = subprocess.Popen([sys.executable, "-m", "tierstore.tools.cli", "prefetchd", str(path), "--socket", str(sock),
                             "--ddr-rows", "100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), f"daemon did not start: {line!r}"
        yield path, sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def test_bad_ids_through_the_daemon_client_get_the_stores_errors(daemon_store):
    path, sock = daemon_store
    for hbm_rows in (0, 8):  # ids the daemon serves; ids a client's HBM tier holds first
        client = tierstore.open_store(path, daemon=str(sock), claim=["t"], hbm_rows=hbm_rows)
        try:
            for _, ids, error, message in BAD_IDS:
                for call in (lambda: client.read("t", ids()), lambda: client.write("t", ids(), torch.zeros(2, 8)),
                             lambda: client.evict("t", ids()), lambda: client.prefetch("t", ids()).wait()):
                    with pytest.raises(error, match=message) as e:
                        call()
                    assert isinstance(e.value, tierstore.TierstoreError), type(e.value)  # whichever side checks the ids
            emb = TieredEmbeddingBag(1000, 8, mode="sum", store=client, table="t")
            for name, ids, error, message in BAD_IDS:
                with pytest.raises(error) as e:
                    emb(ids(), torch.tensor([0]))
                assert name != "meta" or message in str(e.value)
                with pytest.raises(error, match=message):
                    emb.prefetch(ids()).wait()
            assert torch.equal(client.read("t", [1, 2]), torch.ones(2, 8))  # nothing changed, the connection serves
        finally:
            client.close()


# -- a damaged tables.json in a sharded checkpoint -----------------------------------------

@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """A real checkpoint of a one-rank ShardedEmbeddingBagCollection (gloo, in a child),
    which restores as it is."""
    d = tmp_path_factory.mktemp("sharded")
    r = run_child("""
        import sys
        from pathlib import Path
        import torch, torch.distributed as dist
        from prometheus_client import CollectorRegistry
        from tierstore import TableSpec, optim
        from tierstore.distributed import ShardedEmbeddingBagCollection
        from tierstore.training.sharding import Shard, ShardingPlan, TablePlan
        d = Path(sys.argv[1])
        dist.init_process_group("gloo", init_method=f"file://{d / 'pg'}", rank=0, world_size=1)
        plan = ShardingPlan(1, {"t": TablePlan("t", "table", (Shard(0, None, None, 0, 8),))})
        m = ShardedEmbeddingBagCollection([TableSpec("t", 100, 8)], plan, d / "store", optimizer=optim.SGD(lr=0.1),
                                          registry=CollectorRegistry())
        m({"t": (torch.tensor([1, 2, 3]), torch.tensor([0]))})["t"].sum().backward()
        m.checkpoint(d / "ckpt")
        # the undamaged checkpoint restores
        r = ShardedEmbeddingBagCollection.from_checkpoint(d / "ckpt", plan=plan, path=d / "restored", optimizer=optim.SGD(lr=0.1),
                                                          registry=CollectorRegistry())
        assert torch.equal(r.read("t", torch.arange(100), with_state=True), m.read("t", torch.arange(100), with_state=True))
        r.close()
        m.close()
        dist.destroy_process_group()
        print("DONE")
        """, d)
    assert r.returncode == 0 and "DONE" in r.stdout, r.stderr[-3000:]
    return d / "ckpt"


def _damaged(text: str) -> str:
    specs = json.loads(text)
    del specs[0]["init"]
    return json.dumps(specs)


@pytest.mark.parametrize("damage,what", [
    (lambda text: text[: len(text) // 2], "not JSON, cut short or overwritten"),
    (_damaged, "table spec 0 lacks the key 'init'"),
    (lambda text: "{not json", "not JSON"),
    (lambda text: json.dumps({"t": 1}), "holds a JSON dict, not the list of table specs"),
    (lambda text: json.dumps([{**json.loads(text)[0], "dim": -1}]), "table spec 0 is unreadable (ValueError"),
], ids=["truncated", "key dropped", "bad JSON", "not a list", "bad field"])
def test_damaged_tables_json_of_a_sharded_checkpoint_is_named(sharded_checkpoint, tmp_path, damage, what):
    from tierstore.distributed import ShardedEmbeddingBagCollection
    from tierstore.training.sharding import ShardingPlan

    ckpt = shutil.copytree(sharded_checkpoint, tmp_path / "ckpt")
    tables = ckpt / "tables.json"
    tables.write_text(damage(tables.read_text()))
    plan = ShardingPlan.from_json((ckpt / "plan.json").read_text())
    # the files are read before the process group is: the error comes before any collective
    with pytest.raises(StoreCorruptError) as e:
        ShardedEmbeddingBagCollection.from_checkpoint(ckpt, plan=plan, path=tmp_path / "restored")
    assert f"{tables} is damaged" in str(e.value) and what in str(e.value), str(e.value)
    assert not (tmp_path / "restored").exists()


# -- a table database lost from data.mdb -------------------------------------------------------

TTL = TableSpec("u", None, 4, ttl_steps=10)


@pytest.mark.parametrize("lost", [b"s:t", b"t:u", b"u:u"])  # t: a bounded table, in the log layout
def test_a_table_database_dropped_from_lmdb_is_damage_for_a_writer_and_a_reader(tmp_path, lost):
    path = tmp_path / "s"
    with open_store(path, [SPEC, TTL]) as s:
        s.write("t", np.arange(10), np.ones((10, 8), dtype=np.float32))
        s.write("u", np.arange(10), np.ones((10, 4), dtype=np.float32))
    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(lost, txn=txn), delete=True)
    env.close()
    table = lost.decode()[2:]
    for kwargs in ({}, {"tables": [SPEC, TTL]}, {"readonly": True}):
        with pytest.raises(StoreCorruptError, match=rf"data.mdb is damaged: the database '{lost.decode()}' of table "
                                                     rf"'{table}' is missing"):
            open_store(path, **kwargs)
    env = lmdb.open(str(path), max_dbs=16, readonly=True)
    with env.begin() as txn:
        assert txn.get(lost) is None, "the writer recreated the lost database"
    env.close()


def test_a_new_table_gets_its_databases_with_the_metadata_naming_it(tmp_path):
    path = tmp_path / "s"
    with open_store(path, [SPEC]) as s:
        s.write("t", [1], np.ones((1, 8), dtype=np.float32))
    with open_store(path, [SPEC, TTL]) as s:  # a table new to an existing store is created
        s.write("u", [1], np.full((1, 4), 2.0, dtype=np.float32))
    env = lmdb.open(str(path), max_dbs=16, readonly=True)
    with env.begin() as txn:
        assert all(txn.get(k) is not None for k in (b"s:t", b"t:u", b"u:u"))
    env.close()
    with open_store(path, readonly=True) as s:
        assert s.read("u", [1])[0, 0] == 2.0 and s.read("t", [1])[0, 0] == 1.0


def test_an_error_the_daemon_raises_reaches_the_client_as_its_class(daemon_store):
    """Refusals made in the daemon process (a claim on rows another client claims, a
    claim of a table the store lacks) reach the client as the class the daemon raised,
    so `except TierstoreError` catches them there too; messages and builtin bases are kept."""
    from tierstore.errors import UnknownTableError, WriteRefusedError

    path, sock = daemon_store
    first = tierstore.open_store(path, daemon=str(sock), claim=["t"])
    try:
        with pytest.raises(WriteRefusedError, match="write claim refused") as e:
            tierstore.open_store(path, daemon=str(sock), claim=["t"])
        assert isinstance(e.value, PermissionError)
        with pytest.raises(UnknownTableError, match="claims name unknown tables") as e:
            tierstore.open_store(path, daemon=str(sock), claim=["nope"])
        assert isinstance(e.value, KeyError)
        assert torch.equal(first.read("t", [1, 2]), torch.ones(2, 8))  # the daemon serves on
    finally:
        first.close()
