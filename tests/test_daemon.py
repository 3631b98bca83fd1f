"""`tierstore prefetchd`: a real daemon process, real client processes, real Unix
sockets and a real LMDB store on disk. Faults are real signals (SIGKILL,
SIGTERM, SIGSTOP) and hand-made frames on a raw socket."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import tierstore
from tierstore.daemon import wire
from tierstore.optim import Adagrad
from tierstore.spec import initial_rows
from tierstore.trace import Trace

from test_admission import _fbgemm  # skips without FBGEMM

USER = tierstore.TableSpec("user", 10_000, 8, init=tierstore.RowInit.uniform(-1, 1, seed=3))
ITEM = tierstore.TableSpec("item", None, 4, state_dim=2)


def _embedded(path, **kw):
    return tierstore.TieredStore(path, registry=CollectorRegistry(), device="cpu", **kw)


def ready_metrics_port(line: str) -> int | None:
    """The metrics port a daemon's ready line reports (``--metrics-port 0``: the free one it bound)."""
    words = line.split()
    return int(words[-1]) if words[-2:-1] == ["metrics-port"] else None


class Daemon:
    started: list["Daemon"] = []  # every daemon a test starts; leftovers are killed after it (see below)

    def __init__(self, path, sock, *extra, ddr_rows=1000, **popen):
        self.sock = sock
        Daemon.started.append(self)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.tools.cli", "prefetchd", str(path), "--socket", str(sock), "--ddr-rows", str(ddr_rows), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        line = self.proc.stdout.readline()
        assert line.startswith("ready"), f"daemon did not start: {line!r} {self.proc.stderr.read() if self.proc.poll() is not None else ''}"
        self.metrics_port = ready_metrics_port(line)

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(30)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rc


@pytest.fixture(autouse=True)
def no_daemon_outlives_its_test():
    """A test that fails half-way leaves no daemon behind (SIGKILL ends a SIGSTOPped one too)."""
    yield
    for d in Daemon.started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(30)
    Daemon.started.clear()


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="tsd-")  # short: Unix socket paths are limited to ~104 bytes
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "store"
    with _embedded(path, tables=[USER, ITEM]) as s:
        s.write("user", np.arange(100), np.full((100, 8), 0.5, dtype=np.float32))
    return path


@pytest.fixture
def daemon(store_path, sockdir):
    d = Daemon(store_path, sockdir / "d.sock")
    yield d
    d.stop(signal.SIGKILL if d.proc.poll() is None else signal.SIGTERM)


def attach(daemon, store_path, **kw):
    return tierstore.open_store(store_path, daemon=str(daemon.sock), **kw)


def attach_once_released(daemon, store_path, claim):
    """Attach with ``claim`` as soon as the daemon has noticed a killed holder and released it."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return attach(daemon, store_path, claim=claim)
        except PermissionError:
            assert time.monotonic() < deadline, "claim of a killed client was not released"
            time.sleep(0.05)


def raw_conn(sock_path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock_path))
    return s


def test_socket_is_0600_and_reads_match_an_embedded_store(daemon, store_path):
    assert stat.S_IMODE(os.stat(daemon.sock).st_mode) == 0o600
    c = attach(daemon, store_path, readonly=True)
    assert isinstance(c, tierstore.EmbeddingStore) and c.tables == {"user": USER, "item": ITEM}
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 10_000, 3000)
    got = c.read("user", ids)
    with_state = c.read("item", [5, 2**40], with_state=True)
    out = torch.empty((len(ids), 8))
    assert c.read("user", ids, out=out) is out and torch.equal(out, got)
    c.close()
    daemon.stop()
    with _embedded(store_path, readonly=True) as s:  # the oracle: the same store opened in-process
        assert torch.equal(got, s.read("user", ids))
        assert torch.equal(with_state, s.read("item", [5, 2**40], with_state=True))


CLIENT = textwrap.dedent("""
    import sys, numpy as np, tierstore
    path, sock, table, dim, lo = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    c = tierstore.open_store(path, daemon=sock, claim=[table], client=f"writer-{table}")
    ids = np.arange(lo, lo + 500)
    c.write(table, ids, (ids[:, None] * 10 + np.arange(dim)).astype(np.float32))
    c.flush()
    print("wrote", flush=True)
    sys.stdin.readline()
    other = "item" if table == "user" else "user"
    rows = c.read(other, np.arange(2000, 2500)).numpy()
    print(float(rows.sum()), flush=True)
    c.close()
""")


def test_two_client_processes_write_their_tables_and_read_each_others(daemon, store_path):
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(store_path), str(daemon.sock), t, str(dim), "2000"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for t, dim in (("user", 8), ("item", 4))]
    for p in procs:
        assert p.stdout.readline().strip() == "wrote"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    sums = [float(p.stdout.readline()) for p in procs]
    assert [p.wait(30) for p in procs] == [0, 0]
    ids = np.arange(2000, 2500)
    expect = {d: float((ids[:, None] * 10 + np.arange(d)).sum()) for d in (8, 4)}
    assert sums == [expect[4], expect[8]]  # the user writer read item rows and vice versa


def test_overlapping_claim_is_refused_naming_the_holder_and_released_on_close(daemon, store_path):
    a = attach(daemon, store_path, claim=["user"], client="trainer-a")
    with pytest.raises(PermissionError, match=r"'user'.*trainer-a.*pid %d" % os.getpid()):
        attach(daemon, store_path, claim=["item", "user"], client="trainer-b")
    b = attach(daemon, store_path, claim=["item"], client="trainer-b")  # the refused attach claimed nothing
    with pytest.raises(PermissionError, match="no write claim on row 1 of table 'user'.*trainer-a"):
        b.write("user", [1], np.ones((1, 8)))
    a.close()
    c = attach(daemon, store_path, claim=["user"], client="trainer-c")
    c.write("user", [1], np.ones((1, 8)))
    with pytest.raises(KeyError, match="unknown tables"):
        attach(daemon, store_path, claim=["nope"])
    b.close()
    c.close()


def test_readonly_client_reads_anything_and_writes_nothing(daemon, store_path):
    w = attach(daemon, store_path, claim=["user"])
    w.write("user", [7], np.full((1, 8), 3.0))
    r = attach(daemon, store_path, readonly=True)
    assert torch.equal(r.read("user", [7]), torch.full((1, 8), 3.0))
    with pytest.raises(PermissionError, match="readonly"):
        r.write("user", [7], np.zeros((1, 8)))
    with pytest.raises(ValueError, match="contradict"):
        attach(daemon, store_path, readonly=True, claim=["user"])
    with pytest.raises(ValueError, match="caches only rows it has claimed"):
        attach(daemon, store_path, hbm_rows=10)
    with pytest.raises(ValueError, match="'user', which this client has not claimed"):
        attach(daemon, store_path, claim=[("item", 0, 10)], hbm_rows={"user": 10})
    with pytest.raises(ValueError, match="only applies to a client of `tierstore prefetchd`"):
        tierstore.TieredStore(store_path, claim=["user"])
    with pytest.raises(TypeError, match=r"open_store\(path, daemon=SOCK"):  # the embedded class never becomes a client
        tierstore.TieredStore(store_path, daemon=str(daemon.sock))
    # errors raised in the daemon come back as the same exception type, with its message
    with pytest.raises(IndexError, match="out of range.*num_rows=10000"):
        w.prefetch("user", [5, 10_000])
    w.close()
    r.close()


def _hello(s: socket.socket, **kw) -> wire.Frame:
    import json

    try:
        wire.send_frame(s, wire.Frame(wire.HELLO, text=json.dumps({"client": "raw", "claims": [], "readonly": True, **kw})))
    except BrokenPipeError:
        pass  # a refused connection: the daemon's reply says why
    reply = wire.recv_frame(s, wire.Limits())
    wire.raise_for(reply)
    return reply


def assert_closed(s: socket.socket) -> None:
    try:  # a daemon that hangs up with our unread bytes in its buffer resets the connection
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass


def test_malformed_and_oversized_frames_get_an_error_and_a_closed_connection(daemon, store_path):
    good = attach(daemon, store_path, readonly=True)
    cases = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 10,  # not our magic
        wire.HEADER.pack(wire.MAGIC, 99, wire.READ, 0, 0, 0, 0, 0, 0),  # future version
        wire.HEADER.pack(wire.MAGIC, wire.VERSION, 200, 0, 0, 0, 0, 0, 0),  # unknown type
        wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.READ, 0, 0, 4, 1 << 40, 0, 0),  # 8 TiB of ids: refused before allocating
        wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.WRITE, 0, 0, 4, 10, 10, 1 << 30),  # absurd row width
    ]
    for i, payload in enumerate(cases):
        s = raw_conn(daemon.sock)
        if i:
            _hello(s)
        s.sendall(payload)
        reply = wire.recv_frame(s, wire.Limits())
        assert reply.status != wire.OK and reply.text, payload
        with pytest.raises(ValueError):
            wire.raise_for(reply)
        assert_closed(s)
        s.close()
    # a request before HELLO is refused too
    s = raw_conn(daemon.sock)
    wire.send_frame(s, wire.Frame(wire.READ, text="user", ids=np.array([1])))
    assert wire.recv_frame(s, wire.Limits()).status != wire.OK
    assert_closed(s)
    s.close()
    # a bad request in a well-formed frame is answered and the connection stays usable
    s = raw_conn(daemon.sock)
    _hello(s)
    wire.send_frame(s, wire.Frame(wire.READ, text="user", ids=np.array([-1])))
    with pytest.raises(IndexError, match="negative"):
        wire.raise_for(wire.recv_frame(s, wire.Limits()))
    wire.send_frame(s, wire.Frame(wire.READ, text="user", ids=np.array([1])))
    assert wire.recv_frame(s, wire.Limits()).rows.shape == (1, 8)
    s.close()
    assert torch.equal(good.read("user", [3]), torch.full((1, 8), 0.5))  # the others were served throughout
    good.close()


PARTIAL_WRITER = textwrap.dedent("""
    import sys, numpy as np, tierstore
    from tierstore.daemon import wire
    c = tierstore.open_store(sys.argv[1], daemon=sys.argv[2], claim=["user"], client="doomed")
    c.write("user", np.arange(200, 210), np.full((10, 8), 2.0, dtype=np.float32))
    c.flush()
    c.write("user", np.arange(210, 220), np.full((10, 8), 4.0, dtype=np.float32))  # never flushed by this client
    # the header and half the payload of a write of rows 300..999, then stall: killed mid-frame
    ids = np.arange(300, 1000)
    rows = np.full((700, 8), 9.0, dtype=np.float32)
    c._sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.WRITE, 0, 0, 4, 700, 700, 8) + b"user" + ids.tobytes())
    c._sock.sendall(rows.tobytes()[: rows.nbytes // 2])
    print("stalled", flush=True)
    sys.stdin.readline()
""")


def test_client_killed_mid_write_loses_only_that_frame_and_its_claim_is_released(daemon, store_path):
    p = subprocess.Popen([sys.executable, "-c", PARTIAL_WRITER, str(store_path), str(daemon.sock)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "stalled"
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    c = attach_once_released(daemon, store_path, ["user"])
    rows = c.read("user", np.arange(200, 1000)).numpy()
    assert (rows[:10] == 2.0).all()  # flushed
    assert (rows[10:20] == 4.0).all()  # written, not flushed: still in the daemon's store
    assert np.array_equal(rows[100:], _initial_user_rows(store_path, np.arange(300, 1000)))  # never written
    c.close()


def _initial_user_rows(store_path, ids) -> np.ndarray:
    """The values rows of "user" have before any write (from a fresh store)."""
    tmp = store_path.parent / "fresh"
    with _embedded(tmp, tables=[USER]) as oracle:
        rows = oracle.read("user", ids).numpy()
    shutil.rmtree(tmp)
    return rows


def test_sigterm_flushes_then_exits_0(store_path, sockdir):
    d = Daemon(store_path, sockdir / "d.sock")
    c = tierstore.open_store(store_path, daemon=str(d.sock), claim=["item"])
    ids = np.array([3, 2**50, 77])
    values = np.arange(3 * 6, dtype=np.float32).reshape(3, 6)
    c.write("item", ids, values, with_state=True)  # no flush
    assert d.stop(signal.SIGTERM) == 0
    assert not d.sock.exists()
    with _embedded(store_path, readonly=True) as s:
        assert np.array_equal(s.read("item", ids, with_state=True).numpy(), values)
    with pytest.raises(ConnectionError, match="went away|closed the connection"):
        c.read("item", ids)


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    tasks = Path(f"/proc/{pid}/task")
    while not all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for t in tasks.iterdir()):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


def test_daemon_gone_or_hung_gives_connection_error_quickly(store_path, sockdir):
    with pytest.raises(ConnectionError, match="no tierstore daemon answers.*tierstore prefetchd"):
        tierstore.open_store(store_path, daemon=str(sockdir / "none.sock"))
    d = Daemon(store_path, sockdir / "d.sock")
    c = tierstore.open_store(store_path, daemon=str(d.sock), readonly=True, timeout=1.0)
    c.read("user", [1])
    os.kill(d.proc.pid, signal.SIGSTOP)  # hung: the socket stays open but nobody answers
    try:
        _wait_stopped(d.proc.pid)  # kill() returns before every thread has stopped
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="did not answer within 1.0 s"):
            c.read("user", [1])
        assert time.monotonic() - t0 < 10
        with pytest.raises(RuntimeError, match="closed"):
            c.read("user", [1])
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    c2 = tierstore.open_store(store_path, daemon=str(d.sock), readonly=True, timeout=5.0)
    d.stop(signal.SIGKILL)
    with pytest.raises(ConnectionError):
        c2.read("user", [1])


def test_second_daemon_refused_while_one_lives_and_stale_socket_replaced(store_path, sockdir):
    sock = sockdir / "d.sock"
    d = Daemon(store_path, sock)
    p = subprocess.run([sys.executable, "-m", "tierstore.tools.cli", "prefetchd", str(store_path), "--socket", str(sock), "--ddr-rows", "10"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "already serving" in p.stderr
    d.stop(signal.SIGKILL)  # leaves a stale socket file behind
    assert sock.exists()
    d = Daemon(store_path, sock, "--shm-max-mib", "0", "--threads", "1")
    c = tierstore.open_store(store_path, daemon=str(sock), readonly=True)
    assert c._shm is None  # the daemon grants no segment: every frame goes through the socket
    assert c.read("user", np.arange(5000)).shape == (5000, 8)
    c.close()
    assert d.stop() == 0


def test_lookahead_follows_the_slowest_client_and_metrics_label_clients(store_path, sockdir, tmp_path):
    rng = np.random.default_rng(1)
    steps = {s: rng.choice(10_000, 50, replace=False) for s in range(6)}
    trace = tmp_path / "trace"
    Trace.from_calls([(s, "user", ids) for s, ids in steps.items()], tables=["user"]).save(trace)
    d = Daemon(store_path, sockdir / "d.sock", "--lookahead-source", str(trace), "--depth", "2", "--metrics-port", "0")
    try:
        fast = tierstore.open_store(store_path, daemon=str(d.sock), readonly=True, client="fast")
        slow = tierstore.open_store(store_path, daemon=str(d.sock), readonly=True, client="slow")
        port = d.metrics_port  # the free port it bound, from its ready line; STATS says it too
        assert port > 0 and fast.daemon_stats()["metrics_port"] == port
        slow.report_step(0)
        fast.report_step(4)  # the window follows the slowest client: steps 1 and 2

        def issued():
            return fast.daemon_stats()["prefetch"]["user"]["issued_batches"]

        deadline = time.monotonic() + 10
        while issued() < 2:  # steps 1 and 2: depth 2 past the slow client's step 0
            assert time.monotonic() < deadline, "lookahead issued nothing"
            time.sleep(0.05)
        time.sleep(0.3)
        assert issued() == 2  # nothing beyond the slowest client's window
        slow.report_step(2)
        deadline = time.monotonic() + 10
        while issued() < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        fast.read("user", steps[1])
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'tierstore_daemon_client_requests_total{client="fast",op="read"} 1.0' in body
        assert 'tierstore_daemon_client_step{client="slow"} 2.0' in body
        assert "tierstore_ddr_hits" in body or "tierstore_" in body
        fast.close()
        slow.close()
    finally:
        assert d.stop() == 0


# -- client-side HBM tier --------------------------------------------------------------------
def _ops(seed: int, n_ops: int = 40):
    """A random mix of reads and writes (repeated ids, with and without state) on both tables."""
    rng = np.random.default_rng(seed)
    for _ in range(n_ops):
        table, hi, width, dim = ("user", 300, 8, 8) if rng.random() < 0.6 else ("item", 250, 6, 4)
        ids = rng.integers(0, hi, int(rng.integers(1, 120)))
        with_state = table == "item" and rng.random() < 0.5
        if rng.random() < 0.5:
            yield "read", table, ids, with_state, None
        else:
            yield "write", table, ids, with_state, rng.standard_normal((len(ids), width if with_state else dim)).astype(np.float32)


def _run(store, ops) -> list[np.ndarray]:
    got = []
    for op, table, ids, with_state, values in ops:
        if op == "read":
            got.append(store.read(table, ids, with_state=with_state).numpy().copy())
        else:
            store.write(table, ids, values, with_state=with_state)
    return got


def test_hbm_tier_reads_are_bit_identical_with_and_without_it_and_to_an_embedded_store(store_path, sockdir):
    oracle_path, plain_path = store_path.parent / "oracle", store_path.parent / "plain"
    shutil.copytree(store_path, oracle_path)
    shutil.copytree(store_path, plain_path)
    d1, d2 = Daemon(store_path, sockdir / "a.sock", ddr_rows=100), Daemon(plain_path, sockdir / "b.sock", ddr_rows=100)
    try:
        claim = ["user", ("item", 0, 10_000)]
        cached = tierstore.open_store(store_path, daemon=str(d1.sock), claim=claim, hbm_rows={"user": 40, "item": 25})
        plain = tierstore.open_store(plain_path, daemon=str(d2.sock), claim=claim)
        with _embedded(oracle_path, hbm_rows=40, ddr_rows=100) as oracle:
            runs = [_run(s, _ops(5)) for s in (cached, plain, oracle)]
        for a, b, c in zip(*runs):
            assert np.array_equal(a, b) and np.array_equal(a, c)
        st = cached.stats()
        assert st["hbm"]["hits"] > 0 and st["hbm"]["misses"] > 0 and st["hbm"]["evictions"] > 0
        assert st["hbm"]["writebacks"] > 0  # dirty rows evicted from the tiny tier went back to the daemon
        assert plain.stats()["hbm"] == {"hits": 0, "misses": 0, "evictions": 0, "writebacks": 0}
        cached.flush()
        ro = tierstore.open_store(store_path, daemon=str(d1.sock), readonly=True)
        every = np.arange(300)
        assert np.array_equal(ro.read("user", every).numpy(), plain.read("user", every).numpy())
        assert np.array_equal(ro.read("item", every, with_state=True).numpy(), plain.read("item", every, with_state=True).numpy())
        for c in (cached, plain, ro):
            c.close()
    finally:
        assert d1.stop() == 0 and d2.stop() == 0


def test_hbm_rows_reach_the_daemon_on_eviction_and_flush_and_others_see_them_then(daemon, store_path):
    w = attach(daemon, store_path, claim=["user"], hbm_rows=10)
    ro = attach(daemon, store_path, readonly=True)
    w.read("user", np.arange(10))  # rows 0..9 now in w's HBM tier
    w.write("user", np.arange(10), np.full((10, 8), 7.0))
    assert w.resident_rows("user") == {"hbm": 10}
    assert torch.equal(w.read("user", [3]), torch.full((1, 8), 7.0))
    assert torch.equal(ro.read("user", [3]), torch.full((1, 8), 0.5))  # dirty in w's tier only: not yet at the daemon
    w.read("user", np.arange(100, 104))  # evicts the 4 least recently used: rows 0..3 (the read of 3 used it last)
    back = ro.read("user", np.arange(10)).numpy()[:, 0]
    assert sorted(np.flatnonzero(back == 7.0)) == [0, 1, 2, 4]  # evicted dirty rows went back; 3 was used later
    assert w.stats()["hbm"]["writebacks"] == 4
    w.flush()
    assert (ro.read("user", np.arange(10)).numpy() == 7.0).all()
    w.write("user", [5], np.full((1, 8), 8.0))
    w.close()  # close writes dirty rows back too
    assert torch.equal(ro.read("user", [5]), torch.full((1, 8), 8.0))
    ro.close()


HBM_VICTIM = textwrap.dedent("""
    import sys, numpy as np, tierstore
    c = tierstore.open_store(sys.argv[1], daemon=sys.argv[2], claim=["user"], hbm_rows=100, client="victim")
    c.read("user", np.arange(200, 260))
    c.write("user", np.arange(200, 210), np.full((10, 8), 2.0, dtype=np.float32))
    c.flush()
    c.write("user", np.arange(210, 220), np.full((10, 8), 4.0, dtype=np.float32))  # dirty in the HBM tier, never flushed
    c.write("user", np.arange(5000, 5010), np.full((10, 8), 6.0, dtype=np.float32))  # not cached: straight to the daemon
    print("dirty", flush=True)
    sys.stdin.readline()
""")


def test_client_killed_with_dirty_hbm_rows_loses_only_those(daemon, store_path):
    other = attach(daemon, store_path, claim=["item"])
    other.write("item", [1, 2], np.full((2, 4), 9.0))
    p = subprocess.Popen([sys.executable, "-c", HBM_VICTIM, str(store_path), str(daemon.sock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "dirty"
    p.kill()
    p.wait(10)
    c = attach_once_released(daemon, store_path, ["user"])
    rows = c.read("user", np.arange(200, 230)).numpy()
    assert (rows[:10] == 2.0).all()  # flushed
    assert np.array_equal(rows[10:], _initial_user_rows(store_path, np.arange(210, 230)))  # lost: initial values
    assert (c.read("user", np.arange(5000, 5010)).numpy() == 6.0).all()  # reached the daemon before the kill
    assert (other.read("item", [1, 2]).numpy() == 9.0).all()  # the other client's rows are untouched
    c.close()
    other.close()


# -- row-range claims ---------------------------------------------------------------------------
def test_row_range_claims_overlap_refused_and_writes_outside_them_refused(daemon, store_path):
    a = attach(daemon, store_path, claim=[("user", 0, 500)], client="a", hbm_rows=50)
    with pytest.raises(PermissionError, match=r"rows \[400, 500\) of table 'user' by client 'a'"):
        attach(daemon, store_path, claim=[("user", 400, 600)], client="b")
    with pytest.raises(PermissionError, match=r"rows \[0, 500\) of table 'user' by client 'a'"):
        attach(daemon, store_path, claim=["user"], client="b")
    b = attach(daemon, store_path, claim=[("user", 500, 1000), "item"], client="b")
    with pytest.raises(PermissionError, match=r"no write claim on row 499 of table 'user'; it is claimed by client 'a'"):
        b.write("user", [600, 499], np.zeros((2, 8)))
    b.write("user", [600], np.full((1, 8), 3.0))
    a.read("user", [10])  # row 10 in a's HBM tier
    with pytest.raises(PermissionError, match=r"row 700 of table 'user'; it is claimed by client 'b'.*rows \[0, 500\)"):
        a.write("user", [10, 700], np.full((2, 8), 1.0))
    assert torch.equal(a.read("user", [10]), torch.full((1, 8), 0.5))  # the refused write changed nothing
    # a read across a's range and b's rows: a's from its tier, b's from the daemon
    a.write("user", [10], np.full((1, 8), 1.0))
    assert a.read("user", [10, 600, 10]).numpy()[:, 0].tolist() == [1.0, 3.0, 1.0]
    for bad, err in ((("user", 5, 5), ValueError), (("user", -1, 5), ValueError), ([("user", 0, 10), ("user", 5, 20)], ValueError),
                     ([("user", "0", 10)], TypeError), ([3], TypeError)):
        with pytest.raises(err):
            attach(daemon, store_path, claim=bad)
    assert [c["claims"] for c in a.daemon_stats()["clients"]] == [[["user", 0, 500]], [["item", 0, 1 << 63], ["user", 500, 1000]]]
    a.close()
    c = attach(daemon, store_path, claim=[("user", 0, 500)])  # released on close
    c.close()
    b.close()


# -- shared memory ---------------------------------------------------------------------------
def test_large_payloads_go_through_shared_memory_and_match_the_socket_path(daemon, store_path):
    shm = attach(daemon, store_path, claim=["user"])
    sock_only = attach(daemon, store_path, readonly=True, shm_bytes=0)
    assert shm._shm is not None and sock_only._shm is None
    ids = np.random.default_rng(2).integers(0, 10_000, 5000)  # 160 KB of rows: above the 64 KiB threshold
    values = np.random.default_rng(3).standard_normal((5000, 8)).astype(np.float32)
    shm.write("user", ids, values)
    reply = shm._request(wire.Frame(wire.READ, text="user", ids=ids))
    assert reply.flags & wire.IN_SHM and reply.rows.shape == (5000, 8)
    got, out = shm.read("user", ids), torch.empty((5000, 8))
    assert shm.read("user", ids, out=out) is out and torch.equal(out, got)
    assert torch.equal(got, sock_only.read("user", ids))
    last = {i: v for i, v in zip(ids.tolist(), values)}  # the last value of a repeated id wins
    assert np.array_equal(got.numpy(), np.stack([last[i] for i in ids.tolist()]))
    assert sorted(c["shm_bytes"] for c in shm.daemon_stats()["clients"]) == [0, 64 << 20]
    # threads sharing one client take turns with its segment: each gets its own rows
    from concurrent.futures import ThreadPoolExecutor

    sets = [np.random.default_rng(10 + i).integers(0, 10_000, 6000) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda k: shm.read("user", sets[k % 4]), range(16)))
    for k, rows in enumerate(results):
        assert torch.equal(rows, sock_only.read("user", sets[k % 4]))
    shm.close()
    sock_only.close()


def _hello_shm(s: socket.socket, size: int = 1 << 20) -> wire.Segment:
    import json

    wire.send_frame(s, wire.Frame(wire.HELLO, text=json.dumps({"client": "raw", "claims": ["item"], "shm_bytes": size})))
    reply = wire.recv_frame(s, wire.Limits())
    wire.raise_for(reply)
    return wire.recv_segment(s, reply.json()["shm_bytes"])


def test_malformed_shared_memory_frames_are_rejected_and_the_daemon_keeps_serving(daemon, store_path):
    good = attach(daemon, store_path, readonly=True)
    size = 1 << 20
    bad_refs = [
        (wire.READ, 0, 10, 0, 0, (size - 8, 0)),  # ids run past the segment
        (wire.WRITE, 0, 10, 10, 4, (0, size - 64)),  # rows run past the segment
        (wire.WRITE, 0, 10, 10, 4, (0, 40)),  # ids and rows overlap
        (wire.READ, 0, 10, 0, 0, (3, 0)),  # misaligned
        (wire.READ, 0, 10, 0, 0, (1 << 63, 0)),  # absurd offset
    ]
    for ftype, flags, n_ids, n_rows, n_cols, ref in bad_refs:
        s = raw_conn(daemon.sock)
        seg = _hello_shm(s, size)
        s.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, ftype, 0, flags | wire.IN_SHM, 4, n_ids, n_rows, n_cols)
                  + wire.SHM_REF.pack(*ref) + b"item")
        reply = wire.recv_frame(s, wire.Limits(), shm=seg)
        assert reply.status != wire.OK and "shared-memory" in reply.text, ref
        assert_closed(s)
        s.close()
        seg.close()
    # an IN_SHM frame on a connection that negotiated no segment
    s = raw_conn(daemon.sock)
    _hello(s)
    s.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.READ, 0, wire.IN_SHM, 4, 1, 0, 0) + wire.SHM_REF.pack(0, 0) + b"user")
    reply = wire.recv_frame(s, wire.Limits())
    assert reply.status != wire.OK and "none was set up" in reply.text
    assert_closed(s)
    s.close()
    # a well-formed one on the raw connection works, ids read from the segment
    s = raw_conn(daemon.sock)
    seg = _hello_shm(s, size)
    seg.array(0, "<i8", (3,))[:] = [5, 2**40, 5]
    s.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.READ, 0, wire.IN_SHM, 4, 3, 0, 0) + wire.SHM_REF.pack(0, 0) + b"item")
    reply = wire.recv_frame(s, wire.Limits(), shm=seg)
    wire.raise_for(reply)
    assert reply.rows.shape == (3, 4)
    s.close()
    seg.close()
    assert torch.equal(good.read("user", [3]), torch.full((1, 8), 0.5))  # the others were served throughout
    good.close()



@contextlib.contextmanager
def _client_and_embedded_twin(tmp_path, sockdir):
    """A daemon client (HBM tier 50 rows, daemon DDR 100) and an embedded store
    with the same tiers, over copies of one store with an Adagrad-ready table "t"."""
    spec = tierstore.TableSpec("t", 1000, 8, init=tierstore.RowInit.uniform(-1, 1, seed=1), state_dim=Adagrad(lr=0.1).state_dim(8))
    with _embedded(tmp_path / "a", tables=[spec]):
        pass
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    d = Daemon(tmp_path / "a", sockdir / "d.sock", ddr_rows=100)
    try:
        client = tierstore.open_store(tmp_path / "a", daemon=str(d.sock), claim=["t"], hbm_rows=50)
        with _embedded(tmp_path / "b", hbm_rows=50, ddr_rows=100) as local:
            yield client, local
        client.close()
    finally:
        assert d.stop() == 0


def test_embedding_bag_with_adagrad_through_a_daemon_client_with_hbm_matches_an_embedded_store(tmp_path, sockdir):
    with _client_and_embedded_twin(tmp_path, sockdir) as (client, local):
        bags = [tierstore.TieredEmbeddingBag(1000, 8, store=s, table="t", optimizer=Adagrad(lr=0.1), mode="sum") for s in (client, local)]
        g = torch.Generator().manual_seed(0)
        for step in range(12):
            x, offsets = torch.randint(0, 1000, (64,), generator=g), torch.arange(0, 64, 4)
            assert bags[0].prefetch(x, offsets).done()
            outs = [bag(x, offsets) for bag in bags]
            assert torch.equal(outs[0], outs[1]), step
            for y in outs:
                (y ** 2).sum().backward()
        every = np.arange(1000)
        assert torch.equal(client.read("t", every, with_state=True), local.read("t", every, with_state=True))
        assert client.stats()["hbm"]["writebacks"] > 0


def test_a_daemon_clients_forward_pools_in_its_hbm_tier_and_trains_bit_identical_to_an_embedded_store(tmp_path, sockdir):
    """The client's HBM tier steps as an embedded store's tiers do (one TableStore step over
    the daemon): a forward over rows it holds pools from the tier in place and its backward
    updates them there (trainer.resident), reads of more rows than it holds still work,
    and the rows, their state and the HBM counts equal an embedded store's."""
    with _client_and_embedded_twin(tmp_path, sockdir) as (client, local):
        bags = [tierstore.TieredEmbeddingBag(1000, 8, store=s, table="t", optimizer=Adagrad(lr=0.1), mode="sum") for s in (client, local)]
        g = torch.Generator().manual_seed(1)
        for step in range(17):
            hi = 1000 if step % 4 == 3 else 60  # mostly a working set near the 50-row tier, now and then wider than it
            x, offsets = torch.randint(0, hi, (64,), generator=g), torch.arange(0, 64, 4)
            outs = [bag(x, offsets) for bag in bags]
            assert torch.equal(outs[0], outs[1]), step
            for y in outs:
                (y ** 2).sum().backward()
        ids = torch.unique(x)[:8]  # used by the last step: in both HBM tiers
        for s in (client, local):
            with s.trainer("t").resident(ids) as hit:
                assert hit is not None and hit.tier is not None
                held = hit.tier.weights[hit.slots].clone()
            assert torch.equal(held, s.read("t", ids))
        hbm = [{k: v for k, v in s.stats()["hbm"].items() if k != "writebacks"} for s in (client, local)]
        assert hbm[0] == hbm[1] and hbm[0]["hits"] > 0 and hbm[0]["evictions"] > 0
        every = np.arange(1000)
        assert torch.equal(client.read("t", every, with_state=True), local.read("t", every, with_state=True))
        client.flush()  # the in-place updates, dirty in the client's tier, reach the daemon with their state
        ro = tierstore.open_store(tmp_path / "a", daemon=str(client.socket_path), readonly=True)
        assert torch.equal(ro.read("t", every, with_state=True), local.read("t", every, with_state=True))
        ro.close()


def test_lookahead_loader_over_a_daemon_client_sends_hints_and_trains_like_an_embedded_store(tmp_path, sockdir):
    with _client_and_embedded_twin(tmp_path, sockdir) as (client, local):
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randint(0, 1000, (64,), generator=g), torch.arange(0, 64, 4)) for _ in range(10)]
        for store in (client, local):
            bag = tierstore.TieredEmbeddingBag(1000, 8, store=store, table="t", optimizer=Adagrad(lr=0.1), mode="sum")
            seen = []
            for x, offsets in tierstore.LookaheadLoader(batches, bag, depth=3):
                seen.append(x)
                (bag(x, offsets) ** 2).sum().backward()
            assert all(torch.equal(a, b) for a, (b, _) in zip(seen, batches)) and len(seen) == len(batches)
        every = np.arange(1000)
        assert torch.equal(client.read("t", every, with_state=True), local.read("t", every, with_state=True))
        assert client.daemon_stats()["prefetch"]["t"]["issued_batches"] == len(batches)  # every batch announced to the daemon



# -- admission and TTL through the daemon (README "Unbounded id spaces") ---------------------
POOL = np.random.default_rng(5).choice(1 << 62, 400, replace=False).astype(np.int64)  # ids over the 63-bit space


@pytest.mark.parametrize("admit_after, ttl, kernels", [(1, 4, "torch"), (3, None, "torch"), (2, 4, "torch"), (2, 4, "fbgemm")],
                         ids=["ttl", "admission", "both", "both-fbgemm"])
def test_admission_and_ttl_train_through_a_daemon_bit_identical_to_an_embedded_store(tmp_path, sockdir, admit_after, ttl, kernels):
    """Pairs of forwards before their backwards: the first backward's rows went stale,
    so it re-reads them (REREAD, not a step) and asks which it may keep (ADMITTED)."""
    if kernels == "fbgemm":
        _fbgemm()  # skips without FBGEMM (optional peer)
    opt = Adagrad(lr=0.3)
    spec = tierstore.TableSpec("t", None, 4, init=tierstore.RowInit.normal(0, 0.1, seed=2), state_dim=opt.state_dim(4),
                               admit_after=admit_after, ttl_steps=ttl, admit_width=1 << 16)
    with _embedded(tmp_path / "a", tables=[spec]):
        pass
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    d = Daemon(tmp_path / "a", sockdir / "d.sock", "--metrics-port", "0", ddr_rows=64)
    port = d.metrics_port
    try:
        client = tierstore.open_store(tmp_path / "a", daemon=str(d.sock), claim=["t"], client="trainer")
        with pytest.raises(ValueError, match="admit_after, ttl_steps or evict_l2_below.*hbm_rows"):
            tierstore.open_store(tmp_path / "a", daemon=str(d.sock), readonly=False, hbm_rows={"t": 8}, client="cached")
        with _embedded(tmp_path / "b", hbm_rows=16, ddr_rows=64) as local:
            bags = [tierstore.TieredEmbeddingBag(None, 4, store=s, table="t", optimizer=opt, mode="sum", kernels=kernels)
                    for s in (client, local)]
            g = torch.Generator().manual_seed(0)
            for step in range(12):
                batches = [(torch.from_numpy(POOL)[(torch.rand(32, generator=g) ** 3 * len(POOL)).long()], torch.arange(0, 32, 4))
                           for _ in range(2)]
                targets = torch.randn(2, 8, 4, generator=g)
                for bag in bags:
                    outs = [bag(x, offsets) for x, offsets in batches]
                    for out, target in zip(outs[::-1], targets.flip(0)):  # the later forward's backward first
                        ((out - target) ** 2).sum().backward()
            client.flush()
            local.flush()
            life, twin = client.stats(per_table=True)["t"]["rows"], local.stats(per_table=True)["t"]["rows"]
            # rows on disk, and so expiries and evictions, depend on how far the background sweep got; the sketch's do not
            assert (life["admitted"], life["rejected"]) == (twin["admitted"], twin["rejected"])
            assert (life["rejected"] > 0) == (admit_after > 1) and (life["expired"] + life["evicted"] > 0) == (ttl is not None)
            # a read is a step with these rules: every row, once, last
            rows = client.read("t", POOL, with_state=True)
            assert torch.equal(rows, local.read("t", POOL, with_state=True))
            init = torch.from_numpy(initial_rows(spec, POOL))
            assert (rows[:, :4] != init[:, :4]).any(1).sum() > 10, "some rows must have been trained"
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            assert 'tierstore_daemon_client_requests_total{client="trainer",op="reread"}' in body
            assert ('tierstore_daemon_client_requests_total{client="trainer",op="admitted"}' in body) == (admit_after > 1)
        client.close()
    finally:
        assert d.stop() == 0


def test_admission_requests_keep_the_protocol_rules(tmp_path, sockdir):
    spec = tierstore.TableSpec("t", None, 4, admit_after=2, ttl_steps=3)
    with _embedded(tmp_path / "s", tables=[spec]):
        pass
    d = Daemon(tmp_path / "s", sockdir / "d.sock", "--max-inflight-mib", "1")
    try:
        c = tierstore.open_store(tmp_path / "s", daemon=str(d.sock), claim=["t"], shm_bytes=0)
        with pytest.raises(ValueError, match="sorted and unique"):
            c._request(wire.Frame(wire.REREAD, text="t", ids=np.array([5, 3], dtype=np.int64)))
        with pytest.raises(KeyError, match="unknown table 'nope'"):
            c._request(wire.Frame(wire.ADMITTED, text="nope", ids=np.array([1], dtype=np.int64)))
        with pytest.raises(ValueError, match="cannot be split: read fewer ids"):
            c.read("t", np.arange(100_000))  # past one frame: it would count as several steps
        c.read("t", [1, 2])
        c.read("t", [2])
        assert c.trainer("t").admitted(torch.tensor([1, 2, 3])).tolist() == [False, True, False]
        assert torch.equal(c.trainer("t").reread(torch.tensor([1, 2])), c.read("t", [1, 2], with_state=True))
        assert c.stats(per_table=True)["t"]["rows"]["admitted"] == 3  # 0, 1 (id 2), 2: re-reads and queries are no steps
        c.close()
    finally:
        assert d.stop() == 0


def test_evict_through_a_client_deletes_rows_everywhere_within_its_claims(daemon, store_path):
    c = attach(daemon, store_path, claim=[("user", 0, 50)], hbm_rows=10)
    c.read("user", [1, 2])
    c.write("user", [1], torch.full((1, 8), 7.0))  # dirty in the client's HBM tier
    with pytest.raises(PermissionError, match="no write claim on row 60"):
        c.evict("user", [1, 2, 3, 60])
    with pytest.raises(PermissionError, match="no write claim on row 60"):  # the daemon checks claims too
        c._request(wire.Frame(wire.EVICT, text="user", ids=np.array([60], dtype=np.int64)))
    assert torch.equal(c.read("user", [60]), torch.full((1, 8), 0.5))
    assert torch.equal(c.read("user", [1, 2, 3]), torch.tensor([[7.0] * 8, [0.5] * 8, [0.5] * 8]))  # nothing changed
    with pytest.raises(PermissionError, match="readonly"):
        attach(daemon, store_path, readonly=True).evict("user", [70])
    assert c.evict("user", [3, 1, 2, 1]) == 3 and c.evict("user", []) == 0
    assert np.array_equal(c.read("user", [1, 2, 3]).numpy(), _initial_user_rows(store_path, [1, 2, 3]))
    c.flush()
    other = attach(daemon, store_path, readonly=True)
    assert np.array_equal(other.read("user", [1, 2, 3, 4]).numpy()[:3], _initial_user_rows(store_path, [1, 2, 3]))
    assert torch.equal(other.read("user", [4]), torch.full((1, 8), 0.5))
    c.close()
    other.close()

# -- limits: descriptors, memory, connection bursts ----------------------------------------
def _fd_limit(n: int):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def _hello_many(sock, n: int, check_refused=lambda s: None) -> tuple[list, list[str]]:
    """n raw connections saying hello: those attached (held open) and the refusals' messages."""
    held, refused = [], []
    for _ in range(n):
        s = raw_conn(sock)
        try:
            _hello(s)
            held.append(s)
        except wire.DaemonBusyError as e:
            refused.append(str(e))
            check_refused(s)
            s.close()
    return held, refused


def test_daemon_busy_error_keeps_the_import_path_the_manual_named():
    import tierstore.wire  # the wire format moved to tierstore.daemon.wire; this path was documented

    assert tierstore.wire.DaemonBusyError is tierstore.DaemonBusyError is wire.DaemonBusyError


def test_connections_past_the_fd_limit_are_refused_and_stalled_ones_dropped(store_path, sockdir):
    d = Daemon(store_path, sockdir / "d.sock", "--frame-timeout", "1", preexec_fn=_fd_limit(128))
    held, refused = _hello_many(d.sock, 120, assert_closed)  # attached and idle: each holds a descriptor in the daemon
    assert held and refused and "--max-clients" in refused[0], (len(held), refused[:1])
    with pytest.raises(wire.DaemonBusyError, match="maximum of"):  # the documented ConnectionError, from the client
        attach(d, store_path, readonly=True)
    for s in held:
        s.close()
    deadline = time.monotonic() + 30
    while True:  # the daemon notices the hang-ups, then serves again
        try:
            c = attach(d, store_path, readonly=True)
            break
        except wire.DaemonBusyError:
            assert time.monotonic() < deadline, "closed connections were never released"
            time.sleep(0.05)
    # a connection that never says HELLO, and one that sends half a header and stalls, are
    # closed after --frame-timeout with an error saying so
    silent, stalled = raw_conn(d.sock), raw_conn(d.sock)
    _hello(stalled)
    stalled.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.READ, 0, 0, 4, 1, 0, 0)[:10])
    with pytest.raises(ConnectionError, match="no HELLO within 1 s"):
        wire.raise_for(wire.recv_frame(silent, wire.Limits()))
    with pytest.raises(ValueError, match="frame timeout"):
        wire.raise_for(wire.recv_frame(stalled, wire.Limits()))
    for s in (silent, stalled):
        assert_closed(s)
        s.close()
    assert torch.equal(c.read("user", [3]), torch.full((1, 8), 0.5))
    c.close()
    assert d.proc.poll() is None and d.stop() == 0


def test_an_idle_client_is_disconnected_and_its_next_call_says_why(store_path, sockdir):
    d = Daemon(store_path, sockdir / "d.sock", "--idle-timeout", "1")
    c = attach(d, store_path, readonly=True)
    c.read("user", [1])
    import select

    hangup = select.poll()
    hangup.register(c._sock, select.POLLRDHUP)
    assert hangup.poll(30_000)  # the daemon closed the connection (its parting frame waits unread)
    with pytest.raises(ConnectionError, match="after 1 s without a request .*--idle-timeout"):
        c.read("user", [1])
    with pytest.raises(RuntimeError, match="is closed"):
        c.read("user", [1])
    again = attach(d, store_path, readonly=True)
    assert torch.equal(again.read("user", [3]), torch.full((1, 8), 0.5))
    again.close()
    assert d.stop() == 0


def test_calls_past_the_frame_limit_are_split_and_match_an_embedded_store(tmp_path, store_path, sockdir):
    shutil.copytree(store_path, tmp_path / "twin")
    d = Daemon(store_path, sockdir / "d.sock", "--max-inflight-mib", "1")  # frames of at most 1 MiB
    c = attach(d, store_path, claim=["user", ("item", 0, 1000)])
    assert c._max_frame == 1 << 20
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 10_000, 60_000)  # 2.4 MB of rows: several frames each way, repeated ids among them
    values = rng.standard_normal((len(ids), 8)).astype(np.float32)
    c.write("user", ids, values)
    item_ids = rng.integers(0, 1000, 60_000)
    item_rows = rng.standard_normal((len(item_ids), 6)).astype(np.float32)
    c.write("item", item_ids, item_rows, with_state=True)
    before = c.read("item", np.arange(1000), with_state=True)
    with pytest.raises(PermissionError, match="no write claim on row 1000"):  # refused whole: no frame of it applied
        c.write("item", np.r_[np.arange(60_000), 1000], np.ones((60_001, 6), np.float32), with_state=True)
    assert torch.equal(c.read("item", np.arange(1000), with_state=True), before)
    got = c.read("user", ids)
    got_item = c.read("item", item_ids, with_state=True)
    c.close()
    assert d.stop() == 0
    with _embedded(tmp_path / "twin") as twin:
        twin.write("user", ids, values)
        twin.write("item", item_ids, item_rows, with_state=True)
        assert torch.equal(got, twin.read("user", ids))
        assert torch.equal(got_item, twin.read("item", item_ids, with_state=True))


def _status(pid: int, key: str) -> int:
    """A /proc/PID/status figure in bytes (VmRSS, VmHWM: kB there)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(key)


def test_daemon_memory_follows_the_inflight_bound_not_the_clients(store_path, sockdir):
    from concurrent.futures import ThreadPoolExecutor

    inflight = 32 << 20
    d = Daemon(store_path, sockdir / "d.sock", "--max-inflight-mib", str(inflight >> 20), "--shm-total-mib", "8")
    warm = attach(d, store_path, readonly=True)
    warm.read("user", np.arange(10_000))  # the store's own first-use allocations, before the baseline
    clients = [attach(d, store_path, readonly=True, shm_bytes=0) for _ in range(8)]  # private buffers: the worst case
    Path(f"/proc/{d.proc.pid}/clear_refs").write_text("5")  # VmHWM restarts from the RSS now
    base = _status(d.proc.pid, "VmRSS")
    ids = np.random.default_rng(0).integers(0, 10_000, 1_000_000)  # 40 MB per call: max-size frames, eight clients at once
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: c.read("user", ids), clients * 2))
    peak = _status(d.proc.pid, "VmHWM") - base
    print(f"daemon RSS peak {peak >> 20} MiB above its {base >> 20} MiB baseline")
    assert peak <= 2 * inflight + (64 << 20), f"daemon RSS grew by {peak >> 20} MiB"  # the README's bound
    assert all(torch.equal(r, results[0]) for r in results)
    for c in clients:
        c.close()
    # a finished client's segment is unmapped at once, not at the next connection
    seg = attach(d, store_path, readonly=True, shm_bytes=8 << 20)
    assert seg._shm is not None and attach(d, store_path, readonly=True)._shm is None  # past --shm-total-mib: the socket
    seg.read("user", ids[:200_000])
    maps = Path(f"/proc/{d.proc.pid}/maps")
    assert "tierstore-prefetchd" in maps.read_text()
    seg.close()
    deadline = time.monotonic() + 30
    while "tierstore-prefetchd" in maps.read_text():
        assert time.monotonic() < deadline, "a closed client's segment is still mapped in the daemon"
        time.sleep(0.05)
    warm.close()
    assert d.stop() == 0


def test_a_burst_of_100_clients_attaches_and_a_full_queue_gives_the_documented_error(daemon, store_path, sockdir):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    start = threading.Barrier(100)

    def one(_):
        start.wait()
        c = attach(daemon, store_path, readonly=True, shm_bytes=0)
        try:
            return c.read("user", [3])
        finally:
            c.close()

    with ThreadPoolExecutor(100) as pool:
        rows = list(pool.map(one, range(100)))
    assert all(torch.equal(r, torch.full((1, 8), 0.5)) for r in rows)
    # a listener that never accepts: once its queue is full, connect() retries, then DaemonBusyError
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sockdir / "q.sock"))
    listener.listen(0)
    queued = []
    with pytest.raises(BlockingIOError):  # fill its queue
        while True:
            queued.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            queued[-1].setblocking(False)
            queued[-1].connect(str(sockdir / "q.sock"))
    with pytest.raises(wire.DaemonBusyError, match="listen queue stayed full"):
        tierstore.open_store(store_path, daemon=str(sockdir / "q.sock"), readonly=True, timeout=0.5)
    for s in queued + [listener]:
        s.close()


def test_snapshot_is_what_stats_and_metrics_report_as_plain_values(store_path, sockdir):
    """The daemon's one public view of its clients and counts: STATS and the scrape show
    its figures, and a snapshot taken stays as it was while the daemon goes on."""
    import dataclasses
    import json
    import threading

    from prometheus_client import generate_latest

    from tierstore.daemon.config import DaemonConfig
    from tierstore.daemon.server import Daemon as Prefetchd

    registry = CollectorRegistry()
    d = Prefetchd(DaemonConfig(store_path, sockdir / "d.sock", 1000), registry=registry)
    serving = threading.Thread(target=d.serve)
    serving.start()
    try:
        w = tierstore.open_store(store_path, daemon=str(sockdir / "d.sock"), claim=["item", ("user", 0, 50)], client="w")
        r = tierstore.open_store(store_path, daemon=str(sockdir / "d.sock"), readonly=True, client="r")
        w.write("item", [1, 2], np.ones((2, 4), np.float32))
        w.report_step(3)
        r.read("user", [1, 2, 3])
        snap = d.snapshot()
        assert (snap.connections, snap.requests, snap.rows) == (
            2, {"w": {"write": 1, "step": 1}, "r": {"read": 1}}, {"w": {"write": 2, "step": 0}, "r": {"read": 3}})
        stats = r.daemon_stats()
        assert json.loads(json.dumps([dataclasses.asdict(c) for c in snap.clients])) == stats["clients"]
        assert stats["metrics_port"] is None  # no --metrics-port
        assert [(c.name, c.claims, c.n_claims, c.readonly, c.step) for c in snap.clients] == [
            ("w", (("item", 0, 1 << 63), ("user", 0, 50)), 2, False, 3), ("r", (), 0, True, None)]
        scrape = generate_latest(registry).decode()
        for line in ('tierstore_daemon_client_requests_total{client="w",op="write"} 1.0',
                     'tierstore_daemon_client_rows_total{client="r",op="read"} 3.0',
                     'tierstore_daemon_client_step{client="w"} 3.0', "tierstore_daemon_clients 2.0"):
            assert line in scrape
        r.read("user", [4])
        r.close()
        assert snap.requests["r"] == {"read": 1} and len(snap.clients) == 2  # copies, not the daemon's live state
        with pytest.raises(dataclasses.FrozenInstanceError):
            snap.connections = 0
        deadline = time.monotonic() + 10
        while d.snapshot().connections != 1:  # the daemon notices r's hang-up
            assert time.monotonic() < deadline, "a closed client is still counted"
            time.sleep(0.05)
        now = d.snapshot()
        assert now.requests["r"] == {"read": 2} and [c.name for c in now.clients] == ["w"]
        w.close()
    finally:
        d.stop()
        serving.join(30)


def test_socket_in_a_missing_directory_is_named_with_the_fix(store_path, sockdir):
    from tierstore.daemon.config import DaemonConfig
    from tierstore.daemon.server import Daemon as Prefetchd

    missing = sockdir / "nope" / "d.sock"
    with pytest.raises(FileNotFoundError, match=f"{sockdir / 'nope'}.*mkdir -p"):
        Prefetchd(DaemonConfig(store_path, missing, 10))
    assert not (sockdir / "nope").exists()
    with pytest.raises(ConnectionError, match=f"directory of daemon socket {missing} does not exist"):
        tierstore.open_store(store_path, daemon=str(missing), readonly=True)


def test_accept_out_of_descriptors_refuses_and_keeps_serving(store_path, sockdir):
    import resource

    d = Daemon(store_path, sockdir / "d.sock")  # its connection cap is sized for a limit we then lower under it
    c = attach(d, store_path, readonly=True)
    c.read("user", [1])
    fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
    _, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (fds + 2, hard))  # the daemon's next accepts hit EMFILE
    held, refused = _hello_many(d.sock, 8)
    assert any("no file descriptor left" in m for m in refused), refused  # told why, by the EMFILE path
    assert d.proc.poll() is None  # and still serving
    assert torch.equal(c.read("user", [3]), torch.full((1, 8), 0.5))  # attached clients go on
    for s in held:
        s.close()
    c.close()
    assert d.stop() == 0
