"""Plain counters bumped on the hot path; readers (stats(), the Prometheus
collector) copy them at read time, so counting costs a few integer adds per call."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    writebacks: int = 0  # dirty rows written to LMDB when they left the cache


@dataclass
class SSDCounters:
    reads: int = 0  # rows looked up in LMDB (found or not)
    writes: int = 0  # rows written to LMDB
    read_bytes: int = 0
    write_bytes: int = 0


@dataclass
class TableCounters:
    hbm: TierCounters
    ddr: TierCounters
    ssd: SSDCounters

    @classmethod
    def new(cls) -> "TableCounters":
        return cls(TierCounters(), TierCounters(), SSDCounters())

    def as_dict(self) -> dict:
        return {"hbm": asdict(self.hbm), "ddr": asdict(self.ddr), "ssd": asdict(self.ssd)}


def add_dicts(a: dict, b: dict) -> dict:
    return {k: add_dicts(v, b[k]) if isinstance(v, dict) else v + b[k] for k, v in a.items()}
