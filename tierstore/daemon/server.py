"""The server of ``tierstore prefetchd``: one Daemon owns a TieredStore and answers each
client's frames (wire.py) on a thread of its own. Clients attach with
``tierstore.open_store(PATH, daemon=SOCK, claim=[...])`` (client.py).

Claims: each client names the tables or ``(table, lo, hi)`` row ranges it
writes in its HELLO (at most ``max_claims``); the daemon keeps every client's
claims of a table in one sorted array, so a HELLO is checked with binary
searches, not against each claim held. It refuses a claim that overlaps another
client's, and refuses WRITE frames touching rows outside the sender's claims.
A client with an HBM tier caches only its claimed rows (see client.py), so no
other client's write can make its copy stale.

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
it first drops the oldest hints of the client holding the most (see HintPool).

Concurrency: one thread per connection. Frames are read and written outside
the store's lock, and READ rows are gathered straight into the client's
shared-memory segment. A read whose rows are all in the DDR tier holds the
store's lock only for the lookup and the policy update, and gathers outside
it, so several clients' gathers run at once (TieredStore.read).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import struct
import threading
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from tierstore.daemon import wire
from tierstore.daemon.config import DaemonConfig
from tierstore.daemon.memory import HELLO_WORK_PER_BYTE, HINT_BYTES_PER_ID, PREFETCH_WORK_PER_ID, HintPool, MemoryBudget
from tierstore.daemon.sessions import ClaimIndex, Session, bind_socket, client_cap
from tierstore.daemon.snapshot import STATS_CLAIMS, ClientCollector, ClientInfo, DaemonSnapshot
from tierstore.engine.tensors import as_ids
from tierstore.store import TieredStore
from tierstore.validate import check_int
from tierstore.errors import BadIdsError, BadValuesError, SettingError, UnknownTableError, WriteRefusedError

log = logging.getLogger("tierstore.prefetchd")

MAX_NAMED_CLIENTS = 4096  # client names whose counters are kept apart; later names share one
OTHER_CLIENTS = "(other clients)"


class Daemon:
    """Owns one TieredStore and serves it; ``serve()`` runs until ``stop()``."""

    def __init__(self, config: DaemonConfig, registry: CollectorRegistry | None = None):
        self.config = config
        self._lock = threading.Lock()  # sessions, claims, totals (the store has its own lock)
        self._sessions: dict[int, Session] = {}
        self._claims: dict[str, ClaimIndex] = {}  # table -> every client's claimed row ranges
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
        self._memory = MemoryBudget(config.max_inflight_bytes)
        self._shm_left = config.shm_total_bytes
        hint_pool = config.max_inflight_bytes // 2  # hints held by the store, all clients together
        # ids of one PREFETCH frame: its working copies fit a frame, its hint the pool
        self.max_hint_ids = min(config.limits.max_ids, config.limits.max_bytes // (8 + PREFETCH_WORK_PER_ID),
                                hint_pool // HINT_BYTES_PER_ID)
        self.listener = bind_socket(config.socket)  # before opening the store: a live daemon means refuse
        self.store = None
        try:
            self.store = TieredStore(config.path, hbm_rows=0, ddr_rows=config.ddr_rows, policy=config.policy,
                                               device="cpu", registry=self.registry, name="prefetchd",
                                               metrics_port=config.metrics_port, memory_budget=config.memory_budget)
            self._hints = HintPool(self.store, hint_pool, config.max_hints)
            endpoint = self.store.metrics.servers[0] if config.metrics_port is not None else None
            # what it bound (metrics_port 0: a free port), for the ready line, the log and STATS
            self.metrics_port: int | None = endpoint.port if endpoint is not None else None
            self.metrics_url: str | None = endpoint.url if endpoint is not None else None
            self.registry.register(ClientCollector(self.snapshot))
            row_bytes = 4 * max((spec.width for spec in self.store.tables.values()), default=0)
            self._reply_bytes_per_id = {wire.READ: row_bytes, wire.REREAD: row_bytes, wire.ADMITTED: 8,
                                        wire.PREFETCH: PREFETCH_WORK_PER_ID}
            unknown = set(self._trace.table_names if self._trace is not None else ()) - set(self.store.tables)
            if unknown:
                raise SettingError(f"lookahead trace {config.lookahead_source} names tables {sorted(unknown)} that the store lacks; it has {sorted(self.store.tables)}")
            self.max_clients = client_cap(config.max_clients)
            # held for the moment accept() finds no free descriptor: closed, it lets the daemon
            # accept and refuse that one connection instead of failing
            self._spare_fd = os.open(os.devnull, os.O_RDONLY)
        except BaseException:
            if self.store is not None:
                self.store.close()
            self.listener.close()
            config.socket.unlink(missing_ok=True)
            raise

    # -- lifecycle ---------------------------------------------------------------------
    def serve(self) -> None:
        log.info("serving %s on %s (ddr_rows=%s, tables %s)%s", self.config.path, self.config.socket, self.store.config.ddr_rows,
                 sorted(self.store.tables), f", metrics on {self.metrics_url}" if self.metrics_url else "")
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
        session = Session(conn, next(self._numbers))
        with self._lock:
            self._sessions[session.number] = session
        t = threading.Thread(target=self._serve_conn, args=(session,), name=f"prefetchd-{session.number}", daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def snapshot(self) -> DaemonSnapshot:
        """Its clients and per-client counts now, as plain values (metrics and STATS read this)."""
        with self._lock:  # a client's claims are fixed once it said HELLO; its counts change under this lock
            return DaemonSnapshot(
                connections=len(self._sessions),
                clients=tuple(ClientInfo(x.name, x.pid, tuple(x.claims(STATS_CLAIMS)), sum(len(r) for r in x.ranges.values()),
                                         x.readonly, x.step, shm.size if (shm := x.shm) is not None else 0, len(x.hints),
                                         x.hint_bytes) for x in self._sessions.values() if x.hello),
                requests={name: dict(r) for name, (r, _) in self._totals.items()},
                rows={name: dict(n) for name, (_, n) in self._totals.items()})

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
    def _serve_conn(self, s: Session) -> None:
        try:
            while self._serve_frame(s):
                pass
        except (ConnectionError, OSError) as e:
            if not self._stop.is_set():
                log.info("%s went away: %s", s.describe(), e)
        finally:
            # the frames and replies died with _serve_frame's locals: nothing maps the segment any more
            self._drop(s)

    def _serve_frame(self, s: Session) -> bool:
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
                self._reply_error(s, wire.ERROR, wire.DaemonConnectionError(f"the tierstore daemon closed this connection {what}; attach again"))
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

    def _reply_error(self, s: Session, ftype: int, e: BaseException) -> None:
        try:
            wire.send_frame(s.conn, wire.Frame(ftype, wire.error_status(e), wire.error_message(e)))
        except OSError:
            pass

    def _drop(self, s: Session) -> None:
        with self._lock:
            self._sessions.pop(s.number, None)
            for table in s.ranges:
                self._claims[table].remove(s.number)
            self._steps_changed.notify_all()
        self._hints.drop_all(s)
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
    def _handle(self, s: Session, f: wire.Frame) -> wire.Frame:
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
                raise wire.ProtocolError(f"WRITE of {len(ids)} ids carries no rows")
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
                raise SettingError(f"a prefetch hint of {len(ids)} ids exceeds the daemon's {self.max_hint_ids} ids per PREFETCH "
                                 f"frame (what --max-inflight-mib {self.config.max_inflight_bytes >> 20} leaves for one hint); "
                                 "split it (tierstore's client does), or raise --max-inflight-mib")
            self._check_ids(f.text, ids)  # a bad hint is refused now, so no later read fails for it
            self._hints.add(s, f.text, ids)
            self._count(s, "prefetch", len(ids))
            return wire.Frame(f.type)
        if f.type == wire.FLUSH:
            store.flush()
            self._count(s, "flush", 0)
            return wire.Frame(f.type)
        if f.type == wire.STEP:
            ids = self._ids(f)
            if len(ids) != 1 or ids[0] < 0:
                raise wire.ProtocolError("STEP carries exactly one id: the step number, >= 0")
            with self._lock:
                s.step = int(ids[0])
                self._steps_changed.notify_all()
            self._count(s, "step", 0)
            return wire.Frame(f.type)
        if f.type == wire.STATS:
            per_table = f.text == "per_table"
            # the first STATS_CLAIMS claims of each client, and their number: all of them could pass the reply's text limit
            body = {"store": store.stats(per_table=per_table), "clients": [asdict(c) for c in self.snapshot().clients],
                    "prefetch": store.prefetch_stats()["tables"], "metrics_port": self.metrics_port}
            return wire.Frame(f.type, text=json.dumps(body))
        raise wire.ProtocolError(f"frame type {f.type} is not a request")

    def _hello(self, s: Session, f: wire.Frame) -> wire.Frame:
        if s.hello:
            raise wire.ProtocolError("HELLO was already sent on this connection")
        try:
            body = json.loads(f.text)
        except json.JSONDecodeError as e:
            raise wire.ProtocolError(f"HELLO text is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise wire.ProtocolError("HELLO text must be a JSON object")
        name, claims, readonly, path = body.get("client"), body.get("claims", []), body.get("readonly", False), body.get("path")
        if not isinstance(name, str) or not name or len(name) > 200:
            raise SettingError(f"client name must be a non-empty string of <= 200 characters, got {name!r}")
        cap = self.config.max_claims
        if isinstance(claims, (list, tuple)) and len(claims) > cap:  # before parsing them: the cap bounds that too
            raise SettingError(f"this client claims {len(claims)} row ranges; the daemon takes at most {cap} per client "
                             "(prefetchd --max-claims): claim fewer, wider ranges (a table name, or one (table, lo, hi) "
                             "covering several), or restart the daemon with a higher --max-claims")
        claims = wire.parse_claims(claims)  # TypeError/ValueError name the bad item
        shm_bytes = body.get("shm_bytes", 0)
        check_int(shm_bytes, "shm_bytes")
        if readonly and claims:
            raise SettingError(f"a readonly client cannot claim tables for writing (claims {claims}); drop readonly=True or claim=")
        if path is not None and Path(path).resolve() != self.config.path.resolve():
            raise SettingError(f"this daemon serves {self.config.path.resolve()}, not {Path(path).resolve()}; attach to the daemon of that store")
        unknown = sorted({c[0] for c in claims} - set(self.store.tables))
        if unknown:
            raise UnknownTableError(f"claims name unknown tables {unknown}; the store has tables {sorted(self.store.tables)}")
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
                    raise WriteRefusedError(f"write claim refused: {'; '.join(clashes)}{more} already claimed; a row has one writer "
                                          "at a time (claim other rows, or attach with readonly=True to read them)")
                s.name, s.pid, s.readonly, s.hello = name, pid, bool(readonly), True
                s.ranges = ranges
                for t, r in ranges.items():
                    self._claims.setdefault(t, ClaimIndex()).add(r, s.number)
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

    def _check_claimed(self, s: Session, table: str, ids: np.ndarray) -> None:
        """Refuse a write unless this client claimed every row it touches."""
        if s.readonly:
            raise WriteRefusedError(f"{s.describe()} attached readonly; attach with claim=[{table!r}] to write table {table!r}")
        inside = wire.claimed(s.ranges.get(table, []), ids)
        if inside.all():
            return
        bad = int(ids[~inside][0])
        with self._lock:
            index = self._claims.get(table)
            number = index.holder(bad) if index is not None else None
            holder = self._sessions.get(number) if number is not None else None
        raise wire.unclaimed(s.describe(), table, s.ranges.get(table, []), bad, holder.describe() if holder is not None else "")

    def _count(self, s: Session, op: str, rows: int) -> None:
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
            raise BadIdsError(f"{wire.TYPE_NAMES[f.type]} ids must be sorted and unique (a backward's rows, e.g. torch.unique(ids)); "
                             f"got {len(ids)} ids that are not")
        return ids

    def _check_reply_rows(self, n: int, cols: int) -> int:
        """Bytes of a reply of ``n`` rows of ``cols`` floats; refused past the frame limit."""
        nbytes = 4 * n * cols
        if 8 * n + nbytes > self.config.limits.max_bytes:
            raise BadValuesError(f"a read of {n} ids x {cols} columns ({8 * n + nbytes} bytes with its reply) "
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


