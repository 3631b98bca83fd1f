"""The daemon's client connections: its listening socket, how many clients it may hold,
each client's session, and every client's write claims of a table (server.py
describes the daemon)."""
from __future__ import annotations

import logging
import os
import resource
import socket
import stat
from collections import deque
from pathlib import Path

import numpy as np

from tierstore.daemon import wire
from tierstore.errors import PathExistsError, PathNotFoundError, StateError

log = logging.getLogger("tierstore.prefetchd")


def bind_socket(path: Path) -> socket.socket:
    """The daemon's listening socket at ``path``, mode 0600; a stale socket file is replaced,
    a live daemon's refused."""
    if not path.parent.is_dir():
        raise PathNotFoundError(f"the directory of --socket {path} does not exist; create it first "
                                f"(mkdir -p {path.parent}) or choose a socket path in an existing directory")
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise PathExistsError(f"{path} exists and is not a socket; choose another --socket path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale socket %s (nothing listens on it)", path)
            path.unlink(missing_ok=True)
        else:
            raise StateError(f"a daemon is already serving {path}; stop it first or choose another --socket path")
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


def client_cap(wanted: int | None) -> int:
    """How many clients to serve: ``wanted`` (--max-clients; None: as many as fit, at most
    1024), checked against the open-file limit: a client takes its socket and, during its
    handshake, its segment's descriptor."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    room = (soft - in_use - 16) // 2 if soft != resource.RLIM_INFINITY else 1 << 20
    if room < 1:
        raise StateError(f"the open-file limit ({soft}, {in_use} in use) leaves no room for clients; raise it (ulimit -n)")
    if wanted is None:
        return min(1024, room)
    if wanted > room:
        log.warning("--max-clients %d needs more descriptors than the open-file limit (%d, %d in use) allows; "
                    "serving at most %d clients (raise ulimit -n for more)", wanted, soft, in_use, room)
    return min(wanted, room)


class Session:
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


class ClaimIndex:
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
