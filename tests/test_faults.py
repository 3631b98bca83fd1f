"""Damaged files, failed opens and misuse end in named errors, never a signal,
and leave nothing behind. Whatever could kill the process runs in a
child, so a signal fails the test instead of ending the run."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from tierstore import StoreCorruptError, StoreLockedError, TableSpec, TieredStore
from tierstore.io import lmdb_backend, lmdb_file

SPEC = TableSpec("t", None, 16)


def open_store(path, *args, **kwargs) -> TieredStore:
    return TieredStore(path, *args, device="cpu", registry=CollectorRegistry(), **kwargs)


def make_store(path: Path, rows: int = 20000) -> Path:
    with open_store(path, [SPEC]) as s:
        s.write("t", np.arange(rows), torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16))
    return path


def run_child(code: str, *args: str, wrapper: tuple[str, ...] = (), **kwargs) -> subprocess.CompletedProcess:
    """``wrapper``: a command the child runs under (unshare)."""
    return subprocess.run([*wrapper, sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=120, **kwargs)


# opens each store named on the command line, readonly and for writing, reads
# every row, and prints the outcome: a signal kills the child instead
OPEN_EACH = """
    import sys, numpy as np
    from prometheus_client import CollectorRegistry
    from tierstore import TieredStore
    for path in sys.argv[1:]:
        for readonly in (True, False):
            try:
                with TieredStore(path, readonly=readonly, device="cpu", registry=CollectorRegistry()) as s:
                    s.read("t", np.arange(20000))
                print(path, readonly, "opened")
            except Exception as e:
                print(path, readonly, type(e).__name__, e)
"""


def copy_store(src: Path, dest: Path) -> Path:
    dest.mkdir()
    (dest / "data.mdb").write_bytes((src / "data.mdb").read_bytes())
    return dest


def test_damaged_data_file_raises_a_named_error_not_a_signal(tmp_path):
    src = make_store(tmp_path / "good")
    size = (src / "data.mdb").stat().st_size
    damaged = []
    for cut in (8192, 12288, size // 2, size * 9 // 10, 0):
        d = copy_store(src, tmp_path / f"cut{cut}")
        os.truncate(d / "data.mdb", cut)
        damaged.append(d)
    # scribbles over both meta pages' fields: magic, map size, page size, the roots, last page
    big = (1 << 40).to_bytes(8, "little")
    for offset, data in ((16, b"\0" * 4), (32, (4096).to_bytes(8, "little")), (40, (1000).to_bytes(4, "little")),
                         (80, big), (128, big), (136, big)):
        d = copy_store(src, tmp_path / f"scribble{offset}")
        with open(d / "data.mdb", "r+b") as f:
            for page in (0, 4096):
                f.seek(page + offset)
                f.write(data)
        damaged.append(d)
    r = run_child(OPEN_EACH, *damaged)
    assert r.returncode == 0, f"child died with {r.returncode} (a signal if negative): {r.stderr[-2000:]}"
    lines = r.stdout.splitlines()
    assert len(lines) == 2 * len(damaged)
    for line in lines:
        assert "StoreCorruptError" in line and "data.mdb is damaged" in line and "checkpoint" in line, line
    assert "empty (0 bytes)" in r.stdout  # the zero-length file is flagged, not turned into a new store
    assert all(not (d / "lock.mdb").exists() and not (d / "writer.lock").exists() for d in damaged)


def test_stats_cli_on_a_truncated_store_is_an_error_line(tmp_path):
    d = copy_store(make_store(tmp_path / "good"), tmp_path / "cut")
    os.truncate(d / "data.mdb", 12288)
    r = run_child("from tierstore.tools.cli import main; import sys; sys.exit(main(['stats', sys.argv[1]]))", d)
    assert r.returncode > 0, r.stderr[-2000:]
    assert "damaged" in r.stderr and "truncated" in r.stderr


def test_zero_length_data_file_with_tables_is_not_a_new_store(tmp_path):
    d = copy_store(make_store(tmp_path / "good"), tmp_path / "emptied")
    os.truncate(d / "data.mdb", 0)
    with pytest.raises(StoreCorruptError, match="empty"):
        open_store(d, [SPEC])
    assert (d / "data.mdb").stat().st_size == 0


def test_checkpoint_cut_short_never_appears_under_its_name(tmp_path):
    """A checkpoint killed midway (SIGXFSZ when the copy passes a file size
    limit: a kill at a known point) leaves its name absent, or complete."""
    src = make_store(tmp_path / "store", rows=40000)
    dest = tmp_path / "ckpt"
    r = run_child("""
        import resource, signal, sys
        from prometheus_client import CollectorRegistry
        from tierstore import TieredStore
        with TieredStore(sys.argv[1], device="cpu", registry=CollectorRegistry()) as s:
            s.flush()
            # only the copy writes from here: the limit kills the process in its middle
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; its default kills
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # and dumps core, but not here
            s._backend.copy_to(sys.argv[2])
        """, src, dest)
    assert r.returncode == -signal.SIGXFSZ, (r.returncode, r.stderr[-2000:])
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # what the kill left, set aside
    with open_store(src) as s:
        s.checkpoint(dest)
    with open_store(dest, readonly=True) as s:
        assert s.read("t", [39999])[0, 0] == 39999 * 16


def test_failed_open_releases_the_writer_lock(tmp_path, monkeypatch):
    make_store(tmp_path / "s")

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(lmdb_backend.os, "pwrite", disk_full)
        with pytest.raises(OSError, match="No space left"):
            open_store(tmp_path / "s")
    with open_store(tmp_path / "s") as s:  # not StoreLockedError naming "pid ?"
        assert s.read("t", [1])[0, 0] == 16


def test_mistyped_path_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pass tables=\[tierstore.TableSpec"):
        open_store(tmp_path / "typo")
    assert not (tmp_path / "typo").exists()
    (tmp_path / "notes").mkdir()
    with pytest.raises(FileNotFoundError, match="missing data.mdb"):
        open_store(tmp_path / "notes")
    assert list((tmp_path / "notes").iterdir()) == []


def test_foreign_lmdb_environment_is_refused_untouched(tmp_path):
    import lmdb

    with lmdb.open(str(tmp_path), max_dbs=2) as env, env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data")
    before = (tmp_path / "data.mdb").read_bytes()
    with pytest.raises(ValueError, match="LMDB environment that tierstore did not write"):
        open_store(tmp_path, [SPEC])
    assert (tmp_path / "data.mdb").read_bytes() == before


@pytest.mark.parametrize("name", ["a\0x", "a\0y", "", "x y", "-a", "é", "a\n", "a" * 129, "a/b"])
def test_table_names_outside_the_rule_are_refused(name):
    # "a\0x" and "a\0y" were one LMDB database: writing one overwrote the other
    with pytest.raises(ValueError, match=r"1 to 128 ASCII letters, digits, '_', '.' or '-'"):
        TableSpec(name, None, 4)


def test_table_names_by_the_rule_are_separate_tables(tmp_path):
    specs = [TableSpec(n, None, 2) for n in ("a", "a.b", "a-b", "_" + "a" * 127)]
    with open_store(tmp_path, specs) as s:
        for i, spec in enumerate(specs):
            s.write(spec.name, [0], torch.full((1, 2), float(i)))
    with open_store(tmp_path, readonly=True) as s:
        assert [s.read(spec.name, [0])[0, 0].item() for spec in specs] == [0, 1, 2, 3]


def test_reader_in_another_process_follows_the_writers_map_growth(tmp_path):
    """A writer grows LMDB's map past the size a reader mapped (small map_size:
    1 MiB): the reader's next transactions got MDB_MAP_RESIZED for good."""
    with open_store(tmp_path, [SPEC], map_size=1 << 20) as w:
        w.write("t", [0], torch.zeros(1, 16))
        w.flush()
        reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import sys
            from prometheus_client import CollectorRegistry
            from tierstore import TieredStore
            with TieredStore(sys.argv[1], readonly=True, map_size=1 << 20, device="cpu", registry=CollectorRegistry()) as s:
                for line in sys.stdin:
                    print(float(s.read("t", [int(line)])[0, 0]), flush=True)
            """), str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            reader.stdin.write("0\n")
            reader.stdin.flush()
            assert reader.stdout.readline() == "0.0\n"
            rows = 60000  # ~4.6 MiB of rows: the map doubles past the reader's
            w.write("t", np.arange(rows), torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 16))
            w.flush()
            assert (tmp_path / "data.mdb").stat().st_size > 2 << 20
            reader.stdin.write(f"{rows - 1}\n")
            reader.stdin.flush()
            assert reader.stdout.readline() == f"{rows - 1}.0\n", reader.stderr.read()
        finally:
            reader.stdin.close()
            assert reader.wait(60) == 0, reader.stderr.read()


def test_reader_beside_a_writer_in_one_process(tmp_path):
    """The README's snippet in one script: a writer, then a reader of the same path."""
    registry = CollectorRegistry()  # one registry for both, as the default one would be
    w = TieredStore(tmp_path, [SPEC], device="cpu", registry=registry)
    w.write("t", [1], torch.ones(1, 16))
    w.flush()
    r = TieredStore(tmp_path, readonly=True, device="cpu", registry=registry)
    assert r.read("t", [1])[0, 0] == 1
    with pytest.raises(StoreLockedError, match=f"in this process \\(pid {os.getpid()}\\)"):
        TieredStore(tmp_path, device="cpu", registry=CollectorRegistry())
    with pytest.raises(PermissionError, match="readonly"):
        r.write("t", [1], torch.zeros(1, 16))
    w.write("t", [2], torch.full((1, 16), 2.0))
    w.close()  # the reader goes on reading the environment they share
    assert r.read("t", [2])[0, 0] == 2
    with open_store(tmp_path) as w:  # the writer gone, another may join the reader
        w.write("t", [3], torch.full((1, 16), 3.0))
    assert r.read("t", [3])[0, 0] == 3
    r.close()
    with open_store(tmp_path, readonly=True) as r:  # a reader first maps the store readonly
        with pytest.raises(StoreLockedError, match="open the writer first"):
            open_store(tmp_path)
    with open_store(tmp_path) as w:  # all closed: a writer opens again
        assert w.read("t", [3])[0, 0] == 3


def test_bad_ids_and_values_get_named_errors(tmp_path):
    with open_store(tmp_path, [SPEC]) as s:
        huge = torch.tensor([3, (1 << 63) + 5], dtype=torch.uint64)  # torch casts it to a negative int64
        with pytest.raises(IndexError, match=f"id {(1 << 63) + 5} out of range .* < 2\\*\\*63"):
            s.read("t", huge)
        with pytest.raises(IndexError, match=f"id {(1 << 63) + 5} out of range"):
            s.write("t", huge, torch.zeros(2, 16))
        assert s.read("t", torch.tensor([3], dtype=torch.uint64)).shape == (1, 16)
        with pytest.raises(ValueError, match="ids for table 't' are a tensor on the meta device"):
            s.read("t", torch.zeros(2, dtype=torch.int64, device="meta"))
        with pytest.raises(ValueError, match="values for table 't' are a tensor on the meta device"):
            s.write("t", [1, 2], torch.zeros(2, 16, device="meta"))


def test_with_state_on_a_table_without_state_is_the_empty_state(tmp_path):
    with open_store(tmp_path, [SPEC]) as s:
        s.write("t", [1], torch.ones(1, 16))
        assert torch.equal(s.read("t", [1, 2], with_state=True), s.read("t", [1, 2]))  # [n, dim + 0]
        with pytest.raises(TypeError, match="with_state must be True or False"):
            s.read("t", [1], with_state="yes")


@pytest.mark.parametrize("key, value, error", [
    (b"tables", b"{not json", "metadata record is unreadable"),
    (b"tables", b'[{"name": "t", "dim": 16, "unknown_field": 1}]', "table specs are unreadable"),
    (b"tables", b'[{"name": "t\\u0000x", "num_rows": null, "dim": 16, "init": {}}]', "table specs are unreadable"),
])
def test_corrupt_metadata_record_is_named(tmp_path, key, value, error):
    import lmdb

    make_store(tmp_path, rows=10)
    with lmdb.open(str(tmp_path), max_dbs=4) as env:
        meta = env.open_db(b"__meta__")
        with env.begin(write=True, db=meta) as txn:
            txn.put(key, value)
    for readonly in (True, False):
        with pytest.raises(StoreCorruptError, match=error):
            open_store(tmp_path, readonly=readonly)


def test_readonly_open_of_a_directory_it_cannot_write(tmp_path, monkeypatch):
    make_store(tmp_path, rows=10)

    def lmdb_open(*args, **kwargs):  # what LMDB says when it cannot create lock.mdb (root never sees it)
        raise lmdb_backend.lmdb.ReadonlyError("mdb_env_open: Permission denied")

    monkeypatch.setattr(lmdb_backend.lmdb, "open", lmdb_open)
    with pytest.raises(PermissionError, match="must create or write lock.mdb there, even to read.*make the directory writable"):
        open_store(tmp_path, readonly=True)


def test_full_disk_is_reported_as_a_full_disk_and_loses_nothing(tmp_path):
    """A commit cut short (a real short write, past a file size limit) is LMDB's
    "Input/output error"; with the disk nearly full (the one thing faked here)
    it is reported as ENOSPC, and flush() after the space is back writes it all."""
    r = run_child("""
        import collections, resource, sys
        import numpy as np, torch
        from prometheus_client import CollectorRegistry
        from tierstore import TableSpec, TieredStore
        from tierstore.io import lmdb_file
        path = sys.argv[1]
        with TieredStore(path, [TableSpec("t", None, 16)], device="cpu", registry=CollectorRegistry()) as s:
            s.write("t", np.arange(1000), torch.ones(1000, 16))
            s.flush()
            size = (lmdb_file.Path(path) / "data.mdb").stat().st_size
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10000, resource.RLIM_INFINITY))
            lmdb_file.shutil.disk_usage = lambda p: collections.namedtuple("u", "total used free")(1 << 30, 1 << 30, 4096)
            s.write("t", np.arange(50000), torch.full((50000, 16), 2.0))
            try:
                s.flush()
            except OSError as e:
                print("ERROR", e.errno, e)
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            s.flush()
        with TieredStore(path, readonly=True, device="cpu", registry=CollectorRegistry()) as s:
            print("ALL", bool((s.read("t", np.arange(50000)) == 2).all()))
        """, tmp_path / "s")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"[Errno {errno.ENOSPC}] disk full" in r.stdout and "4096 bytes free" in r.stdout, r.stdout
    assert "ALL True" in r.stdout


def test_a_real_full_disk_fails_the_flush_and_loses_nothing(tmp_path):
    """A real full disk, not a faked one: a 24 MiB tmpfs, mounted in a user namespace
    of the child. The flush that finds it full raises ENOSPC and names it; rows
    flushed before read back, and once space is freed flush() writes the rest."""
    r = run_child("""
        import errno, os, subprocess, sys
        import numpy as np, torch
        from prometheus_client import CollectorRegistry
        from tierstore import TableSpec, TieredStore
        disk = sys.argv[1]
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tierstore-test", disk], check=True)
        with open(os.path.join(disk, "ballast"), "wb") as f:
            f.write(bytes(12 << 20))
        path = os.path.join(disk, "s")
        s = TieredStore(path, [TableSpec("t", None, 16)], device="cpu", registry=CollectorRegistry())
        rows, n = 0, 20000
        while True:
            s.write("t", np.arange(rows, rows + n), torch.full((n, 16), float(rows)))
            try:
                s.flush()
            except OSError as e:
                print("ERROR", e, flush=True)
                break
            rows += n
        print("FLUSHED", rows, flush=True)
        expected = torch.arange(rows + n).div(n, rounding_mode="floor") * n
        with TieredStore(path, readonly=True, device="cpu", registry=CollectorRegistry()) as r:
            print("BEFORE", bool((r.read("t", np.arange(rows))[:, 0] == expected[:rows]).all()), flush=True)
        os.remove(os.path.join(disk, "ballast"))
        s.flush()
        s.close()
        with TieredStore(path, readonly=True, device="cpu", registry=CollectorRegistry()) as r:
            print("ALL", bool((r.read("t", np.arange(rows + n))[:, 0] == expected).all()))
        """, tmp_path, wrapper=("unshare", "--user", "--map-root-user", "--mount"))
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    assert f"[Errno {errno.ENOSPC}] disk full: LMDB could not write" in r.stdout, r.stdout
    assert "free disk space" in r.stdout and int(r.stdout.split("FLUSHED ")[1].split()[0]) > 0, r.stdout
    assert "BEFORE True" in r.stdout and "ALL True" in r.stdout, r.stdout


def _free_a_tail(path: Path) -> int:
    """Leave the last pages of ``path``'s data.mdb on LMDB's free list, as LMDB itself may:
    a value written last and deleted, then a commit that takes older free pages (LMDB takes
    the lowest first). Returns the last page LMDB names; the value's last 16 pages are free."""
    import lmdb
    env = lmdb.open(str(path), max_dbs=1024, map_size=(path / "data.mdb").stat().st_size + (64 << 20))
    scratch = env.open_db(b"scratch")
    for r in range(10):  # free pages at the front for the commit after the delete
        with env.begin(write=True) as txn:
            for i in range(500):
                txn.put(b"k%05d" % i, b"v%d" % r * 50, db=scratch)
    with env.begin(write=True) as txn:
        txn.put(b"big", b"x" * (40 * 4096), db=scratch)
    last = env.info()["last_pgno"]
    with env.begin(write=True) as txn:
        txn.delete(b"big", db=scratch)
    with env.begin(write=True) as txn:
        for i in range(500):
            txn.put(b"k%05d" % i, b"w" * 50, db=scratch)
    assert env.info()["last_pgno"] == last, "LMDB placed the commits after the delete past the freed value"
    env.close()
    return last


def test_a_file_ending_in_pages_lmdb_freed_opens_and_one_cut_into_pages_in_use_does_not(tmp_path):
    """LMDB leaves pages it gave back within a commit unwritten, so data.mdb may end before
    the last page its meta page names (seen on the bench table after a run); such a file is
    whole. The store opens it and reads every row; a file cut into pages in use is damage."""
    whole = make_store(tmp_path / "whole")
    last = _free_a_tail(whole)
    cut_free = copy_store(whole, tmp_path / "cut_free")
    os.truncate(cut_free / "data.mdb", (last + 1 - 16) * 4096)
    cut_used = copy_store(whole, tmp_path / "cut_used")
    os.truncate(cut_used / "data.mdb", (last + 1 - 64) * 4096)  # into the pages before the value
    lmdb_file.check_data_file(cut_free / "data.mdb")
    with pytest.raises(StoreCorruptError, match="truncated"):
        lmdb_file.check_data_file(cut_used / "data.mdb")
    # a writer reusing the free list's pages mid-read: the next read decides
    real, calls = lmdb_file._free_past_end, []

    def garbled_once(*args):
        calls.append(args)
        return len(calls) > 1 and real(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lmdb_file, "_free_past_end", garbled_once)
        lmdb_file.check_data_file(cut_free / "data.mdb")
    assert len(calls) == 2
    r = run_child(OPEN_EACH, whole, cut_free)
    assert r.returncode == 0, f"child died with {r.returncode} (a signal if negative): {r.stderr[-2000:]}"
    assert r.stdout.count("opened") == 4, r.stdout
    with open_store(cut_free, readonly=True) as s, open_store(whole, readonly=True) as w:
        assert torch.equal(s.read("t", np.arange(20000)), w.read("t", np.arange(20000)))
