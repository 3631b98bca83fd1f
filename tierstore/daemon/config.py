"""``tierstore prefetchd``'s settings, checked (server.py describes the daemon)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tierstore.daemon import wire
from tierstore.engine.memory import parse_bytes
from tierstore.validate import check_int, check_number
from tierstore.errors import SettingError


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
            raise SettingError("give --ddr-rows N (rows of the DDR tier per table) or --memory-budget SIZE (which sizes it)")
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
            raise SettingError(f"limits.max_bytes {self.limits.max_bytes} exceeds max_inflight_bytes {self.max_inflight_bytes}: "
                             "one frame could never be admitted; lower the one or raise the other")
        if self.lookahead_source is not None:
            self.lookahead_source = Path(self.lookahead_source)
        if len(os.fsencode(self.socket)) >= 104:  # sun_path is 108 bytes on Linux, 104 on BSDs
            raise SettingError(f"socket path {self.socket} is too long for a Unix socket (< 104 bytes); use a shorter path")
