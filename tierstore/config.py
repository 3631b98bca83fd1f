"""What a store opens with: its settings (StoreConfig), the table specs reconciled with those
stored, and the memory the settings size (tierstore.engine.memory.split_memory)."""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierstore.eviction import make_policy
from tierstore.io import FORMAT_VERSION
from tierstore.io.rowlog import SPARE
from tierstore.io.lmdb_file import corrupt
from tierstore.engine.memory import MemorySplit, check_fits, detect_limit, format_bytes, parse_bytes, process_rss, return_freed_blocks, rows_bytes, split_memory
from tierstore.engine.tensors import resolve_device
from tierstore.spec import TableSpec
from tierstore.validate import check_choice, check_int, check_number, check_rows
from tierstore.errors import ArgumentTypeError, FormatError, SettingError, kind

if TYPE_CHECKING:
    from tierstore.io import RowBackend
    from tierstore.engine.prefetch import PrefetchConfig

Sizes = int | Mapping[str, int]


@dataclass
class StoreConfig:
    """A store's settings, checked: ``TieredStore(path, tables, config=StoreConfig(...))``
    takes them whole (the keywords of the same names are the other way to give them).
    The defaults are TieredStore's."""
    path: Path | None = None  # None: the path TieredStore is given
    hbm_rows: Sizes | None = None  # None: left out (0, or derived from memory_budget); set to {table: rows} at open
    ddr_rows: Sizes | None = None
    policy: str = "lru"
    device: torch.device | None = None
    readonly: bool = False
    map_size: int | None = None
    clock: Callable[[], float] = field(default=time.time)
    eviction: str = "policy"
    writeback_rows: int | None = None  # None: 65536, or derived from memory_budget
    writeback_group_rows: int = 32768
    memory_budget: int | str | None = None  # bytes (tierstore.engine.memory.parse_bytes); an int once checked
    # large reads of rows skip the page cache (tierstore.io.direct) where the system allows: True, False, or None:
    # when a memory_budget's page-cache share is smaller than the tables' rows, whose pages it then could not keep
    direct_reads: bool | None = None
    # dead rows a table stored as a log keeps at most, as a fraction of its live rows, before its writes also copy
    # live rows to reclaim their room (tierstore.io.rowlog): more disk for fewer copies. At most 1.0: the log's
    # segment numbers and their bookkeeping in the budget are sized for as many dead slots as live ones at most
    spare_space: float = SPARE

    def __post_init__(self):
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ArgumentTypeError(f"path must be the store's directory (a str or pathlib.Path), got {type(self.path).__name__}")
        self.path = None if self.path is None else Path(self.path)
        if self.memory_budget is not None:
            self.memory_budget = parse_bytes(self.memory_budget, "memory_budget")
        if self.direct_reads not in (None, True, False):
            raise SettingError(f"direct_reads must be True, False or None (None: when a memory_budget cannot cache the "
                             f"tables' rows), got {self.direct_reads!r}")
        check_int(self.writeback_rows, "writeback_rows", none=True,
                  meaning="rows queued for LMDB before a call waits; 0 = wait for every write")
        check_int(self.writeback_group_rows, "writeback_group_rows",
                  meaning="rows the writer gathers into one LMDB commit, at most writeback_rows // 2; 0 = commit each write at once")
        check_choice(self.eviction, "eviction", ("policy", "lookahead"), "next use in the prefetch window first")
        self.spare_space = check_number(self.spare_space, "spare_space", above=True, at_most=1.0,
                                        meaning="dead rows kept at most, as a fraction of the live rows: a table's file holds "
                                                "up to 1 + spare_space times its rows' bytes, and a larger one copies fewer rows a row written")
        check_rows(self.hbm_rows, "hbm_rows")
        check_rows(self.ddr_rows, "ddr_rows")
        make_policy(self.policy)  # raises on unknown names
        self.device = resolve_device(self.device)

    def rows_for(self, name: str, table: str) -> int:
        value = getattr(self, name)
        return int(value.get(table, 0)) if isinstance(value, Mapping) else int(value)


def reconcile_specs(backend: RowBackend, path: Path, given: list[TableSpec], readonly: bool) -> dict[str, TableSpec]:
    """The specs a store opens with: those stored in ``path``, and the new tables of ``given``
    (written to the metadata); a given spec that contradicts a stored one is refused."""
    meta = backend.read_meta()
    if meta and meta.get("format") != FORMAT_VERSION:
        raise FormatError(f"{path} has store format {meta.get('format')}, this tierstore reads {FORMAT_VERSION}")
    try:
        stored = {d["name"]: TableSpec.from_json(d) for d in meta.get("tables", [])}
    except (TypeError, KeyError, ValueError) as e:
        raise corrupt(path / "data.mdb", f"its table specs are unreadable ({kind(e)}: {e})") from None
    names = [s.name for s in given]
    if len(set(names)) != len(names):
        raise SettingError(f"duplicate table names in tables=: {names}")
    for spec in given:
        old = stored.get(spec.name)
        if old is None:
            continue
        for f in dataclasses.fields(TableSpec):
            if getattr(old, f.name) != getattr(spec, f.name):
                # a module or the DMP sharder passes tables= for the caller: name the directory and both fixes
                raise SettingError(
                    f"table {spec.name!r}: {f.name}={getattr(spec, f.name)!r} contradicts the "
                    f"{f.name}={getattr(old, f.name)!r} stored in {path}; open it without tables= to use the "
                    "stored specs, or give a new path for this layout"
                )
    new = [s for s in given if s.name not in stored]
    if new and readonly:
        raise SettingError(f"tables {[s.name for s in new]} are not in the store and it is open readonly")
    specs = {**stored, **{s.name: s for s in new}}
    if not specs:
        raise SettingError(f"{path} holds no tables; pass tables=[tierstore.TableSpec(...)] to create them")
    if not meta or new:
        backend.write_meta({"format": FORMAT_VERSION, "tables": [s.to_json() for s in specs.values()]},
                                 new_tables={s.name: (s.ttl_steps is not None, s.num_rows) for s in new})
    return specs


def size_memory(cfg: StoreConfig, backend: RowBackend, specs: Mapping[str, TableSpec], prefetch: PrefetchConfig) -> MemorySplit:
    """The store's memory (tierstore.engine.memory.split_memory), checked against the memory
    limit when a budget or tier sizes were given; sets the sizes the budget derived in ``cfg``
    and the backend's limits."""
    split = split_memory(cfg.memory_budget, list(specs.values()), hbm_rows=cfg.hbm_rows, ddr_rows=cfg.ddr_rows,
                         indexed_tables=backend.indexed_tables(list(specs.values())),
                         staged_rows=prefetch.staged_rows, writeback_rows=cfg.writeback_rows,
                         hbm_on_host=cfg.device.type == "cpu", writes=not cfg.readonly,
                         direct_reads=cfg.direct_reads)
    split.limit = detect_limit()
    if cfg.memory_budget is not None:
        return_freed_blocks()
    if cfg.memory_budget is not None or cfg.hbm_rows is not None or cfg.ddr_rows is not None:
        what = (f"memory_budget={cfg.memory_budget:,} bytes" if cfg.memory_budget is not None else
                f"the store at {cfg.path} with hbm_rows={cfg.hbm_rows}, ddr_rows={cfg.ddr_rows}")
        check_fits(split, split.limit, process_rss(), what)
    cfg.hbm_rows, cfg.ddr_rows, cfg.writeback_rows = split.hbm_rows, split.ddr_rows, split.writeback_rows
    backend.txn_rows = split.txn_rows
    backend.limit_index(split.index_limits, split.held_index)
    # pages read through LMDB's map would stay in the process's RSS: kept to half the page cache's share
    backend.limit_mapped(None if split.budget is None else split.parts["page_cache"].bytes // 2)
    backend.read_directly(*direct_reads(cfg, split, specs))
    return split

def direct_reads(cfg: StoreConfig, split: MemorySplit, specs: Mapping[str, TableSpec]) -> tuple[bool, str]:
    """Whether large reads skip the page cache, and why. Through the page cache a read
    of a cached row costs ~1 us, a direct one the disk's ~10: direct reads pay only where
    the page cache could not keep the rows anyway."""
    if cfg.direct_reads is not None:
        return cfg.direct_reads, f"direct_reads={cfg.direct_reads}"
    if split.budget is None:
        return False, "no memory_budget: the page cache may keep every row"
    rows = rows_bytes(list(specs.values()))
    share = split.parts["page_cache"].bytes
    if rows <= share:
        return False, f"the tables' rows ({format_bytes(rows)}) fit the budget's page-cache share ({format_bytes(share)})"
    return True, f"the tables' rows ({format_bytes(rows)}) exceed the budget's page-cache share ({format_bytes(share)})"
