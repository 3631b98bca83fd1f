"""``tierstore prefetchd``: one process per host that owns a store's DDR tier and
LMDB files and serves them to trainer processes over a Unix socket.

Clients attach with ``tierstore.open_store(PATH, daemon=SOCK, claim=[...])``
(tierstore/client.py); the frames are described in tierstore/wire.py.

Claims: each client names the tables or ``(table, lo, hi)`` row ranges it
writes in its HELLO (at most ``max_claims``); the daemon keeps every client's
claims of a table in one sorted array, so a HELLO is checked with binary
searches, not against each claim held. It refuses a claim that overlaps another
client's, and refuses WRITE frames touching rows outside the sender's claims. A client with an HBM tier caches only its claimed rows (see
tierstore/client.py), so no other client's write can make its copy stale.

Durability: WRITE frames go straight into the daemon's store (its DDR tier,
else LMDB) and become durable at the next FLUSH from anyone, or when the
daemon stops (SIGTERM/SIGINT flush before exit). A client killed mid-write
loses at most the frame it was sending (a partial frame is never applied)
plus the dirty rows of its own HBM tier, and its claims are released at once;
rows it wrote that nobody flushed stay in the daemon's cache and are flushed
with everything else. A daemon killed with SIGKILL loses the rows written
since the last flush, like an embedded store.

Limits: at most ``max_clients`` connections (by default as many as the
open-file limit allows, up to 1024); the excess is told DaemonBusyError and
closed, and an accept() that finds no free descriptor refuses that one
connection, never the daemon. A connection must send HELLO within
``frame_timeout``, finish each frame it begins within it, and read each
reply within it; one idle for ``idle_timeout`` is closed (with a
ConnectionError reply saying so). Memory: each frame's payload, plus a
READ's reply, a PREFETCH's working copies or a HELLO's parsed JSON, is
reserved from ``max_inflight_bytes`` before anything is allocated for it (a
frame waits until it fits), and segments are granted from
``shm_total_bytes``; a finished connection's segment and buffers go at once.
Prefetch hints the store keeps (their ids, the rows they pin) hold at most
half of ``max_inflight_bytes``, all clients together: a hint that would pass
it first drops the oldest hints of the client holding the most (see _hint).

Concurrency: one thread per connection. Frames are read and written outside
the store's lock, and READ rows are gathered straight into the client's
shared-memory segment. A read whose rows are all in the DDR tier holds the
store's lock only for the lookup and the policy update, and gathers outside
it, so several clients' gathers run at once (TieredStore.read).
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import resource
import signal
import socket
import stat
import struct
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierstore import wire
from tierstore.memory import parse_bytes
from tierstore.store import as_ids
from tierstore.tools.cli import nonneg_float, nonneg_int, positive_float, positive_int
from tierstore.tools.stats import require_store
from tierstore.validate import check_int, check_number

log = logging.getLogger("tierstore.prefetchd")

# What a prefetch hint costs the daemon's store while it is held: its sorted unique ids
# (the announced window) and the staging slots it pins, 8 B an id each at most.
HINT_BYTES_PER_ID = 16
# What taking a hint in costs beyond its frame, reserved with it: a sorted unique copy, masks
# and slot lookups (measured: ~30 B an id above the frame's 8).
PREFETCH_WORK_PER_ID = 32
# A HELLO's JSON as Python objects, per byte of its text (measured ~8x for a claim list).
HELLO_WORK_PER_BYTE = 16
STATS_CLAIMS = 16  # claims STATS lists per client (and how many it has)
MAX_NAMED_CLIENTS = 4096  # client names whose counters are kept apart; later names share one
OTHER_CLIENTS = "(other clients)"


@dataclass
class DaemonConfig:
    path: Path
    socket: Path
    ddr_rows: int | None  # None: derived from memory_budget
    policy: str = "lru"
    lookahead_source: Path | None = None
    depth: int = 2
    metrics_port: int | None = None
    limits: wire.Limits | None = None  # frames it accepts; default: max_bytes = min(64 MiB, max_inflight_bytes)
    max_hints: int = 64  # outstanding prefetch hints per client; older ones are released (unpinned)
    max_claims: int = 1024  # row ranges one client may claim in its HELLO
    shm_max_bytes: int = 1 << 30  # largest shared-memory segment granted to one client; 0 = none
    shm_threshold: int = 1 << 16  # frames with more array bytes than this go through the segment
    max_clients: int | None = None  # None: as many as the open-file limit allows, at most 1024
    idle_timeout: float = 3600.0  # seconds an attached client may send nothing; 0 = forever
    frame_timeout: float = 30.0  # seconds to send HELLO, finish a begun frame, read a reply
    max_inflight_bytes: int = 256 << 20  # frame payloads + READ replies being handled at once
    shm_total_bytes: int = 4 << 30  # all clients' shared-memory segments together
    memory_budget: int | str | None = None  # the store's (TieredStore memory_budget=): bytes, or "1GiB"

    def __post_init__(self):
        self.path, self.socket = Path(self.path), Path(self.socket)
        if self.memory_budget is not None:
            self.memory_budget = parse_bytes(self.memory_budget, "--memory-budget")
        elif self.ddr_rows is None:
            raise ValueError("give --ddr-rows N (rows of the DDR tier per table) or --memory-budget SIZE (which sizes it)")
        check_int(self.ddr_rows, "--ddr-rows", none=True)
        check_int(self.depth, "--depth", at_least=1)
        check_int(self.max_hints, "max_hints", at_least=1)
        check_int(self.max_claims, "--max-claims", at_least=1)
        for name in ("shm_max_bytes", "shm_threshold", "shm_total_bytes"):
            check_int(getattr(self, name), name)
        check_int(self.max_inflight_bytes, "--max-inflight-mib: max_inflight_bytes", at_least=1 << 16)
        check_int(self.max_clients, "--max-clients", at_least=1, none=True)
        check_number(self.idle_timeout, "--idle-timeout", meaning="seconds; 0 = forever", finite=False)
        check_number(self.frame_timeout, "--frame-timeout", above=True, meaning="seconds", finite=False)
        if self.limits is None:
            self.limits = wire.Limits(max_bytes=min(64 << 20, self.max_inflight_bytes))
        if self.limits.max_bytes > self.max_inflight_bytes:
            raise ValueError(f"limits.max_bytes {self.limits.max_bytes} exceeds max_inflight_bytes {self.max_inflight_bytes}: "
                             "one frame could never be admitted; lower the one or raise the other")
        if self.lookahead_source is not None:
            self.lookahead_source = Path(self.lookahead_source)
        if len(os.fsencode(self.socket)) >= 104:  # sun_path is 108 bytes on Linux, 104 on BSDs
            raise ValueError(f"socket path {self.socket} is too long for a Unix socket (< 104 bytes); use a shorter path")


class _Session:
    """One connected client."""

    def __init__(self, conn: socket.socket, number: int):
        self.conn = conn
        self.number = number
        self.name = f"conn{number}"
        self.pid: int | None = None
        self.ranges: dict[str, np.ndarray] = {}  # table -> its sorted claimed (lo, hi), a wire.range_array
        self.shm: wire.Segment | None = None
        self.readonly = True
        self.hello = False
        self.step: int | None = None
        self.hints: deque = deque()  # (ticket, bytes counted for it), oldest first
        self.hint_bytes = 0

    def claims(self, limit: int | None = None) -> list[tuple[str, int, int]]:
        """The first ``limit`` (default: all) of its claims, (table, lo, hi) half-open, sorted; see wire.parse_claims."""
        out = []
        for t, r in self.ranges.items():
            out += [(t, int(lo), int(hi)) for lo, hi in r[:None if limit is None else limit - len(out)]]
        return out

    def describe(self) -> str:
        return f"client {self.name!r} (pid {self.pid})" if self.pid else f"client {self.name!r}"

    def describe_claims(self) -> str:
        return "; ".join(wire.describe_ranges(t, r) for t, r in self.ranges.items()) or "none"


class _ClaimIndex:
    """Every client's claimed row ranges of one table: sorted, disjoint, as arrays, so a
    HELLO's claims are checked with one binary search each, not against every claim held
    (45,000 ranges compared pairwise held the daemon's lock for minutes)."""

    def __init__(self):
        self.ranges = wire.range_array([])  # (lo, hi), sorted by lo; disjoint, so sorted by hi too
        self.owners = np.empty(0, dtype=np.int64)  # session numbers

    def overlaps(self, ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of ``ranges``, which held range) for each of the sorted, disjoint
        ``ranges`` that overlaps a held one (the first it overlaps)."""
        first = np.searchsorted(self.ranges[:, 1], ranges[:, 0], side="right")  # the first held range ending after lo
        past = np.searchsorted(self.ranges[:, 0], ranges[:, 1], side="left")  # held ranges from here start at or after hi
        new = np.flatnonzero(first < past)
        return new, first[new]

    def add(self, ranges: np.ndarray, owner: int) -> None:
        """Ranges that overlap none held (checked by the caller)."""
        at = np.searchsorted(self.ranges[:, 0], ranges[:, 0])
        self.ranges = np.insert(self.ranges, at, ranges, axis=0)
        self.owners = np.insert(self.owners, at, owner)

    def remove(self, owner: int) -> None:
        keep = self.owners != owner
        self.ranges, self.owners = self.ranges[keep], self.owners[keep]

    def holder(self, row: int) -> int | None:
        """The session number that claims ``row``, if any."""
        i = int(np.searchsorted(self.ranges[:, 0], np.uint64(row), side="right")) - 1
        return int(self.owners[i]) if i >= 0 and row < int(self.ranges[i, 1]) else None


class _Budget:
    """Bytes handed out to frames in flight; a frame waits until its share fits,
    so memory follows this total, not the number of connections."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0
        self._freed = threading.Condition()

    def acquire(self, nbytes: int) -> int:
        nbytes = min(nbytes, self.total)  # one frame alone always fits
        with self._freed:
            self._freed.wait_for(lambda: self.used + nbytes <= self.total)
            self.used += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        if nbytes:
            with self._freed:
                self.used -= nbytes
                self._freed.notify_all()


class _ClientCollector:
    """Per-client request and row counters, labelled by client name (scrape time)."""

    def __init__(self, daemon: "Daemon"):
        self._daemon = daemon

    def describe(self):
        return []

    def collect(self):
        req = CounterMetricFamily("tierstore_daemon_client_requests", "Requests served per client and operation.", labels=["client", "op"])
        rows = CounterMetricFamily("tierstore_daemon_client_rows", "Rows read, written or hinted per client and operation.", labels=["client", "op"])
        steps = GaugeMetricFamily("tierstore_daemon_client_step", "Training step each client last reported.", labels=["client"])
        clients = GaugeMetricFamily("tierstore_daemon_clients", "Connected clients.")
        with self._daemon._lock:
            totals = {k: (dict(v[0]), dict(v[1])) for k, v in self._daemon._totals.items()}
            sessions = list(self._daemon._sessions.values())
        for name, (r, n) in totals.items():
            for op in r:
                req.add_metric([name, op], r[op])
                rows.add_metric([name, op], n.get(op, 0))
        for s in sessions:
            if s.step is not None:
                steps.add_metric([s.name], s.step)
        clients.add_metric([], len(sessions))
        yield from (req, rows, steps, clients)


class Daemon:
    """Owns one TieredStore and serves it; ``serve()`` runs until ``stop()``."""

    def __init__(self, config: DaemonConfig, registry: CollectorRegistry | None = None):
        import tierstore

        self.config = config
        self._lock = threading.Lock()  # sessions, claims, totals (the store has its own lock)
        self._sessions: dict[int, _Session] = {}
        self._claims: dict[str, _ClaimIndex] = {}  # table -> every client's claimed row ranges
        self._totals: dict[str, tuple[dict, dict]] = {}  # client name -> (requests, rows): survives disconnects
        self._stop = threading.Event()
        self._numbers = iter(range(1, 1 << 62))
        self._threads: list[threading.Thread] = []
        self._steps_changed = threading.Condition(self._lock)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._trace = None
        if config.lookahead_source is not None:
            from tierstore.trace import Trace

            self._trace = Trace.load(config.lookahead_source)
        self._memory = _Budget(config.max_inflight_bytes)
        self._shm_left = config.shm_total_bytes
        # hints held by the store, all clients together (see _hint); taken in one at a time
        self._hint_lock = threading.Lock()
        self._hint_pool = config.max_inflight_bytes // 2
        self._hint_bytes = 0
        self._hinting: dict[int, _Session] = {}  # sessions holding hints, by number
        # ids of one PREFETCH frame: its working copies fit a frame, its hint the pool
        self.max_hint_ids = min(config.limits.max_ids, config.limits.max_bytes // (8 + PREFETCH_WORK_PER_ID),
                                self._hint_pool // HINT_BYTES_PER_ID)
        self.listener = self._bind(config.socket)  # before opening the store: a live daemon means refuse
        self.store = None
        try:
            self.store = tierstore.TieredStore(config.path, hbm_rows=0, ddr_rows=config.ddr_rows, policy=config.policy,
                                               device="cpu", registry=self.registry, name="prefetchd",
                                               metrics_port=config.metrics_port, memory_budget=config.memory_budget)
            self.registry.register(_ClientCollector(self))
            row_bytes = 4 * max((spec.width for spec in self.store.tables.values()), default=0)
            self._reply_bytes_per_id = {wire.READ: row_bytes, wire.REREAD: row_bytes, wire.ADMITTED: 8,
                                        wire.PREFETCH: PREFETCH_WORK_PER_ID}
            unknown = set(self._trace.table_names if self._trace is not None else ()) - set(self.store.tables)
            if unknown:
                raise ValueError(f"lookahead trace {config.lookahead_source} names tables {sorted(unknown)} that the store lacks; it has {sorted(self.store.tables)}")
            self.max_clients = self._client_cap()
            # held for the moment accept() finds no free descriptor: closed, it lets the daemon
            # accept and refuse that one connection instead of failing
            self._spare_fd = os.open(os.devnull, os.O_RDONLY)
        except BaseException:
            if self.store is not None:
                self.store.close()
            self.listener.close()
            config.socket.unlink(missing_ok=True)
            raise

    def _client_cap(self) -> int:
        """max_clients, checked against the open-file limit: a client takes its
        socket and, during its handshake, its segment's descriptor."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        try:
            in_use = len(os.listdir("/proc/self/fd"))
        except OSError:
            in_use = 64
        room = (soft - in_use - 16) // 2 if soft != resource.RLIM_INFINITY else 1 << 20
        if room < 1:
            raise RuntimeError(f"the open-file limit ({soft}, {in_use} in use) leaves no room for clients; raise it (ulimit -n)")
        wanted = self.config.max_clients
        if wanted is None:
            return min(1024, room)
        if wanted > room:
            log.warning("--max-clients %d needs more descriptors than the open-file limit (%d, %d in use) allows; "
                        "serving at most %d clients (raise ulimit -n for more)", wanted, soft, in_use, room)
        return min(wanted, room)

    # -- socket --------------------------------------------------------------------
    @staticmethod
    def _bind(path: Path) -> socket.socket:
        if not path.parent.is_dir():
            raise FileNotFoundError(f"the directory of --socket {path} does not exist; create it first "
                                    f"(mkdir -p {path.parent}) or choose a socket path in an existing directory")
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise FileExistsError(f"{path} exists and is not a socket; choose another --socket path")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(2.0)
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                log.info("removing stale socket %s (nothing listens on it)", path)
                path.unlink(missing_ok=True)
            else:
                raise RuntimeError(f"a daemon is already serving {path}; stop it first or choose another --socket path")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(socket.SOMAXCONN)  # the kernel's cap (net.core.somaxconn): a burst of connects waits here
        sock.settimeout(0.2)  # the accept loop wakes up to notice stop()
        return sock

    # -- lifecycle ---------------------------------------------------------------------
    def serve(self) -> None:
        log.info("serving %s on %s (ddr_rows=%s, tables %s)", self.config.path, self.config.socket, self.store.config.ddr_rows, sorted(self.store.tables))
        if self._trace is not None:
            t = threading.Thread(target=self._lookahead, name="prefetchd-lookahead", daemon=True)
            t.start()
            self._threads.append(t)
        try:
            while not self._stop.is_set():
                conn = self._accept()
                if conn is None:
                    continue
                with self._lock:
                    full = len(self._sessions) >= self.max_clients
                if full:
                    self._refuse(conn, wire.DaemonBusyError(
                        f"the tierstore daemon at {self.config.socket} serves its maximum of {self.max_clients} clients "
                        "(--max-clients); close idle clients, or restart it with a higher --max-clients (and ulimit -n)"))
                    continue
                self._start(conn)
        finally:
            self._shutdown()

    def _accept(self) -> socket.socket | None:
        """One connection, or None; never raises while serving (a full fd table included)."""
        try:
            conn, _ = self.listener.accept()
            return conn
        except socket.timeout:
            return None
        except OSError as e:
            if self._stop.is_set():
                return None
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                log.warning("accept() failed (%s); still serving", e)
                return None
        # no descriptor left: free the spare one, take the connection and refuse it, so the
        # client hears why instead of waiting in the listen queue
        os.close(self._spare_fd)
        try:
            conn, _ = self.listener.accept()
            self._refuse(conn, wire.DaemonBusyError(
                f"the tierstore daemon at {self.config.socket} has no file descriptor left for another client "
                "(open-file limit); close idle clients, or restart it with a higher ulimit -n"))
        except OSError as e:
            log.warning("accept() failed (%s); still serving", e)
            self._stop.wait(0.05)  # the condition may persist: do not spin
        finally:
            self._spare_fd = os.open(os.devnull, os.O_RDONLY)
        return None

    def _refuse(self, conn: socket.socket, e: Exception) -> None:
        log.warning("refused a connection: %s", e)
        conn.settimeout(1.0)  # the reply fits the socket buffer; never wait on a refused client
        try:
            wire.send_frame(conn, wire.Frame(wire.ERROR, wire.error_status(e), wire.error_message(e)))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()

    def _start(self, conn: socket.socket) -> None:
        session = _Session(conn, next(self._numbers))
        with self._lock:
            self._sessions[session.number] = session
        t = threading.Thread(target=self._serve_conn, args=(session,), name=f"prefetchd-{session.number}", daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._steps_changed.notify_all()

    def _shutdown(self) -> None:
        self.listener.close()
        self.config.socket.unlink(missing_ok=True)
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:  # wake the connection threads; a request in progress finishes first (store lock)
            try:
                s.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=10)
        self.store.close()  # flushes
        os.close(self._spare_fd)
        log.info("flushed and closed %s", self.config.path)

    # -- one connection --------------------------------------------------------------------
    def _serve_conn(self, s: _Session) -> None:
        try:
            while self._serve_frame(s):
                pass
        except (ConnectionError, OSError) as e:
            if not self._stop.is_set():
                log.info("%s went away: %s", s.describe(), e)
        finally:
            # the frames and replies died with _serve_frame's locals: nothing maps the segment any more
            self._drop(s)

    def _serve_frame(self, s: _Session) -> bool:
        """Receive, handle and answer one frame; False when the connection is done."""
        cfg = self.config
        held = 0

        def admit(ftype: int, n_ids: int, nbytes: int) -> None:
            nonlocal held  # a READ's reply is gathered in memory too, unless in the segment
            work = n_ids * self._reply_bytes_per_id.get(ftype, 0) + (HELLO_WORK_PER_BYTE * nbytes if ftype == wire.HELLO else 0)
            held = self._memory.acquire(nbytes + work)

        # before HELLO a connection gets frame_timeout to speak, after it idle_timeout (0: forever)
        s.conn.settimeout((cfg.idle_timeout or None) if s.hello else cfg.frame_timeout)
        try:
            try:
                frame = wire.recv_frame(s.conn, cfg.limits, shm=s.shm, frame_timeout=cfg.frame_timeout, admit=admit)
            except socket.timeout:
                what = f"after {cfg.idle_timeout:g} s without a request (prefetchd --idle-timeout)" if s.hello else \
                    f"as it sent no HELLO within {cfg.frame_timeout:g} s (prefetchd --frame-timeout)"
                log.info("closing the connection of %s %s", s.describe(), what)
                self._reply_error(s, wire.ERROR, ConnectionError(f"the tierstore daemon closed this connection {what}; attach again"))
                return False
            except wire.ProtocolError as e:
                log.warning("%s sent a malformed frame (%s); closing its connection", s.describe(), e)
                self._reply_error(s, wire.ERROR, e)
                return False
            if frame is None:
                return False
            s.conn.settimeout(cfg.frame_timeout)  # a client that does not read its reply is dropped
            if not s.hello and frame.type != wire.HELLO:
                self._reply_error(s, frame.type, wire.ProtocolError("the first frame must be HELLO (the versioned handshake)"))
                return False
            try:
                reply = self._handle(s, frame)
            except Exception as e:  # a bad request: the stream is still in step, keep serving
                self._reply_error(s, frame.type, e)
                return frame.type != wire.HELLO
            wire.send_frame(s.conn, reply, s.shm, cfg.shm_threshold)
            if frame.type == wire.HELLO and s.shm is not None:
                wire.send_segment(s.conn, s.shm)
            return True
        finally:
            self._memory.release(held)

    def _reply_error(self, s: _Session, ftype: int, e: BaseException) -> None:
        try:
            wire.send_frame(s.conn, wire.Frame(ftype, wire.error_status(e), wire.error_message(e)))
        except OSError:
            pass

    def _drop(self, s: _Session) -> None:
        with self._lock:
            self._sessions.pop(s.number, None)
            for table in s.ranges:
                self._claims[table].remove(s.number)
            self._steps_changed.notify_all()
        with self._hint_lock:
            while s.hints:
                self._drop_hint(s)
        try:
            s.conn.close()
        except OSError:
            pass
        if s.shm is not None:
            s.shm.close()
            with self._lock:
                self._shm_left += s.shm.size
            s.shm = None
        if s.hello:
            log.info("%s disconnected; released claims: %s", s.describe(), s.describe_claims())

    # -- requests -------------------------------------------------------------------------
    def _handle(self, s: _Session, f: wire.Frame) -> wire.Frame:
        store = self.store
        if f.type == wire.HELLO:
            return self._hello(s, f)
        if f.type == wire.READ:
            ids = self._ids(f)
            with_state = bool(f.flags & wire.WITH_STATE)
            spec = store.tables.get(f.text)
            if spec is None:  # the store's own KeyError message
                store.read(f.text, ids[:0])
            cols = spec.width if with_state else spec.dim
            nbytes = self._check_reply_rows(len(ids), cols)
            if s.shm is not None and nbytes > self.config.shm_threshold and nbytes <= s.shm.size:
                # gathered straight into the client's segment: the reply is a header, no copy
                out = torch.from_numpy(s.shm.array(0, "<f4", (len(ids), cols)))
            else:
                out = torch.empty((len(ids), cols), dtype=torch.float32)  # freed with the reply: memory follows the budget
            rows = store.read(f.text, torch.from_numpy(ids), with_state=with_state, out=out)
            self._count(s, "read", len(ids))
            return wire.Frame(f.type, rows=rows.numpy())
        if f.type == wire.WRITE:
            ids = self._ids(f)
            self._check_claimed(s, f.text, ids)
            if f.rows is None and len(ids):
                raise ValueError(f"WRITE of {len(ids)} ids carries no rows")
            rows = f.rows
            if rows is not None and f.flags & wire.IN_SHM:
                rows = rows.copy()  # the store may keep what it is given; the segment is reused by the next frame
            values = torch.from_numpy(rows) if rows is not None else torch.empty((0, 0))
            store.write(f.text, torch.from_numpy(ids), values, with_state=bool(f.flags & wire.WITH_STATE))
            self._count(s, "write", len(ids))
            return wire.Frame(f.type)
        if f.type == wire.ADMITTED:
            ids = self._unique_ids(f)
            mask = store.trainer(f.text).admitted(torch.from_numpy(ids)) if len(ids) else None
            self._count(s, "admitted", len(ids))
            return wire.Frame(f.type, ids=np.ones(len(ids), dtype=np.int64) if mask is None else mask.numpy().astype(np.int64))
        if f.type == wire.REREAD:
            ids = self._unique_ids(f)
            self._check_reply_rows(len(ids), store.tables[f.text].width)
            rows = store.trainer(f.text).reread(torch.from_numpy(ids)) if len(ids) else torch.empty((0, store.tables[f.text].width))
            self._count(s, "reread", len(ids))
            return wire.Frame(f.type, rows=rows.numpy())
        if f.type == wire.EVICT:
            ids = self._ids(f)
            self._check_claimed(s, f.text, ids)
            deleted = store.evict(f.text, torch.from_numpy(ids))
            self._count(s, "evict", len(ids))
            return wire.Frame(f.type, ids=np.array([deleted], dtype=np.int64))
        if f.type == wire.PREFETCH:
            ids = self._ids(f)
            if len(ids) > self.max_hint_ids:
                raise ValueError(f"a prefetch hint of {len(ids)} ids exceeds the daemon's {self.max_hint_ids} ids per PREFETCH "
                                 f"frame (what --max-inflight-mib {self.config.max_inflight_bytes >> 20} leaves for one hint); "
                                 "split it (tierstore's client does), or raise --max-inflight-mib")
            self._check_ids(f.text, ids)  # a bad hint is refused now, so no later read fails for it
            self._hint(s, f.text, ids)
            self._count(s, "prefetch", len(ids))
            return wire.Frame(f.type)
        if f.type == wire.FLUSH:
            store.flush()
            self._count(s, "flush", 0)
            return wire.Frame(f.type)
        if f.type == wire.STEP:
            ids = self._ids(f)
            if len(ids) != 1 or ids[0] < 0:
                raise ValueError("STEP carries exactly one id: the step number, >= 0")
            with self._lock:
                s.step = int(ids[0])
                self._steps_changed.notify_all()
            self._count(s, "step", 0)
            return wire.Frame(f.type)
        if f.type == wire.STATS:
            per_table = f.text == "per_table"
            with self._lock:
                sessions = [x for x in self._sessions.values() if x.hello]
            # described outside the lock: a client's claims are fixed once it said HELLO. The first
            # STATS_CLAIMS of each, and their number: all of them could pass the reply's text limit
            clients = [{"name": x.name, "pid": x.pid, "claims": [list(c) for c in x.claims(STATS_CLAIMS)],
                        "n_claims": sum(len(r) for r in x.ranges.values()), "readonly": x.readonly,
                        "step": x.step, "shm_bytes": shm.size if (shm := x.shm) is not None else 0,
                        "hints": len(x.hints), "hint_bytes": x.hint_bytes} for x in sessions]
            body = {"store": store.stats(per_table=per_table), "clients": clients,
                    "prefetch": store.prefetch_stats()["tables"]}
            return wire.Frame(f.type, text=json.dumps(body))
        raise ValueError(f"frame type {f.type} is not a request")

    def _hello(self, s: _Session, f: wire.Frame) -> wire.Frame:
        if s.hello:
            raise ValueError("HELLO was already sent on this connection")
        try:
            body = json.loads(f.text)
        except json.JSONDecodeError as e:
            raise wire.ProtocolError(f"HELLO text is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise wire.ProtocolError("HELLO text must be a JSON object")
        name, claims, readonly, path = body.get("client"), body.get("claims", []), body.get("readonly", False), body.get("path")
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ValueError(f"client name must be a non-empty string of <= 200 characters, got {name!r}")
        cap = self.config.max_claims
        if isinstance(claims, (list, tuple)) and len(claims) > cap:  # before parsing them: the cap bounds that too
            raise ValueError(f"this client claims {len(claims)} row ranges; the daemon takes at most {cap} per client "
                             "(prefetchd --max-claims): claim fewer, wider ranges (a table name, or one (table, lo, hi) "
                             "covering several), or restart the daemon with a higher --max-claims")
        claims = wire.parse_claims(claims)  # TypeError/ValueError name the bad item
        shm_bytes = body.get("shm_bytes", 0)
        check_int(shm_bytes, "shm_bytes")
        if readonly and claims:
            raise ValueError(f"a readonly client cannot claim tables for writing (claims {claims}); drop readonly=True or claim=")
        if path is not None and Path(path).resolve() != self.config.path.resolve():
            raise ValueError(f"this daemon serves {self.config.path.resolve()}, not {Path(path).resolve()}; attach to the daemon of that store")
        unknown = sorted({c[0] for c in claims} - set(self.store.tables))
        if unknown:
            raise KeyError(f"claims name unknown tables {unknown}; the store has tables {sorted(self.store.tables)}")
        ranges: dict[str, list[tuple[int, int]]] = {}
        for t, lo, hi in claims:  # sorted by table, then lo
            ranges.setdefault(t, []).append((lo, hi))
        ranges = {t: wire.range_array(r) for t, r in ranges.items()}
        try:
            pid = struct.unpack("3i", s.conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        except (AttributeError, OSError):  # not Linux: no peer credentials
            pid = None
        shm = None
        granted = min(shm_bytes, self.config.shm_max_bytes)
        with self._lock:  # segments come out of one total; past it a client uses the socket
            granted = granted if granted <= self._shm_left else 0
            self._shm_left -= granted
        if granted:
            try:
                shm = wire.Segment.create(granted)
            except OSError as e:  # no memfd here: every frame goes through the socket
                log.warning("no shared memory for %s (%s); using the socket", name, e)
                with self._lock:
                    self._shm_left += granted
        try:
            with self._lock:
                clashes, n_clashes = [], 0
                for t, r in ranges.items():
                    index = self._claims.get(t)
                    if index is None:
                        continue
                    new, held = index.overlaps(r)
                    n_clashes += len(new)
                    for i, j in zip(new[:4 - len(clashes)], held):  # the message names a few
                        (lo, hi), (hlo, hhi) = r[i], index.ranges[j]
                        holder = self._sessions[int(index.owners[j])]
                        clashes.append(f"{wire.describe_claim((t, int(max(lo, hlo)), int(min(hi, hhi))))} by {holder.describe()}")
                if clashes:
                    more = f" and {n_clashes - len(clashes)} more overlaps" if n_clashes > len(clashes) else ""
                    raise PermissionError(f"write claim refused: {'; '.join(clashes)}{more} already claimed; a row has one writer "
                                          "at a time (claim other rows, or attach with readonly=True to read them)")
                s.name, s.pid, s.readonly, s.hello = name, pid, bool(readonly), True
                s.ranges = ranges
                for t, r in ranges.items():
                    self._claims.setdefault(t, _ClaimIndex()).add(r, s.number)
        except BaseException:
            if shm is not None:
                shm.close()
                with self._lock:
                    self._shm_left += shm.size
            raise
        s.shm = shm
        log.info("%s attached: claims: %s%s%s", s.describe(), s.describe_claims(),
                 ", readonly" if readonly else "", f", {shm.size >> 20} MiB shared memory" if shm else "")
        reply = {"version": wire.VERSION, "path": str(self.config.path.resolve()), "pid": os.getpid(),
                 "tables": [spec.to_json() for spec in self.store.tables.values()],
                 "shm_bytes": shm.size if shm else 0, "shm_threshold": self.config.shm_threshold,
                 "max_frame_bytes": self.config.limits.max_bytes, "max_ids": self.config.limits.max_ids,
                 "max_hint_ids": self.max_hint_ids}
        return wire.Frame(wire.HELLO, text=json.dumps(reply))

    def _check_claimed(self, s: _Session, table: str, ids: np.ndarray) -> None:
        """Refuse a write unless this client claimed every row it touches."""
        if s.readonly:
            raise PermissionError(f"{s.describe()} attached readonly; attach with claim=[{table!r}] to write table {table!r}")
        inside = wire.claimed(s.ranges.get(table, []), ids)
        if inside.all():
            return
        bad = int(ids[~inside][0])
        with self._lock:
            index = self._claims.get(table)
            number = index.holder(bad) if index is not None else None
            holder = self._sessions.get(number) if number is not None else None
        raise wire.unclaimed(s.describe(), table, s.ranges.get(table, []), bad, holder.describe() if holder is not None else "")

    # -- prefetch hints ------------------------------------------------------------------------
    def _hint(self, s: _Session, table: str, ids: np.ndarray) -> None:
        """Hand a hint to the store within the hint pool (half of max_inflight_bytes, all
        clients together) and max_hints per client. Room is made first, by dropping
        (releasing) the oldest hints of the client holding the most hint bytes: a hint
        is advisory, and a dropped one only means its rows are read when their batch
        comes. So a client that floods the daemon with hints drops its own, and one that
        holds no more than its share keeps its hints. One hint at a time: the store
        takes them in one at a time anyway (its lock), and no reservation is pending
        while room is made."""
        cost = HINT_BYTES_PER_ID * len(ids)  # <= the pool: max_hint_ids
        with self._hint_lock:
            while s.hints and len(s.hints) >= self.config.max_hints:
                self._drop_hint(s)
            while self._hint_bytes + cost > self._hint_pool:
                self._drop_hint(max(self._hinting.values(), key=lambda x: x.hint_bytes))
            ticket = self.store.prefetch(table, ids)
            s.hints.append((ticket, cost))
            s.hint_bytes += cost
            self._hint_bytes += cost
            self._hinting[s.number] = s

    def _drop_hint(self, s: _Session) -> None:
        """Release ``s``'s oldest hint (its pinned rows may be evicted again); with _hint_lock."""
        ticket, cost = s.hints.popleft()
        ticket.release()
        s.hint_bytes -= cost
        self._hint_bytes -= cost
        if not s.hints:
            self._hinting.pop(s.number, None)

    def _count(self, s: _Session, op: str, rows: int) -> None:
        with self._lock:  # names are the clients' own: past MAX_NAMED_CLIENTS of them, new ones share one entry
            name = s.name if s.name in self._totals or len(self._totals) < MAX_NAMED_CLIENTS else OTHER_CLIENTS
            req, n = self._totals.setdefault(name, ({}, {}))
            req[op] = req.get(op, 0) + 1
            n[op] = n.get(op, 0) + rows

    @staticmethod
    def _ids(f: wire.Frame) -> np.ndarray:
        return f.ids if f.ids is not None else np.empty(0, dtype=np.int64)

    def _unique_ids(self, f: wire.Frame) -> np.ndarray:
        """ADMITTED and REREAD ids: of a known table, in range, sorted and unique (a backward's rows)."""
        ids = self._ids(f)
        self._check_ids(f.text, ids)
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"{wire.TYPE_NAMES[f.type]} ids must be sorted and unique (a backward's rows, e.g. torch.unique(ids)); "
                             f"got {len(ids)} ids that are not")
        return ids

    def _check_reply_rows(self, n: int, cols: int) -> int:
        """Bytes of a reply of ``n`` rows of ``cols`` floats; refused past the frame limit."""
        nbytes = 4 * n * cols
        if 8 * n + nbytes > self.config.limits.max_bytes:
            raise ValueError(f"a read of {n} ids x {cols} columns ({8 * n + nbytes} bytes with its reply) "
                             f"exceeds the daemon's frame limit of {self.config.limits.max_bytes} bytes; split the call "
                             "(tierstore's client does)")
        return nbytes

    def _check_ids(self, table: str, ids: np.ndarray) -> None:
        as_ids(self.store.spec(table), ids)  # the embedded store's checks and messages

    # -- lookahead from a trace ----------------------------------------------------------------
    def _lookahead(self) -> None:
        """Prefetch the trace's calls of steps (slowest, slowest + depth], where
        slowest is the lowest step any attached client has reported."""
        trace, depth = self._trace, self.config.depth
        steps = np.asarray(trace.call_step)
        issued = np.empty(0, dtype=np.int64)  # steps whose calls are prefetched and not yet trained past
        tickets: list = []
        while not self._stop.is_set():
            with self._lock:
                reported = [x.step for x in self._sessions.values() if x.step is not None]
                if not reported:
                    self._steps_changed.wait(0.5)
                    continue
                slowest = min(reported)
            for step, ticket in tickets:  # steps trained past: unpin what they did not read
                if step <= slowest:
                    ticket.release()
            tickets = [(step, ticket) for step, ticket in tickets if step > slowest]
            issued = issued[issued > slowest]
            # a slower client may attach later: its window is filled in, never skipped
            first, last = np.searchsorted(steps, slowest, side="right"), np.searchsorted(steps, slowest + depth, side="right")
            calls = np.arange(first, last)
            calls = calls[~np.isin(steps[calls], issued)]
            for c in calls:
                ids = np.asarray(trace.ids[trace.offsets[c]:trace.offsets[c + 1]])
                table = trace.tables[trace.call_table[c]].name
                try:
                    tickets.append((int(steps[c]), self.store.prefetch(table, ids)))
                except Exception as e:  # the store is closing
                    log.warning("lookahead prefetch of step %d failed: %s", steps[c], e)
                    return
            issued = np.union1d(issued, steps[calls])
            with self._lock:
                if not self._stop.is_set():
                    self._steps_changed.wait(0.5)
        for _, t in tickets:
            t.release()


# -- the CLI verb --------------------------------------------------------------------------
def register(sub) -> None:
    p = sub.add_parser("prefetchd", help="serve a store's DDR tier and LMDB files to trainer processes over a Unix socket")
    p.add_argument("path", help="store directory (created beforehand by a TieredStore with tables=)")
    p.add_argument("--socket", required=True, help="Unix socket path (created with mode 0600)")
    p.add_argument("--ddr-rows", type=int, default=None, help="rows of the DDR tier per table (required without --memory-budget)")
    p.add_argument("--memory-budget", type=_budget, default=None,
                   help="the store's host memory, e.g. 1GiB: sizes the DDR tier (unless --ddr-rows), staging, the write-back "
                        "queue, LMDB's dirty pages and a share for the page cache (README \"Memory budget\")")
    p.add_argument("--policy", default="lru", help="eviction policy: lru or lfu")
    p.add_argument("--lookahead-source", default=None, help="trace (tierstore.trace format) to prefetch from, ahead of the slowest client's step")
    p.add_argument("--depth", type=int, default=2, help="steps to prefetch ahead of the slowest client (with --lookahead-source)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on 127.0.0.1:PORT/metrics")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: torch's). Clients are served on a thread each; with N >= 2 "
                        "clients reading at once, 1 keeps their gathers from fighting over the cores")
    p.add_argument("--shm-max-mib", type=nonneg_int, default=1024, help="largest shared-memory segment per client in MiB (0: socket only)")
    p.add_argument("--shm-total-mib", type=nonneg_int, default=4096, help="all clients' segments together in MiB; past it a client uses the socket")
    p.add_argument("--max-inflight-mib", type=nonneg_int, default=256,
                   help="frame payloads, READ replies and working copies handled at once, in MiB; frames wait for room "
                        "(one frame: at most 64 MiB or this); prefetch hints held take at most half of it more")
    p.add_argument("--max-claims", type=positive_int, default=1024,
                   help="row ranges one client may claim; a HELLO with more is refused (claim fewer, wider ranges)")
    p.add_argument("--max-clients", type=positive_int, default=None,
                   help="connections served at once; more are refused with DaemonBusyError (default: what ulimit -n allows, at most 1024)")
    p.add_argument("--idle-timeout", type=nonneg_float, default=3600.0, help="seconds a client may send nothing before it is disconnected (0: never)")
    p.add_argument("--frame-timeout", type=positive_float, default=30.0,
                   help="seconds a client has to send HELLO, finish a frame it began, and read a reply")
    p.set_defaults(func=main)


def _budget(text: str) -> int:
    try:
        return parse_bytes(text, "--memory-budget")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _return_freed_memory() -> None:
    """Big buffers (frames, replies, a read's working copies) from mmap, returned to the
    system when freed. glibc's default raises its mmap threshold up to 32 MiB after the
    first big free, and each connection thread's arena then keeps what it freed: the
    daemon's memory would follow its connections, not the frames in flight."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, which also turns the dynamic raise off
        libc.mallopt(-8, 1)  # M_ARENA_MAX: connection threads share one arena, so what one frees serves the next
    except (OSError, AttributeError):  # not glibc: its own allocator's policy applies
        pass


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefetchd %(levelname)s %(message)s")
    require_store(args.path, needs_tables=True)  # says how to get one from the command line
    _return_freed_memory()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = DaemonConfig(args.path, args.socket, args.ddr_rows, args.policy, args.lookahead_source, args.depth, args.metrics_port,
                          shm_max_bytes=args.shm_max_mib << 20, shm_total_bytes=args.shm_total_mib << 20,
                          max_inflight_bytes=args.max_inflight_mib << 20, max_clients=args.max_clients, max_claims=args.max_claims,
                          idle_timeout=args.idle_timeout, frame_timeout=args.frame_timeout, memory_budget=args.memory_budget)
    daemon = Daemon(config)
    # handlers only set a flag: the accept loop notices it within 0.2 s, then flushes and exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    print(f"ready {config.socket}", flush=True)  # a line for supervisors and tests to wait on
    daemon.serve()
    return 0


# -- the benchmark ---------------------------------------------------------------------------
def bench(args) -> None:
    """Reads through the daemon vs an in-process DDR tier; two clients vs one.

    Both comparisons run at torch's default thread count and at 1 thread (daemon,
    clients and baseline alike), because on a small shared machine the thread
    count decides more than the transport does. Client processes time their own
    reads (process start and exit are not counted); rounds alternate one and two
    clients and the median ratio is reported. "Independent readers" is the
    machine's own ceiling for the second ratio: processes gathering from their
    own tensors with no daemon and no lock at all.
    """
    import statistics
    import subprocess
    import sys
    import tempfile

    import tierstore
    from tierstore.tools.bench import median_seconds, read_all, report

    n, dim, batch = min(args.rows, 1 << 20), args.dim, args.batch
    rounds = max(3, args.repeat // 3)
    default_threads = torch.get_num_threads()
    load_before = os.getloadavg()
    local, through, pairs, ceiling = {}, {}, {}, []
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=args.dir) as d:
        path = Path(d) / "store"
        spec = tierstore.TableSpec("t", n, dim, init=tierstore.RowInit.uniform(-1, 1, seed=args.seed))
        gen = torch.Generator().manual_seed(args.seed)
        batches = [torch.randint(0, n, (batch,), generator=gen) for _ in range(8)]
        buf = torch.empty((batch, dim))
        tierstore.TieredStore(path, [spec], device="cpu", registry=CollectorRegistry()).close()
        # baseline: the same DDR tier in this process, opened as the daemon opens it (an existing store)
        with tierstore.TieredStore(path, hbm_rows=0, ddr_rows=n, device="cpu", registry=CollectorRegistry()) as store:
            read_all(store, n)
            for threads in (default_threads, 1):
                torch.set_num_threads(threads)
                it = iter(range(10**9))
                local[threads] = median_seconds(lambda: store.read("t", batches[next(it) % 8], out=buf), args.repeat)
            expect = store.read("t", batches[0])
        for threads in (default_threads, 1):
            torch.set_num_threads(threads)
            sock = Path(tempfile.mkdtemp(prefix="tsd-")) / "d.sock"
            proc = subprocess.Popen([sys.executable, "-m", "tierstore.tools.cli", "prefetchd", str(path), "--socket", str(sock),
                                     "--ddr-rows", str(n), "--threads", str(threads)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            try:
                assert proc.stdout.readline().startswith("ready"), "the daemon did not start"
                client = tierstore.open_store(path, daemon=str(sock), readonly=True, device="cpu")
                read_all(client, n)
                it = iter(range(10**9))
                through[threads] = median_seconds(lambda: client.read("t", batches[next(it) % 8], out=buf), args.repeat)
                assert torch.equal(client.read("t", batches[0]), expect), "the daemon's rows differ from the in-process store's"
                client.close()
                pairs[threads] = [(_rate(_READER, [path, sock], n, batch, args, threads, 1),
                                   _rate(_READER, [path, sock], n, batch, args, threads, 2)) for _ in range(rounds)]
            finally:
                proc.terminate()
                proc.wait(30)
                sock.parent.rmdir()
        ceiling = [(_rate(_GATHER, [dim], n, batch, args, 1, 1), _rate(_GATHER, [dim], n, batch, args, 1, 2)) for _ in range(rounds)]
    torch.set_num_threads(default_threads)
    load = f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    params = {"rows": n, "dim": dim, "batch": batch, "repeat": args.repeat, "transport": "unix socket + shared memory",
              "cpus": os.cpu_count(), "load average": load}

    def ms(t: float) -> str:
        return f"{t * 1e3:8.2f} ms  {batch / t / 1e6:6.2f} M rows/s"

    rows = []
    for threads in (default_threads, 1):
        rows += [(f"in-process read(out=), {threads} thread(s)", ms(local[threads])),
                 (f"through the daemon, {threads} thread(s)", f"{ms(through[threads])}  ({local[threads] / through[threads]:.2f}x)")]
    best = min(local.values())
    rows.append(("daemon at its best / in-process at its best", f"{best / min(through.values()):.2f}x"))
    report(f"daemon: {batch}-id read(out=), every row in the daemon's DDR tier", params, rows,
           f"daemon / in-process throughput, {default_threads} threads on both sides",
           local[default_threads] / through[default_threads], ">= 0.50")

    def ratios(p):
        return [two / one for one, two in p]

    rows = []
    for threads in (default_threads, 1):
        rs = ratios(pairs[threads])
        rows.append((f"daemon, {threads} thread(s) each: one client", f"{statistics.median(o for o, _ in pairs[threads]) / 1e6:6.2f} M rows/s"))
        rows.append((f"daemon, {threads} thread(s) each: two clients", f"{statistics.median(t for _, t in pairs[threads]) / 1e6:6.2f} M rows/s  "
                     f"(two/one per round: {', '.join(f'{r:.2f}' for r in rs)})"))
    rows.append(("independent readers, no daemon (ceiling)", f"two/one per round: {', '.join(f'{r:.2f}' for r in ratios(ceiling))}"))
    best = max(default_threads, 1, key=lambda th: statistics.median(ratios(pairs[th])))
    report("daemon: client processes reading at once", {**params, "rounds": rounds}, rows,
           f"two / one aggregate throughput, median of rounds ({best} thread(s); "
           f"ceiling {statistics.median(ratios(ceiling)):.2f}x)", statistics.median(ratios(pairs[best])), ">= 1.50")


# a client process: reads `reps` batches with read(out=) and prints its own start, end
_READER = """
import sys, time, torch, tierstore
path, sock, n, batch, reps, seed, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
torch.set_num_threads(threads)
c = tierstore.open_store(path, daemon=sock, readonly=True, device="cpu")
g = torch.Generator().manual_seed(seed)
bs = [torch.randint(0, n, (batch,), generator=g) for _ in range(4)]
out = torch.empty((batch, c.tables["t"].dim))
c.read("t", bs[0], out=out)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
for i in range(reps):
    c.read("t", bs[i % 4], out=out)
print(t0, time.perf_counter(), flush=True)
c.close()
"""

# the ceiling: the same gather from a tensor of the process's own, no daemon
_GATHER = """
import sys, time, torch
dim, n, batch, reps, seed, threads = map(int, sys.argv[1:])
torch.set_num_threads(threads)
data = torch.rand(n, dim)
g = torch.Generator().manual_seed(seed)
bs = [torch.randint(0, n, (batch,), generator=g) for _ in range(4)]
out = torch.empty((batch, dim))
torch.index_select(data, 0, bs[0], out=out)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
for i in range(reps):
    torch.index_select(data, 0, bs[i % 4], out=out)
print(t0, time.perf_counter(), flush=True)
"""


def _rate(script: str, head: list, n: int, batch: int, args, threads: int, clients: int) -> float:
    """Aggregate rows/s of ``clients`` processes running ``script`` at once, from
    their own clocks (perf_counter is CLOCK_MONOTONIC: one clock for all processes)."""
    import subprocess
    import sys

    reps = max(8, args.repeat)
    procs = [subprocess.Popen([sys.executable, "-c", script, *map(str, head), str(n), str(batch), str(reps), str(args.seed + i), str(threads)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(clients)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", "a bench client did not start"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        spans = [tuple(map(float, p.stdout.readline().split())) for p in procs]
    finally:
        for p in procs:
            p.wait(60)
    return clients * reps * batch / (max(e for _, e in spans) - min(s for s, _ in spans))
