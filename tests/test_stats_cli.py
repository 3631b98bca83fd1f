"""`tierstore stats PATH`: real stores on disk, a real writer in another
process, the real console script."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import lmdb
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import tierstore
from tierstore.tools.cli import main
from tierstore.tools.stats import read_facts

# A writer process driven over stdin: "write LO HI" writes rows LO..HI-1 (no
# cache, so straight to LMDB), "burst STOP" writes batches of 500 new rows
# without waiting, flushing every tenth, until the file STOP exists, then flushes and
# answers "ok N" with the batches written, "flush", "exit". It answers each command with a line.
WRITER = textwrap.dedent("""
    import os, sys, numpy as np, tierstore
    from prometheus_client import CollectorRegistry
    clock = iter(range(1_000, 10**9, 1_000))
    store = tierstore.TieredStore(sys.argv[1], [tierstore.TableSpec("t", 10**7, 4), tierstore.TableSpec("u", None, 2, state_dim=1)],
                                  device="cpu", registry=CollectorRegistry(), clock=lambda: float(next(clock)))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *a = line.split()
        if cmd == "write":
            ids = np.arange(int(a[0]), int(a[1]))
            store.write("t", ids, np.ones((len(ids), 4), dtype=np.float32))
        elif cmd == "burst":
            print("started", flush=True)
            i = 0
            while not os.path.exists(a[0]):
                ids = np.arange(i * 500, (i + 1) * 500) + 1_000_000
                store.write("t", ids, np.ones((500, 4), dtype=np.float32))
                i += 1
                if i % 10 == 0:
                    store.flush()
            store.flush()
            print("ok", i, flush=True)
            continue
        elif cmd == "flush":
            store.flush()
        elif cmd == "exit":
            store.close()
            print("closed", flush=True)
            break
        print("ok", flush=True)
""")


class Writer:
    def __init__(self, path):
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def send(self, line: str, reply: str = "ok") -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit", "closed")
        assert self.proc.wait(timeout=60) == 0


@pytest.fixture
def writer(tmp_path):
    w = Writer(tmp_path / "s")
    yield w
    if w.proc.poll() is None:
        w.proc.kill()
        w.proc.wait()


def stats_json(path, capsys) -> dict:
    assert main(["stats", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_stats_while_a_writer_process_holds_the_store(tmp_path, writer, capsys):
    path = tmp_path / "s"
    with pytest.raises(tierstore.StoreLockedError):  # the writer really holds it
        tierstore.TieredStore(path)
    facts = stats_json(path, capsys)
    assert [(t["name"], t["num_rows"], t["dim"], t["state_dim"]) for t in facts["tables"]] == [("t", 10**7, 4, 0), ("u", None, 2, 1)]
    assert [t["rows_on_disk"] for t in facts["tables"]] == [0, 0]
    assert facts["last_flush"] is None and facts["last_flush_utc"] is None

    writer.send("write 0 100")
    time.sleep(0.2)  # the writer's thread commits queued writes shortly after write() returns
    facts = stats_json(path, capsys)
    assert facts["tables"][0]["rows_on_disk"] == 0  # written, not flushed: stats shows the last flush
    assert facts["last_flush"] is None

    writer.send("flush")
    facts = stats_json(path, capsys)
    assert facts["tables"][0]["rows_on_disk"] == 100
    assert facts["tables"][0]["payload_bytes"] == 100 * (8 + 4 * 4)
    assert facts["last_flush"] == 1_000.0  # the writer's injected clock
    writer.send("write 50 300")  # overlaps: 250 new rows
    time.sleep(0.2)
    assert stats_json(path, capsys)["tables"][0]["rows_on_disk"] == 100
    writer.send("flush")
    facts = stats_json(path, capsys)
    assert facts["tables"][0]["rows_on_disk"] == 300
    assert facts["last_flush"] == 2_000.0
    assert facts["last_flush_utc"] == "1970-01-01T00:33:20.000+00:00"
    assert facts["disk_bytes"] == os.stat(path / "data.mdb").st_size

    assert main(["stats", str(path)]) == 0
    text = capsys.readouterr().out
    assert "last flush  1970-01-01T00:33:20.000+00:00" in text
    assert any(line.split()[:2] == ["t", "10,000,000"] and line.split()[4] == "300" for line in text.splitlines())
    assert any(line.split()[:2] == ["u", "unbounded"] for line in text.splitlines())
    writer.close()
    assert stats_json(path, capsys)["last_flush"] == 3_000.0  # close() flushed once more


def test_rows_on_disk_only_grow_while_the_writer_writes(tmp_path, writer):
    path, stop = tmp_path / "s", tmp_path / "stop"
    writer.proc.stdin.write(f"burst {stop}\n")
    writer.proc.stdin.flush()
    assert writer.proc.stdout.readline().strip() == "started"
    seen, deadline = [0], time.monotonic() + 120
    while len(set(seen)) < 4 and time.monotonic() < deadline:  # the writer writes until stats saw it grow 3 times
        seen.append(read_facts(path).tables[0].rows_on_disk)
    stop.touch()
    batches = int(writer.proc.stdout.readline().split()[1])
    while seen[-1] != batches * 500 and time.monotonic() < deadline:  # it flushed before it answered
        seen.append(read_facts(path).tables[0].rows_on_disk)
    assert seen == sorted(seen) and seen[-1] == batches * 500
    assert len(set(seen)) >= 4, "stats saw no writes in 120 s"
    writer.close()


def test_rows_on_disk_equal_the_distinct_ids_written(tmp_path, capsys):
    """Writes through the cache (flushed at close) and past it (uncached) both land."""
    rng = np.random.default_rng(0)
    written = {"a": set(), "b": set()}
    specs = [tierstore.TableSpec("a", 5_000, 8), tierstore.TableSpec("b", None, 3, state_dim=2)]
    with tierstore.TieredStore(tmp_path / "s", specs, hbm_rows=20, ddr_rows=100, device="cpu", registry=CollectorRegistry(),
                               clock=lambda: 1_700_000_000.5) as store:
        for step in range(30):
            for name, rows in (("a", 5_000), ("b", 10**12)):
                store.read(name, rng.integers(0, 300, 64))  # caches rows; reads alone write nothing
                ids = np.concatenate([rng.integers(0, 300, 20), rng.integers(0, rows, 20)])
                dim = store.tables[name].dim
                store.write(name, ids, rng.standard_normal((len(ids), dim)).astype(np.float32))
                written[name].update(int(i) for i in ids)
    facts = stats_json(tmp_path / "s", capsys)
    by_name = {t["name"]: t for t in facts["tables"]}
    assert by_name["a"]["rows_on_disk"] == len(written["a"])
    assert by_name["b"]["rows_on_disk"] == len(written["b"])
    assert by_name["b"]["payload_bytes"] == len(written["b"]) * (8 + 4 * 5)
    assert facts["last_flush"] == 1_700_000_000.5
    assert facts["disk_bytes"] == os.stat(tmp_path / "s" / "data.mdb").st_size > 0


def test_console_script_prints_the_table(tmp_path):
    with tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("emb", 1_000, 4)], device="cpu", registry=CollectorRegistry()) as s:
        s.write("emb", np.arange(10), np.zeros((10, 4), dtype=np.float32))
    out = subprocess.run(["tierstore", "stats", str(tmp_path / "s")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["emb"])
    assert row[1:6] == ["1,000", "4", "0", "10", "1.00%"]


def test_missing_store_is_a_clear_error(tmp_path, capsys):
    assert main(["stats", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierstore: error: no tierstore at") and "(no data.mdb)" in err
    assert not (tmp_path / "nothing").exists()


def test_foreign_lmdb_environment_is_a_clear_error(tmp_path, capsys):
    env = lmdb.open(str(tmp_path / "x"), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    assert main(["stats", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierstore: error: ") and "LMDB" in err and "tierstore" in err.split("error: ", 1)[1]


def test_stats_is_a_registered_verb(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "stats" in capsys.readouterr().out


# -- tierstore compact -----------------------------------------------------------------------------
def dump(path) -> dict:
    """Every key and value of every LMDB database of the store, as stored."""
    env = lmdb.open(str(path), readonly=True, max_dbs=1024, lock=False)
    try:
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
            return {n: list(txn.cursor(db=env.open_db(n, txn=txn, create=False))) for n in names}
    finally:
        env.close()


@pytest.fixture
def churned(tmp_path):
    """A store whose rows were overwritten often: LMDB keeps the pages copy-on-write freed."""
    rng = np.random.default_rng(0)
    with tierstore.TieredStore(tmp_path / "s", [tierstore.TableSpec("a", 30_000, 16), tierstore.TableSpec("b", None, 8, state_dim=2)],
                               hbm_rows=0, ddr_rows=0, device="cpu", registry=CollectorRegistry()) as store:
        for _ in range(6):
            store.write("a", rng.permutation(30_000)[:20_000], rng.standard_normal((20_000, 16)).astype(np.float32))
            store.write("b", rng.integers(0, 10**12, 5_000), rng.standard_normal((5_000, 10)).astype(np.float32), with_state=True)
            store.flush()
    return tmp_path / "s"


def test_compact_keeps_every_row_and_meta_and_shrinks_the_file(churned, capsys):
    before = dump(churned)
    size = os.stat(churned / "data.mdb").st_size
    assert main(["compact", str(churned)]) == 0
    out = capsys.readouterr().out
    after = os.stat(churned / "data.mdb").st_size
    assert after < 0.7 * size and f"({size:,} -> {after:,} bytes)" in out
    assert dump(churned) == before
    # nothing left of the compaction's copy; table a's saved row index stays: its newest level's file
    # (index-<table hex>-<token>.bin) and the older levels' files it names
    files = sorted(os.listdir(churned))
    assert [f for f in files if not f.startswith(f"index-{b'a'.hex()}-")] == ["data.mdb", "lock.mdb", "writer.lock"]
    assert len(files) > 3 and all(f.endswith(".bin") for f in files if f.startswith("index-"))
    with tierstore.TieredStore(churned, device="cpu", registry=CollectorRegistry()) as store:  # opens and writes on
        store.write("a", np.arange(3), np.ones((3, 16), dtype=np.float32))
        assert (store.read("a", np.arange(3)) == 1).all()


def test_compact_refuses_a_store_that_is_open_and_changes_nothing(churned, capsys):
    before = dump(churned)
    size = os.stat(churned / "data.mdb").st_size
    reader = subprocess.Popen([sys.executable, "-c", "import lmdb, sys; e = lmdb.open(sys.argv[1], readonly=True, max_dbs=1024); "
                               "print('ready', flush=True); sys.stdin.read()", str(churned)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready"
        assert main(["compact", str(churned)]) == 2
        assert "open in another process" in capsys.readouterr().err
    finally:
        reader.communicate("", timeout=60)
    with tierstore.TieredStore(churned, readonly=True, device="cpu", registry=CollectorRegistry()):  # in this process
        with pytest.raises(tierstore.StoreLockedError):
            tierstore.TieredStore.compact(churned)
    assert os.stat(churned / "data.mdb").st_size == size and dump(churned) == before
    assert not (churned / "data.mdb.compacting").exists()


# Compacts the store at argv[1] and is killed (SIGKILL) mid-way: "copy" after the
# compacted copy's first MiB (its writes go through a pipe to the real file),
# "rename" with the copy complete and synced, just before it replaces data.mdb.
KILLED_COMPACTION = textwrap.dedent("""
    import os, signal, sys, threading
    import tierstore
    path, phase = sys.argv[1], sys.argv[2]
    real_open, real_rename = os.open, os.rename

    def killed_after_a_mib(p, flags, mode=0o777):
        fd = real_open(p, flags, mode)
        if not str(p).endswith(".compacting"):
            return fd
        r, w = os.pipe()

        def relay(n=0):
            while n < 1 << 20:
                n += os.write(fd, os.read(r, 1 << 16))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=relay, daemon=True).start()
        return w

    def killed_at_rename(src, dst):
        if str(dst).endswith("data.mdb"):
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst)
    if phase == "copy":
        os.open = killed_after_a_mib
    else:
        os.rename = killed_at_rename
    tierstore.TieredStore.compact(path)
""")


@pytest.mark.parametrize("phase", ["copy", "rename"])
def test_a_killed_compaction_leaves_the_store_whole(churned, phase, capsys):
    before = dump(churned)
    size = os.stat(churned / "data.mdb").st_size
    r = subprocess.run([sys.executable, "-c", KILLED_COMPACTION, str(churned), phase], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    aside = os.stat(churned / "data.mdb.compacting").st_size
    assert aside >= 1 << 20 and (aside < size if phase == "copy" else True)
    assert os.stat(churned / "data.mdb").st_size == size and dump(churned) == before
    with tierstore.TieredStore(churned, readonly=True, device="cpu", registry=CollectorRegistry()) as store:
        assert store.read("a", np.arange(30_000)).shape == (30_000, 16)
    tierstore.TieredStore(churned, device="cpu", registry=CollectorRegistry()).close()
    assert not (churned / "data.mdb.compacting").exists()  # the next writer removes the leftover copy
    before = dump(churned)  # its close wrote the flush time
    assert main(["compact", str(churned)]) == 0
    assert dump(churned) == before and not (churned / "data.mdb.compacting").exists()
