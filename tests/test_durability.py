"""Crash safety, single writer, readonly readers, map growth and write faults."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from tierstore import StoreLockedError, TableSpec, TieredStore

CHILD = Path(__file__).with_name("crash_writer.py")


def expected_after(rounds, upto):
    """Row values after `upto` rounds of the child's deterministic workload."""
    rng = np.random.default_rng(0)
    values = np.zeros(5000, dtype=np.float32)
    for r in range(1, upto + 1):
        values[rng.choice(5000, 300, replace=False)] = r
    return values


def test_flushed_data_survives_kill_9(tmp_path):
    path = tmp_path / "store"
    child = subprocess.Popen([sys.executable, str(CHILD), str(path), "5"], stdout=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:
            if line.startswith("writing unflushed"):
                break
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    with TieredStore(path, device="cpu") as s:
        got = s.read("t", np.arange(5000))
    flushed = expected_after(5, 5)
    # every row holds its value at the last flush or a later value the child wrote: never older, never torn
    col = got[:, 0].numpy()
    assert (got == got[:, :1]).all(), "torn row"
    assert (col >= flushed).all()
    written_later = col > flushed
    assert np.isin(col[written_later], np.arange(6, 10**6)).all()


def test_second_writer_is_refused_and_readonly_reader_sees_flushed_rows(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 100, 2)], ddr_rows=10, device="cpu") as writer:
        writer.write("t", [1], torch.tensor([[3.0, 4.0]]))
        writer.flush()
        code = (
            "import sys, tierstore\n"
            "try:\n    tierstore.TieredStore(sys.argv[1], device='cpu')\n"
            "except tierstore.StoreLockedError as e:\n    print('LOCKED', e); sys.exit(0)\n"
            "sys.exit(1)\n"
        )
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "readonly=True" in out.stdout, out
        reader_code = (
            "import sys, tierstore\n"
            "s = tierstore.TieredStore(sys.argv[1], readonly=True, ddr_rows=5, device='cpu')\n"
            "print(s.read('t', [1, 2]).tolist())\n"
            "try:\n    s.write('t', [1], [[0.0, 0.0]])\nexcept PermissionError:\n    print('RO')\n"
        )
        out = subprocess.run([sys.executable, "-c", reader_code, str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[:2] == ["[[3.0, 4.0], [0.0, 0.0]]", "RO"]
    # the lock is released on close
    TieredStore(tmp_path, device="cpu").close()


def test_second_writer_in_same_process_is_refused(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 10, 2)], device="cpu"):
        with pytest.raises(StoreLockedError, match="readonly=True"):
            TieredStore(tmp_path, device="cpu")


def test_readonly_open_of_missing_store_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tierstore"):
        TieredStore(tmp_path / "missing", readonly=True)


def test_map_grows_by_itself(tmp_path):
    with TieredStore(tmp_path, [TableSpec("t", 20000, 64)], device="cpu", map_size=1 << 20) as s:
        ids = np.arange(20000)
        s.write("t", ids, np.ones((20000, 64), dtype=np.float32))
        s.flush()
        assert (tmp_path / "data.mdb").stat().st_size > 1 << 20  # past the map it started with
    with TieredStore(tmp_path, device="cpu") as s:
        assert s.read("t", [19999]).sum() == 64


def test_failed_writeback_is_raised_by_the_next_call_and_flush_can_retry(tmp_path, monkeypatch):
    with TieredStore(tmp_path, [TableSpec("t", 100, 2)], hbm_rows=1, ddr_rows=1, device="cpu") as s:
        s.read("t", [1, 2])
        s.write("t", [1, 2], torch.tensor([[1.0, 1], [2, 2]]))
        real = s._backend.put_rows  # fault injection: LMDB commits fail

        def disk_full(*a, **k):
            raise lmdb.DiskError("mdb_put: No space left on device")

        monkeypatch.setattr(s._backend, "put_rows", disk_full)
        s.read("t", [3, 4])  # evicts the dirty rows 1 and 2 into the write-back queue; their commit fails
        with pytest.raises(OSError, match="No space left on device"):
            s.drain_writeback()  # returns once the commit has failed
        before = (s.stats(), s.cached_ids("t"))
        with pytest.raises(OSError, match="No space left on device.*flush\\(\\) retries"):
            s.read("t", [5, 6])  # the failure surfaces at the next call, which changes nothing
        with pytest.raises(OSError, match="nothing was lost"):
            s.write("t", [1], torch.tensor([[9.0, 9]]))
        with pytest.raises(OSError, match="No space left"):
            s.flush()
        assert {k: v.tolist() for k, v in s.cached_ids("t").items()} == {k: v.tolist() for k, v in before[1].items()}
        assert s.stats() == before[0]
        monkeypatch.setattr(s._backend, "put_rows", real)  # space freed
        s.flush()
        assert s.read("t", [1, 2]).tolist() == [[1.0, 1.0], [2.0, 2.0]]
    with TieredStore(tmp_path, device="cpu") as s:
        assert s.read("t", [1, 2]).tolist() == [[1.0, 1.0], [2.0, 2.0]]


def test_a_program_that_ends_without_close_leaves_its_last_flush(tmp_path, monkeypatch):
    """The writer thread still commits what was queued as the program ends (it is no daemon
    thread, so no commit is cut off), but nothing flush() did not publish is the store's: the
    next writer finds the rows of the last flush, and only those."""
    code = (
        "import sys, time, numpy as np, tierstore\n"
        "s = tierstore.TieredStore(sys.argv[1], [tierstore.TableSpec('t', 10**6, 4)], device='cpu')\n"
        "s.write('t', np.arange(10), np.full((10, 4), 1, dtype=np.float32))\n"
        "s.flush()\n"
        "real = s._backend.put_rows  # latency injection\n"
        "s._backend.put_rows = lambda *a, **k: (time.sleep(0.5), real(*a, **k))[1]  # a slow disk\n"
        "s.write('t', np.arange(100_000), np.full((100_000, 4), 7, dtype=np.float32))  # uncached: queued\n"
        "assert s.snapshot().writeback_queued_rows == 100_000\n"  # still queued as the program ends, without close()
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    with TieredStore(tmp_path, device="cpu") as s:
        assert s.stats()["rows"]["stored"] == 10
        assert s.read("t", [0, 99_999]).tolist() == [[1.0] * 4, [0.0] * 4]
