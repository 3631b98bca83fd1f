"""Readers, exports and crashes see a store as a flush left it, never part of one.

Under a memory budget a flush spans several LMDB commits, and rows are written back
between flushes; tests/flush_writer.py (a real writer process on a real LMDB) stops at
those points while readonly readers in other processes, new and already open, an export,
a checkpoint and a writer opened after a SIGKILL look at the store."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from tierstore import TieredStore, export
from tierstore.serving import ServingStore

CHILD = Path(__file__).with_name("flush_writer.py")
sys.path.insert(0, str(CHILD.parent))
from flush_writer import N, U  # noqa: E402

# a readonly reader: for each line on stdin, the values of every row of both tables
READER = f"""
import json, sys, numpy as np, tierstore
s = tierstore.TieredStore(sys.argv[1], readonly=True, device="cpu")
for _ in sys.stdin:
    print(json.dumps({{t: sorted(set(s.read(t, np.arange(n))[:, 0].tolist())) for t, n in (("t", {N}), ("u", {U}))}}), flush=True)
"""


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def until(proc: subprocess.Popen, prefix: str) -> str:
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the process ended (exit {proc.wait(timeout=30)}) before printing {prefix!r}")


def go_on(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()


def ask(reader: subprocess.Popen) -> dict:
    go_on(reader)
    return json.loads(reader.stdout.readline())


def seen_by_a_new_reader(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", READER, str(path)], input="\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def values(rows) -> dict:
    """The values of every row of both tables, from ``rows(table, ids)``."""
    return {t: sorted(set(rows(t, np.arange(n))[:, 0].tolist())) for t, n in (("t", N), ("u", U))}


def exported(path: Path, dst: Path) -> dict:
    with ServingStore(export(path, dst, dtype="float32")) as srv:
        return values(srv.rows)


def checkpointed(path: Path, dst: Path) -> dict:
    """A checkpoint a readonly store takes, opened as a writer (a checkpoint is restored so)."""
    with TieredStore(path, readonly=True, device="cpu") as reader:
        reader.checkpoint(dst)
    with TieredStore(dst, device="cpu") as restored:
        return values(restored.read)


def test_readers_and_exports_see_whole_flushes(tmp_path):
    path = tmp_path / "store"
    child, reader = start(str(CHILD), str(path), "pause"), None
    try:
        until(child, "flushed 1")
        reader = start("-c", READER, str(path))
        assert ask(reader) == {"t": [1], "u": [1]}
        go_on(child)
        seen = {}
        until(child, "written-back 2")  # u's rows of step 2 are committed, t's are still in the DDR tier
        seen["written back"] = [ask(reader), seen_by_a_new_reader(path), exported(path, tmp_path / "e1")]
        go_on(child)
        until(child, "mid-flush 2")  # the flush has committed its first transaction, not the rest
        seen["mid-flush"] = [ask(reader), seen_by_a_new_reader(path), exported(path, tmp_path / "e2"),
                             checkpointed(path, tmp_path / "c2")]
        assert all(s == {"t": [1], "u": [1]} for views in seen.values() for s in views), seen
        go_on(child)
        done = until(child, "flushed 2").split()
        assert int(done[-1]) >= 2, done  # the flush did span several commits
        after = [ask(reader), seen_by_a_new_reader(path), exported(path, tmp_path / "e3")]
        assert all(s == {"t": [2], "u": [2]} for s in after), after
        go_on(child)
        until(child, "flushed 3")
        go_on(child)
        assert child.wait(timeout=120) == 0
    finally:
        for proc in (child, reader):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_kill_mid_flush_leaves_the_previous_flush(tmp_path):
    path = tmp_path / "store"
    child = start(str(CHILD), str(path), "kill")
    out, _ = child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL and "flushed 1" in out and "flushed 2" not in out, out
    flushed = {"t": [1], "u": [1]}
    assert seen_by_a_new_reader(path) == flushed
    with TieredStore(path, device="cpu") as store:  # the next writer
        assert values(store.read) == flushed
        store.write("t", [0], np.full((1, 64), 7, dtype=np.float32))
        store.flush()
    assert seen_by_a_new_reader(path) == {"t": [1, 7], "u": [1]}
