"""A trainer's side of ``tierstore prefetchd``: ``TieredStore(PATH, daemon=SOCK, ...)``.

The daemon (tierstore/tools/daemon.py) owns the store's DDR tier and LMDB
files; this class sends it READ/WRITE/PREFETCH/FLUSH frames (tierstore/wire.py)
over a Unix socket and has the read/write/prefetch/flush API of an embedded
store. Writes go into the daemon's store and are durable after ``flush()``
(anyone's) or when the daemon stops; see the daemon's module docstring.

Not yet supported: a client-side HBM tier (``hbm_rows`` must be 0; rows are
returned on ``device``), row-range claims (claims are whole tables), and shared
memory for large payloads (arrays go through the socket).
"""
from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from . import wire
from .spec import TableSpec
from .store import TieredStore


class DaemonStore(TieredStore):
    """A store served by a ``tierstore prefetchd`` daemon (same read/write API).

    ``claim``: tables this client writes; a table has one writer at a time
    (PermissionError naming the holder otherwise). ``readonly=True`` clients
    read every table and write none. ``timeout``: seconds any one request may
    take before the daemon counts as gone (ConnectionError).
    """

    def __init__(
        self,
        path: str | Path,
        tables: Sequence[TableSpec] | None = None,
        hbm_rows: int = 0,
        ddr_rows: int = 0,
        *,
        daemon: str | Path,
        claim: Sequence[str] = (),
        readonly: bool = False,
        device: str | torch.device | None = "cpu",
        timeout: float = 30.0,
        client: str | None = None,
        limits: wire.Limits | None = None,
        **unsupported,
    ):
        if unsupported:
            raise TypeError(f"{sorted(unsupported)} apply to the daemon's store, not to a client; set them on `tierstore prefetchd`")
        if hbm_rows:
            raise ValueError("a client-side HBM tier (hbm_rows > 0 with daemon=) is not supported yet; pass hbm_rows=0 "
                             "(rows come from the daemon's DDR tier on every read)")
        if ddr_rows:
            raise ValueError("ddr_rows belongs to the daemon (`tierstore prefetchd --ddr-rows N`); drop ddr_rows= with daemon=")
        if isinstance(claim, str):
            claim = [claim]
        if not all(isinstance(c, str) for c in claim):
            raise TypeError(f"claim must be a list of table names, got {claim!r}")
        if readonly and claim:
            raise ValueError(f"readonly=True and claim={list(claim)} contradict each other; a readonly client writes nothing")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.path = Path(path)
        self.socket_path = Path(daemon)
        self.readonly = bool(readonly)
        self.claims = tuple(claim)
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.timeout = float(timeout)
        self._limits = limits or wire.Limits()
        self._lock = threading.Lock()  # one request in flight per connection
        self._closed = False
        self._sock = self._connect()
        name = client or f"{socket.gethostname()}:{os.getpid()}"
        hello = {"client": name, "claims": list(claim), "readonly": self.readonly, "path": str(self.path.resolve())}
        try:
            reply = self._request(wire.Frame(wire.HELLO, text=json.dumps(hello)))
        except BaseException:
            self._sock.close()
            self._closed = True
            raise
        body = reply.json()
        self._tables = {d["name"]: TableSpec.from_json(d) for d in body["tables"]}
        self.daemon_pid = body.get("pid")
        for spec in tables or ():
            have = self._tables.get(spec.name)
            if have is None:
                self.close()
                raise KeyError(f"the daemon's store has no table {spec.name!r} (it has {sorted(self._tables)}); "
                               "a client cannot create tables: create them with an embedded TieredStore before starting the daemon")
            if have != spec:
                self.close()
                raise ValueError(f"table {spec.name!r}: {spec!r} contradicts the daemon's {have!r}; attach without tables=")

    # -- transport ----------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.socket_path))
        except (FileNotFoundError, ConnectionRefusedError, socket.timeout) as e:
            sock.close()
            raise ConnectionError(
                f"no tierstore daemon answers at {self.socket_path} ({e.__class__.__name__}); start one with "
                f"`tierstore prefetchd {self.path} --socket {self.socket_path} --ddr-rows N`"
            ) from None
        return sock

    def _request(self, frame: wire.Frame, rows_out: np.ndarray | None = None) -> wire.Frame:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"daemon store {self.path} (via {self.socket_path}) is closed")
            try:
                wire.send_frame(self._sock, frame)
                reply = wire.recv_frame(self._sock, self._limits, rows_out)
            except (socket.timeout, OSError, wire.ProtocolError) as e:
                # the stream is out of step or dead: nothing more can be said on it
                self._closed = True
                self._sock.close()
                what = f"did not answer within {self.timeout} s" if isinstance(e, socket.timeout) else f"went away ({e})"
                raise ConnectionError(f"the tierstore daemon at {self.socket_path} {what}; this client is closed, "
                                      "attach again once the daemon runs (unflushed writes may be lost)") from None
            if reply is None:
                self._closed = True
                self._sock.close()
                raise ConnectionError(f"the tierstore daemon at {self.socket_path} closed the connection; "
                                      "this client is closed, attach again once the daemon runs")
        wire.raise_for(reply)
        return reply

    # -- the store API -------------------------------------------------------------------
    @property
    def tables(self) -> dict[str, TableSpec]:
        return dict(self._tables)

    def _spec(self, table: str) -> TableSpec:
        try:
            return self._tables[table]
        except KeyError:
            raise KeyError(f"unknown table {table!r}; the store has tables {sorted(self._tables)}") from None

    def _ids_np(self, table: str, ids) -> np.ndarray:
        t = self._as_ids(self._spec(table), ids)  # validation with the embedded store's messages
        return t.cpu().numpy()

    def read(self, table: str, ids, with_state: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        spec = self._spec(table)
        ids_np = self._ids_np(table, ids)
        n, cols = len(ids_np), (spec.width if with_state else spec.dim)
        if out is not None and (tuple(out.shape) != (n, cols) or out.dtype != torch.float32 or out.device != self.device):
            raise ValueError(f"out must be a float32 tensor of shape ({n}, {cols}) on {self.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        if n == 0:
            return out if out is not None else torch.empty((0, cols), dtype=torch.float32, device=self.device)
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        reply = self._request(wire.Frame(wire.READ, wire.WITH_STATE if with_state else 0, table, ids_np),
                              rows_out=out.numpy() if direct else None)
        if reply.rows is None or reply.rows.shape != (n, cols):
            raise RuntimeError(f"the daemon answered a read of {n} x {cols} with {None if reply.rows is None else reply.rows.shape}")
        if direct:
            return out
        rows = torch.from_numpy(reply.rows)
        if out is not None:
            return out.copy_(rows)
        return rows.to(self.device)

    def write(self, table: str, ids, values, with_state: bool = False) -> None:
        if self.readonly:
            raise PermissionError(f"this client of {self.socket_path} attached readonly; attach with claim=[{table!r}] to write")
        spec = self._spec(table)
        ids_np = self._ids_np(table, ids)
        cols = spec.width if with_state else spec.dim
        rows = self._as_values(spec, values, len(ids_np), cols).numpy()
        if len(ids_np) == 0:
            return
        self._request(wire.Frame(wire.WRITE, wire.WITH_STATE if with_state else 0, table, ids_np, rows))

    def prefetch(self, table: str, ids) -> None:
        """Hint that the next batches read these rows; the daemon starts fetching
        them and this returns at once (a bad id is refused here, not later)."""
        self._request(wire.Frame(wire.PREFETCH, 0, table, self._ids_np(table, ids)))

    def report_step(self, step: int) -> None:
        """Tell the daemon this trainer's step (its trace lookahead follows the slowest client)."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self._request(wire.Frame(wire.STEP, ids=np.array([step], dtype=np.int64)))

    def flush(self) -> None:
        """Return once every dirty row in the daemon's store (every client's) is durable in LMDB."""
        self._request(wire.Frame(wire.FLUSH))

    def stats(self, per_table: bool = False) -> dict:
        """The daemon's store counters (same shape as TieredStore.stats)."""
        return self.daemon_stats(per_table)["store"]

    def daemon_stats(self, per_table: bool = False) -> dict:
        """{"store": counters, "clients": [{name, pid, claims, readonly, step}]}."""
        return self._request(wire.Frame(wire.STATS, text="per_table" if per_table else "")).json()

    def close(self) -> None:
        """Disconnect (releases this client's claims). Does not flush: call flush() first
        for durability. Idempotent."""
        with self._lock:
            if not self._closed:
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
                    self._sock.close()

    def _unsupported(self, what: str):
        raise NotImplementedError(f"{what} is not available through the daemon client; run it on the daemon's host against a stopped daemon's store")

    def checkpoint(self, path, compact: bool = True):
        self._unsupported("checkpoint")

    def serve_metrics(self, port: int, addr: str = "127.0.0.1"):
        self._unsupported("serve_metrics (use `tierstore prefetchd --metrics-port`)")

    def resident_rows(self, table: str) -> dict[str, int]:
        self._unsupported("resident_rows")

    def prefetch_stats(self) -> dict:
        self._unsupported("prefetch_stats")

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"DaemonStore({str(self.path)!r}, daemon={str(self.socket_path)!r}, claims={list(self.claims)}, readonly={self.readonly})"
