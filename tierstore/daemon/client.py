"""A trainer's side of ``tierstore prefetchd``: ``tierstore.open_store(PATH, daemon=SOCK, ...)``.

The daemon (server.py) owns the store's DDR tier and LMDB
files; this class sends it READ/WRITE/PREFETCH/FLUSH frames (wire.py)
over a Unix socket and has the read/write/prefetch/flush API of an embedded
store. Writes that reach the daemon go into its store and are durable after
``flush()`` (anyone's) or when the daemon stops; see the daemon's docstring.

Claims. ``claim=`` names what this client writes: a table name (every row of
it) or a ``(table, lo, hi)`` half-open row range, e.g.
``claim=["user", ("item", 0, 500_000)]``. The daemon refuses a claim that
overlaps another client's (PermissionError naming the holder and the rows),
and refuses writes outside the client's claims.

Client-side HBM tier (``hbm_rows=N``): tierstore/daemon/client_hbm.py.

Tables with admission, TTL or the L2 score (docs/admission.md): the
daemon's store counts their steps, so every read of one reaches the daemon (no
HBM tier here for it, and no read of it split across frames: that would be
several steps); a module's backward asks the daemon which rows' updates it keeps
(ADMITTED) and re-reads stale rows there without a step (REREAD). ``evict()``
sends EVICT, within the client's claims.

Large arrays go through a shared-memory segment the daemon creates for this
connection (``shm_bytes``; see wire.py); small frames through the
socket. A call larger than the daemon's frame limit (its HELLO says it) is
sent as several frames, in order: the rows read are the same; a write checks
its claims first, so it is refused whole (only a daemon lost mid-call can
leave part of it applied, as a killed client can).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from tierstore.io import unique_ids

from tierstore.daemon import wire
from tierstore.daemon.client_hbm import ClientHbm
from tierstore.engine.counters import TierCounters, add_dicts
from tierstore.engine.interface import EmbeddingStore
from tierstore.engine.prefetch import PrefetchGroup, PrefetchTicket
from tierstore.spec import TableSpec
from tierstore.engine.tensors import as_ids, as_values, check_out, resolve_device, unpicklable
from tierstore.store import TieredStore
from tierstore.engine.table import Resident, TableStore
from tierstore.engine.tiers import CacheTier, last_values
from tierstore.engine.trainer import TableTrainer
from tierstore.validate import check_int, check_number
from tierstore.errors import ArgumentTypeError, BadValuesError, SettingError, StoreClosedError, UnknownTableError, WriteRefusedError

Claim = str | tuple[str, int, int]
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def open_store(path: str | Path, tables: Sequence[TableSpec] | None = None, *, daemon: str | Path | None = None,
               **options) -> EmbeddingStore:
    """The store at ``path``: embedded (a TieredStore), or with ``daemon=SOCK`` a
    client of the ``tierstore prefetchd`` serving it there (a DaemonStore; both are
    tierstore.EmbeddingStore, ``claim=`` names what it writes). ``options`` are the class's own."""
    if daemon is None:
        return TieredStore(path, tables, **options)
    return DaemonStore(path, tables, daemon=daemon, **options)


class DaemonStore(ClientHbm):
    """A store served by a ``tierstore prefetchd`` daemon: a tierstore.EmbeddingStore, as
    the embedded TieredStore is (its checks and gathers are the functions both call).

    ``claim``: table names or ``(table, lo, hi)`` half-open row ranges this
    client writes (PermissionError naming the holder if someone else has any
    of those rows). ``readonly=True`` clients read every table and write none.
    ``hbm_rows``: rows of this client's own HBM tier per claimed table (an int,
    or {table: rows}); ``policy`` is its eviction policy (the daemon's DDR tier
    has its own). ``timeout``: seconds any one request may take before the
    daemon counts as gone (ConnectionError). ``shm_bytes``: shared memory to
    ask the daemon for (0 = every frame through the socket).
    """

    def __init__(
        self,
        path: str | Path,
        tables: Sequence[TableSpec] | None = None,
        hbm_rows: int | Mapping[str, int] = 0,
        ddr_rows: int = 0,
        policy: str = "lru",
        device: str | torch.device | None = "cpu",
        readonly: bool = False,
        *,
        daemon: str | Path,
        claim: Sequence[Claim] = (),
        timeout: float = 30.0,
        client: str | None = None,
        limits: wire.Limits | None = None,
        shm_bytes: int = 64 << 20,
        **unsupported,
    ):
        if unsupported:
            raise ArgumentTypeError(f"{sorted(unsupported)} apply to the daemon's store, not to a client; set them on `tierstore prefetchd`")
        if ddr_rows:
            raise SettingError("ddr_rows belongs to the daemon (`tierstore prefetchd --ddr-rows N`); drop ddr_rows= with daemon=")
        claims = wire.parse_claims([claim] if _is_range(claim) else claim)  # one bare (table, lo, hi) is one claim
        if readonly and claims:
            raise SettingError(f"readonly=True and claim={list(claim)} contradict each other; a readonly client writes nothing")
        check_number(timeout, "timeout", above=True, meaning="seconds", finite=False)
        check_int(shm_bytes, "shm_bytes", meaning="0 = no shared memory")
        self.path = Path(path)
        self.socket_path = Path(daemon)
        self.readonly = bool(readonly)
        self.claims = tuple(claims)
        ranges: dict[str, list[tuple[int, int]]] = {}
        for t, lo, hi in claims:
            ranges.setdefault(t, []).append((lo, hi))
        self._ranges = {t: wire.range_array(r) for t, r in ranges.items()}  # searched by every read of a claimed table
        self.device = resolve_device(device)
        self.timeout = float(timeout)
        self._limits = limits or wire.Limits()
        self._lock = threading.RLock()  # one request in flight per connection; the HBM tiers
        self._closed = False
        self._shm: wire.Segment | None = None
        self._shm_threshold = 1 << 16
        self._max_frame, self._max_ids = self._limits.max_bytes, self._limits.max_ids  # until the daemon says its own
        self._max_hint_ids = self._max_ids
        self._shared = self._shared_parts()
        self._hbm: dict[str, TableStore] = {}  # the claimed tables with an HBM tier (client_hbm.py)
        self._updates: dict[str, int] = {}  # per table, for trainer(t).update_key (kept by this client only)
        self._trainers: dict[str, ClientTableTrainer] = {}
        self._sock = self._connect()
        name = client or f"{socket.gethostname()}:{os.getpid()}"
        hello = {"client": name, "claims": [list(c) for c in claims], "readonly": self.readonly,
                 "path": str(self.path.resolve()), "shm_bytes": shm_bytes}
        try:
            reply = self._request(wire.Frame(wire.HELLO, text=json.dumps(hello)))
            body = reply.json()
            if body.get("shm_bytes"):
                self._shm = wire.recv_segment(self._sock, int(body["shm_bytes"]))
                self._shm_threshold = int(body.get("shm_threshold", self._shm_threshold))
            self._max_frame = min(self._max_frame, int(body.get("max_frame_bytes", self._max_frame)))
            self._max_ids = min(self._max_ids, int(body.get("max_ids", self._max_ids)))
            self._max_hint_ids = max(1, min(self._max_ids, int(body.get("max_hint_ids", self._max_frame // 8))))
        except BaseException:
            self._sock.close()
            self._closed = True
            raise
        self._tables = {d["name"]: TableSpec.from_json(d) for d in body["tables"]}
        self.daemon_pid = body.get("pid")
        try:
            for spec in tables or ():
                have = self._tables.get(spec.name)
                if have is None:
                    raise UnknownTableError(f"the daemon's store has no table {spec.name!r} (it has {sorted(self._tables)}); "
                                   "a client cannot create tables: create them with an embedded TieredStore before starting the daemon")
                if have != spec:
                    raise SettingError(f"table {spec.name!r}: {spec!r} contradicts the daemon's {have!r}; attach without tables=")
            self._make_hbm(hbm_rows, policy)
        except BaseException:
            self.close()
            raise

    # -- transport ----------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        if not self.socket_path.parent.is_dir():
            raise wire.DaemonConnectionError(f"the directory of daemon socket {self.socket_path} does not exist: no daemon listens there; "
                                  "check the path, or start `tierstore prefetchd ... --socket PATH` in an existing directory")
        # A full listen queue (many clients connecting at once) answers EAGAIN: retry with
        # a growing pause, for at most `timeout`, before saying the daemon is busy.
        deadline, pause = time.monotonic() + self.timeout, 0.001
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.socket_path))
                return sock
            except BlockingIOError:
                sock.close()
                if time.monotonic() + pause > deadline:
                    raise wire.DaemonBusyError(
                        f"the tierstore daemon at {self.socket_path} accepted no connection within {self.timeout:g} s "
                        "(its listen queue stayed full); retry later, or raise timeout=") from None
                time.sleep(pause)
                pause = min(2 * pause, 0.1)
            except (FileNotFoundError, ConnectionRefusedError, socket.timeout) as e:
                sock.close()
                raise wire.DaemonConnectionError(
                    f"no tierstore daemon answers at {self.socket_path} ({e.__class__.__name__}); start one with "
                    f"`tierstore prefetchd {self.path} --socket {self.socket_path} --ddr-rows N`"
                ) from None

    def _request(self, frame: wire.Frame, rows_out: np.ndarray | None = None) -> wire.Frame:
        """Send one frame and wait for its reply. Rows of a reply that came through
        shared memory are a view into it: valid until the next request."""
        with self._lock:
            self._check_open()
            try:
                try:
                    wire.send_frame(self._sock, frame, self._shm, self._shm_threshold)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the daemon hung up; the frame it sent first (busy, idle) says why, if any
                reply = wire.recv_frame(self._sock, self._limits, rows_out, self._shm)
            except (socket.timeout, OSError, wire.ProtocolError) as e:
                # the stream is out of step or dead: nothing more can be said on it
                self._drop_connection()
                what = f"did not answer within {self.timeout} s" if isinstance(e, socket.timeout) else f"went away ({e})"
                raise wire.DaemonConnectionError(f"the tierstore daemon at {self.socket_path} {what}; this client is closed, "
                                      "attach again once the daemon runs (unflushed writes may be lost)") from None
            if reply is None:
                self._drop_connection()
                raise wire.DaemonConnectionError(f"the tierstore daemon at {self.socket_path} closed the connection; "
                                      "this client is closed, attach again once the daemon runs")
            if issubclass(wire.ERRORS.get(reply.status, RuntimeError), ConnectionError):
                self._drop_connection()  # the daemon closed the connection after this reply
        wire.raise_for(reply)
        return reply

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"daemon store {self.path} (via {self.socket_path}) is closed")

    def _drop_connection(self) -> None:
        self._closed = True
        self._sock.close()
        self._shared.close()
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def _chunk(self, cols: int) -> int:
        """Ids per frame for rows of ``cols`` floats: ids and rows within the daemon's
        frame limit and, so that they go through it, the segment."""
        limit = min(self._max_frame, self._shm.size) if self._shm is not None else self._max_frame
        return max(1, min(self._max_ids, (limit - wire.SHM_ALIGN) // (8 + 4 * cols)))

    def _daemon_read(self, table: str, ids: np.ndarray, cols: int, with_state: bool, out: torch.Tensor | None,
                     ftype: int = wire.READ) -> torch.Tensor:
        """Rows from the daemon (READ, or REREAD), copied into ``out`` (CPU, contiguous)
        or a new tensor; a call past the frame limit as consecutive frames."""
        n, chunk = len(ids), self._chunk(cols)
        if n <= chunk:
            return self._daemon_read_frame(table, ids, cols, with_state, out, ftype)
        if ftype == wire.READ and self.spec(table).lived:  # every read of it is a step the daemon counts
            raise BadValuesError(f"a read of {n} ids of table {table!r} exceeds the {chunk} ids of {cols} columns that fit one frame "
                             "(the daemon's frame limit and this client's shm_bytes); with admit_after, ttl_steps or "
                             "evict_l2_below each read is one step and cannot be split: read fewer ids per call")
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        rows = out if direct else torch.empty((n, cols), dtype=torch.float32)
        for lo in range(0, n, chunk):
            self._daemon_read_frame(table, ids[lo:lo + chunk], cols, with_state, rows[lo:lo + chunk], ftype)
        if direct:
            return rows
        return rows.to(self.device) if out is None else out.copy_(rows)

    def _daemon_read_frame(self, table: str, ids: np.ndarray, cols: int, with_state: bool, out: torch.Tensor | None,
                           ftype: int = wire.READ) -> torch.Tensor:
        n = len(ids)
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        with self._lock:  # rows in the segment are valid until the next request: copy them before another thread sends one
            reply = self._request(wire.Frame(ftype, text=table, ids=ids, flags=wire.WITH_STATE if with_state else 0),
                                  rows_out=out.numpy() if direct else None)
            if reply.rows is None or reply.rows.shape != (n, cols):
                raise RuntimeError(f"the daemon answered a read of {n} x {cols} with {None if reply.rows is None else reply.rows.shape}")
            if direct:
                if reply.flags & wire.IN_SHM:  # numpy, not torch: no spinning OpenMP workers (see _ids_np)
                    np.copyto(out.numpy(), reply.rows)
                return out
            rows = torch.from_numpy(reply.rows.copy() if reply.flags & wire.IN_SHM else reply.rows)
            return rows.to(self.device) if out is None else out.copy_(rows)

    def _daemon_write(self, table: str, ids: np.ndarray, rows: np.ndarray, with_state: bool) -> None:
        flags = wire.WITH_STATE if with_state else 0
        chunk = self._chunk(rows.shape[1])
        if len(ids) > chunk:
            self._check_claimed(table, ids)
        with self._lock:  # one writer's frames stay in order (a later value of an id wins)
            for lo in range(0, len(ids), chunk):
                self._request(wire.Frame(wire.WRITE, text=table, ids=ids[lo:lo + chunk], rows=rows[lo:lo + chunk], flags=flags))

    def _check_claimed(self, table: str, ids: np.ndarray) -> None:
        """The daemon checks each frame's claims; a call of several frames is checked
        here first, so no frame is applied of a call that a later frame would have refused."""
        ranges = self._ranges.get(table, [])
        inside = wire.claimed(ranges, ids)
        if not inside.all():
            raise wire.unclaimed("this client", table, ranges, int(ids[~inside][0]))

    # -- the store API -------------------------------------------------------------------
    @property
    def tables(self) -> dict[str, TableSpec]:
        return dict(self._tables)

    def spec(self, table: str) -> TableSpec:
        """``table``'s spec, as the daemon's store has it; a KeyError naming the tables if none."""
        try:
            return self._tables[table]
        except KeyError:
            raise UnknownTableError(f"unknown table {table!r}; the store has tables {sorted(self._tables)}") from None

    def _ids_np(self, table: str, ids) -> np.ndarray:
        spec = self.spec(table)
        # The common case is checked in numpy, single-threaded: after a torch op on its
        # intra-op threads, OpenMP's idle workers spin for milliseconds, and while this
        # process waits for the daemon they would spin on the cores the daemon is using
        # (a 64k-id read took 15 ms instead of 10 on 2 cores). Anything unusual takes
        # the embedded store's checks, for its messages: so does every tensor that is not of
        # integers with values (float ids, ids on the meta device), before torch refuses it here.
        if isinstance(ids, torch.Tensor):
            if ids.dtype not in _INT_DTYPES or ids.device.type == "meta":
                return as_ids(spec, ids).cpu().numpy()
            arr = ids.detach().cpu().numpy()
        else:
            arr = np.asarray(ids)
        if arr.ndim == 1 and arr.size and arr.dtype.kind in "iu":
            arr = arr.astype(np.int64, copy=False)
            if arr.min() >= 0 and (spec.num_rows is None or arr.max() < spec.num_rows):
                return arr
        return as_ids(spec, ids).cpu().numpy()

    def read(self, table: str, ids, with_state: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.spec(table)
        ids_np = self._ids_np(table, ids)
        n, cols = len(ids_np), (spec.width if with_state else spec.dim)
        check_out(out, n, cols, self.device)
        if n == 0:
            return out if out is not None else torch.empty((0, cols), dtype=torch.float32, device=self.device)
        t = self._hbm.get(table)
        if t is None:
            return self._daemon_read(table, ids_np, cols, with_state, out)
        with self._lock:
            self._check_open()
            mine = wire.claimed(self._ranges[table], ids_np)
            if mine.all():
                return self._read_cached(t, ids_np, cols, out)
            # a call that spans claimed and unclaimed rows: each part from where it lives
            result = out if out is not None else torch.empty((n, cols), dtype=torch.float32, device=self.device)
            if mine.any():
                at = torch.from_numpy(np.flatnonzero(mine)).to(self.device)
                result[at] = self._read_cached(t, ids_np[mine], cols, None)
            at = torch.from_numpy(np.flatnonzero(~mine)).to(self.device)
            result[at] = self._daemon_read(table, ids_np[~mine], cols, with_state, None).to(self.device)
            return result

    def write(self, table: str, ids, values, with_state: bool = False) -> None:
        if self.readonly:
            raise WriteRefusedError(f"this client of {self.socket_path} attached readonly; attach with claim=[{table!r}] to write")
        spec = self.spec(table)
        ids_np = self._ids_np(table, ids)
        cols = spec.width if with_state else spec.dim
        values = as_values(spec, values, len(ids_np), cols)
        if len(ids_np) == 0:
            return
        t = self._hbm.get(table)
        if t is None:
            self._daemon_write(table, ids_np, values.numpy(), with_state)
            return
        with self._lock:
            self._check_open()
            # rows not in the HBM tier go to the daemon first: it refuses the whole write if
            # any row is unclaimed (none of those can be cached here), and nothing has changed yet
            t.write(*last_values(torch.from_numpy(ids_np), values), cols)

    def evict(self, table: str, ids) -> int:
        """Delete the rows of ``ids`` from the daemon's tiers and LMDB (and this client's
        HBM tier, unwritten): a later read gives their initial values. Needs a claim on
        every row. Returns how many of them LMDB held; durable at the next flush()."""
        if self.readonly:
            raise WriteRefusedError(f"this client of {self.socket_path} attached readonly; attach with claim=[{table!r}] to evict")
        ids_np = unique_ids(self._ids_np(table, ids))
        if not len(ids_np):
            return 0
        self._check_claimed(table, ids_np)
        chunk = self._chunk(0)
        deleted = 0
        with self._lock:
            for lo in range(0, len(ids_np), chunk):
                deleted += int(self._request(wire.Frame(wire.EVICT, text=table, ids=ids_np[lo:lo + chunk])).ids[0])
            t = self._hbm.get(table)
            if t is not None:
                slots = t.hbm.lookup(torch.from_numpy(ids_np).to(t.hbm.device))
                t.hbm.remove(slots[slots >= 0])
        return deleted

    def prefetch(self, table: str, ids) -> PrefetchTicket:
        """Hint that the next batches read these rows; the daemon starts fetching
        them into its DDR tier and this returns at once. A bad id is refused here,
        not later, so the ticket returned is already done. A hint larger than the
        daemon takes in one frame goes as several; the daemon keeps a bounded amount
        of hints and drops the oldest past it (docs/daemon.md)."""
        ids = self._ids_np(table, ids)
        with self._lock:
            for lo in range(0, max(len(ids), 1), self._max_hint_ids):
                self._request(wire.Frame(wire.PREFETCH, 0, table, ids[lo:lo + self._max_hint_ids]))
        return PrefetchTicket(None, table, 0, None)

    def trainer(self, table: str) -> "ClientTableTrainer":
        """This client's side of training ``table`` (tierstore.engine.trainer.TableTrainer): a
        module's forward reads its rows through read(), and admission and re-reads ask
        the daemon's store."""
        trainer = self._trainers.get(table)
        if trainer is None:
            self.spec(table)  # the KeyError for an unknown table
            with self._lock:
                trainer = self._trainers.setdefault(table, ClientTableTrainer(self, table, self._updates))
        return trainer

    def prefetch_batch(self, reads) -> PrefetchGroup:
        # hints only: the daemon stages rows in its own DDR tier, so there is
        # always room and nothing here to pin or release
        return PrefetchGroup(self.prefetch(t, ids) for t, ids in reads.items())

    def report_prefetch_depth(self, effective_depth: int, shrunk_steps: int) -> None:
        pass  # the daemon never shrinks a client's window: hints need no room here

    def report_step_seconds(self, seconds: float) -> None:
        pass  # the daemon serves several trainers: it reads hints with all its threads

    def report_step(self, step: int) -> None:
        """Tell the daemon this trainer's step (its trace lookahead follows the slowest client)."""
        check_int(step, "step")
        self._request(wire.Frame(wire.STEP, ids=np.array([step], dtype=np.int64)))

    def flush(self) -> None:
        """Write this client's dirty HBM rows to the daemon, then return once every
        dirty row in the daemon's store (every client's) is durable in LMDB."""
        with self._lock:
            self._write_back_all()
            self._request(wire.Frame(wire.FLUSH))

    def stats(self, per_table: bool = False) -> dict:
        """Counters like TieredStore.stats: "hbm" is this client's HBM tier, "ddr"
        and "ssd" the daemon's store (every client's reads)."""
        daemon = self.daemon_stats(per_table)["store"]
        with self._lock:
            mine = {name: vars(t.counters.hbm).copy() for name, t in self._hbm.items()}
        if per_table:
            for t, d in daemon.items():
                d["hbm"] = mine.get(t, vars(TierCounters()).copy())
            return daemon
        total = vars(TierCounters()).copy()
        for d in mine.values():
            total = add_dicts(total, d)
        daemon["hbm"] = total
        return daemon

    def daemon_stats(self, per_table: bool = False) -> dict:
        """{"store": counters, "clients": [{name, pid, claims (the first 16), n_claims, readonly, step, shm_bytes,
        hints, hint_bytes}], "prefetch": ..., "metrics_port": the port its metrics are served on, or None}."""
        return self._request(wire.Frame(wire.STATS, text="per_table" if per_table else "")).json()

    def resident_rows(self, table: str) -> dict[str, int]:
        """Rows in this client's HBM tier (the daemon's DDR tier is not counted)."""
        self.spec(table)
        t = self._hbm.get(table)
        return {"hbm": t.hbm.resident if t else 0}

    def close(self) -> None:
        """Write dirty HBM rows back to the daemon, then disconnect (releases this
        client's claims). Does not flush the daemon: call flush() first for
        durability. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self._write_back_all()
            finally:
                if not self._closed:
                    self._hang_up()

    def _hang_up(self) -> None:
        self._closed = True
        try:
            # wait for the daemon to hang up: by then it has released our claims,
            # so another client can claim them as soon as close() returns
            self._sock.shutdown(socket.SHUT_WR)
            self._sock.settimeout(min(self.timeout, 5.0))
            while self._sock.recv(65536):
                pass
        except OSError:
            pass
        finally:
            self._drop_connection()

    def _unsupported(self, what: str):
        raise NotImplementedError(f"{what} is not available through the daemon client; run it on the daemon's host against a stopped daemon's store")

    def checkpoint(self, path, compact: bool = True):
        self._unsupported("checkpoint")

    def serve_metrics(self, port: int, addr: str = "127.0.0.1"):
        self._unsupported("serve_metrics (use `tierstore prefetchd --metrics-port`)")

    def prefetch_stats(self) -> dict:
        self._unsupported("prefetch_stats")

    def drain_writeback(self) -> None:
        self._unsupported("drain_writeback")

    def __enter__(self) -> "DaemonStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol):
        raise unpicklable(self, "a connection to its daemon, shared memory and locks")

    def __del__(self):
        # only hang up: writing HBM rows back would run torch ops, which is unsafe while
        # the interpreter shuts down (and an embedded store does not flush on collection
        # either); close() or flush() keeps them
        try:
            with self._lock:
                if not self._closed:
                    self._hang_up()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"DaemonStore({str(self.path)!r}, daemon={str(self.socket_path)!r}, "
                f"claims={[wire.describe_claim(c) for c in self.claims]}, readonly={self.readonly})")


class ClientTableTrainer(TableTrainer):
    """A daemon client's TableTrainer (``store.trainer(table)``). A forward over claimed rows
    of a table with an HBM tier here pools from that tier, as over an embedded store's
    (the same TableStore step brings them there); any other forward reads. Tables with
    admission, TTL or the L2 score have their steps counted by the daemon's store, which
    answers which updates are kept (ADMITTED) and re-reads without a step (REREAD)."""

    store: DaemonStore

    @contextlib.contextmanager
    def resident(self, ids: torch.Tensor, admit: bool = False) -> Iterator[Resident | None]:
        c = self.store
        t = c._hbm.get(self.table)
        if t is None or not len(ids):
            yield None
            return
        # held steady by holding the client's lock while the caller computes: the tier's
        # gathers all run under it (client_hbm.py), so nothing else waits for this one
        with c._lock:
            c._check_open()
            hit = None
            if wire.claimed(c._ranges[self.table], ids.cpu().numpy()).all():
                hit = t.use_top_tier(ids) or (t.admit(ids) if admit else None)
            yield hit

    def update_resident(self, slots: torch.Tensor, generation: int, update: Callable[[CacheTier], None]) -> bool:
        c = self.store
        t = c._hbm.get(self.table)
        with c._lock:
            c._check_open()
            if t is None or not t.update_resident(slots, generation, update):
                return False
        self.written += 1
        return True

    def admitted(self, uid: torch.Tensor) -> torch.Tensor | None:
        c, table = self.store, self.table
        if c.spec(table).admit_after == 1:
            return None
        ids = c._ids_np(table, uid)
        mask = np.empty(len(ids), dtype=bool)
        chunk = c._chunk(0)
        with c._lock:
            for lo in range(0, len(ids), chunk):
                part = ids[lo:lo + chunk]
                reply = c._request(wire.Frame(wire.ADMITTED, text=table, ids=part))
                if reply.ids is None or len(reply.ids) != len(part):
                    raise RuntimeError(f"the daemon answered an admission query of {len(part)} ids with "
                                       f"{0 if reply.ids is None else len(reply.ids)}")
                mask[lo:lo + len(part)] = reply.ids != 0
        return torch.from_numpy(mask)

    def reread(self, uid: torch.Tensor) -> torch.Tensor:
        # such tables have no HBM tier here (DaemonStore._make_hbm): the daemon's copy is the newest
        c, table = self.store, self.table
        spec = c.spec(table)
        ids = c._ids_np(table, uid)
        if not len(ids):
            return torch.empty((0, spec.width), dtype=torch.float32, device=c.device)
        return c._daemon_read(table, ids, spec.width, True, None, wire.REREAD)


def _is_range(c) -> bool:
    return isinstance(c, tuple) and len(c) == 3 and isinstance(c[0], str) and not isinstance(c[1], str)
