"""``tierstore stats PATH``: a store's facts from disk (tables, rows on disk,
bytes, time of the last flush), read through a read-only LMDB environment so
that it works while a trainer has the store open for writing. A serving store
(tierstore.export's output) is described as one: its tables' dtypes, rows and
bytes, and the version and source of the export.

It shows what the writer's last flush left (docs/durability.md, "What readers see"): rows
written since appear after that writer's next flush (in a table of an unbounded id space,
once written back). It also shows the memory a store of these tables takes, split by
tierstore.engine.memory.split_memory for the sizes given (--memory-budget, or
--hbm-rows/--ddr-rows), and the memory limit detected here.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import lmdb  # only for its exception types; the reading goes through tierstore.io

import torch

from tierstore.io import LmdbBackend
from tierstore.io.serving_layout import NotServingStoreError, ServingReader
from tierstore.engine.memory import MemorySplit, detect_limit, format_bytes, parse_bytes, split_memory
from tierstore.spec import TableSpec
from tierstore.tools.cli import add_verb
from tierstore.errors import PathNotFoundError, SettingError

# A writer creating a table or growing the map can be caught mid-way; a fresh
# read-only environment a moment later sees the finished state.
_RETRIES = 5
_RETRY_WAIT_S = 0.05


@dataclass
class TableFacts:
    name: str
    num_rows: int | None  # None: unbounded id space
    dim: int
    state_dim: int
    rows_on_disk: int
    payload_bytes: int  # rows_on_disk x (8-byte key + 4 x (dim + state_dim))
    admit_after: int = 1
    ttl_steps: int | None = None
    evict_l2_below: float | None = None
    evicted_rows: int = 0  # deleted from disk over the store's life (evict(), TTL sweep), as of the last flush


@dataclass
class StoreFacts:
    path: str
    format: int | None
    disk_bytes: int  # size of data.mdb
    last_flush: float | None  # store-clock seconds (time.time() by default); None if never flushed
    tables: list[TableFacts]

    @property
    def last_flush_utc(self) -> str | None:
        return _utc(self.last_flush)

    def to_json(self) -> dict:
        return {**asdict(self), "last_flush_utc": self.last_flush_utc}


def require_store(path: str | Path, needs_tables: bool = False) -> Path:
    """``path`` as a Path if it holds a store (with tables, if ``needs_tables``);
    else PathNotFoundError or SettingError saying how to get one from the command line."""
    path = Path(path)
    if not (path / "data.mdb").is_file():
        inside = sorted(str(p.parent) for p in path.glob("*/data.mdb")) if path.is_dir() else []
        if inside:  # e.g. the demo's directory, which holds its store and checkpoint
            raise PathNotFoundError(f"no tierstore at {path} (no data.mdb), but it holds the stores {', '.join(inside)}: pass one of them")
        raise PathNotFoundError(
            f"no tierstore at {path} (no data.mdb); `tierstore demo` trains a demo model and leaves its store in "
            "tierstore-demo/store (--dir DIR: DIR/store); a training script creates its own with TieredStore(path, tables=[...])")
    if needs_tables and not read_facts(path).tables:
        raise SettingError(f"the store at {path} holds no tables; create them first with TieredStore({str(path)!r}, tables=[...]) "
                         "(as the training script does), then start this again")
    return path


def read_facts(path: str | Path) -> StoreFacts:
    """Facts of the store at ``path``, opened read-only (safe next to a running writer)."""
    path = Path(path)
    for _ in range(_RETRIES - 1):
        try:
            return _read_once(path)
        except (lmdb.NotFoundError, lmdb.MapResizedError):
            time.sleep(_RETRY_WAIT_S)
    try:
        return _read_once(path)
    except (lmdb.NotFoundError, lmdb.MapResizedError) as e:
        raise SettingError(f"{path} holds an LMDB environment without complete tierstore metadata ({e}); "
                           "if a writer is creating it, retry once it has opened") from e


def _read_once(path: Path) -> StoreFacts:
    backend = LmdbBackend(path, readonly=True)
    try:
        meta = backend.read_meta()
        specs = [TableSpec.from_json(d) for d in meta.get("tables", [])]
        for spec in specs:
            backend.open_table(spec.name, spec.dim, spec.state_dim, spec.dtype, num_rows=spec.num_rows)
        rows = backend.table_stats()  # one read transaction: a consistent snapshot of all tables
        disk = backend.disk_bytes()
    finally:
        backend.close()
    tables = [
        TableFacts(s.name, s.num_rows, s.dim, s.state_dim, rows[s.name], rows[s.name] * (8 + 4 * s.width),
                   s.admit_after, s.ttl_steps, s.evict_l2_below, meta.get("evicted", {}).get(s.name, 0)) for s in specs
    ]
    return StoreFacts(str(path), meta.get("format"), disk, meta.get("last_flush"), tables)


@dataclass
class ServingTableFacts:
    name: str
    num_rows: int | None  # None: unbounded id space
    dim: int
    dtype: str  # the serving rows' type: float32, float16, int8, int4
    row_bytes: int
    rows_stored: int  # rows the export wrote; the others read as the table's initial values
    payload_bytes: int  # rows_stored x (8-byte key + row_bytes)


@dataclass
class ServingFacts:
    path: str
    format: int
    version: int  # the published version the export stands for (tierstore.serving.stream)
    source: str | None  # the training store (or sharded checkpoint) exported
    exported: float | None  # time.time() of the export
    disk_bytes: int  # size of data.mdb
    tables: list[ServingTableFacts]

    def to_json(self) -> dict:
        return {"kind": "serving store", **asdict(self), "exported_utc": _utc(self.exported)}


def read_serving_facts(path: str | Path) -> ServingFacts | None:
    """Facts of the serving store at ``path``; None if ``path`` holds no serving store."""
    try:
        reader = ServingReader(path)
    except NotServingStoreError:
        return None
    try:
        meta, stored = reader.meta, reader.rows_stored()
    finally:
        reader.close()
    tables = []
    for t in meta["tables"]:
        spec = TableSpec.from_json(t["spec"])
        tables.append(ServingTableFacts(t["name"], spec.num_rows, spec.dim, t["dtype"], t["row_bytes"], stored[t["name"]],
                                        stored[t["name"]] * (8 + t["row_bytes"])))
    return ServingFacts(str(path), meta["format"], int(meta.get("version", 0)), meta.get("source"), meta.get("time"),
                        (Path(path) / "data.mdb").stat().st_size, tables)


def format_serving_facts(f: ServingFacts) -> str:
    lines = [f"serving store at {f.path} (serving format {f.format}), version {f.version}; "
             "open it with tierstore.ServingStore(path) (docs/serving.md)",
             f"  exported    {_utc(f.exported) or '-'} from {f.source or '-'}",
             f"  disk        {_size(f.disk_bytes)} in data.mdb ({f.disk_bytes:,} bytes)"]
    header = ("table", "num_rows", "dim", "dtype", "row bytes", "rows stored", "of num_rows", "payload")
    body = [(t.name, "unbounded" if t.num_rows is None else f"{t.num_rows:,}", str(t.dim), t.dtype, str(t.row_bytes),
             f"{t.rows_stored:,}", "-" if t.num_rows is None else f"{100 * t.rows_stored / t.num_rows:.2f}%", _size(t.payload_bytes))
            for t in f.tables]
    body.append(("total", "", "", "", "", f"{sum(t.rows_stored for t in f.tables):,}", "",
                 _size(sum(t.payload_bytes for t in f.tables))))
    lines += _aligned(header, body)
    lines.append("  rows not stored read as their table's initial values (its RowInit)")
    return "\n".join(lines)


def _utc(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds")


def read_specs(path: str | Path) -> list[TableSpec]:
    backend = LmdbBackend(path, readonly=True)
    try:
        return [TableSpec.from_json(d) for d in backend.read_meta().get("tables", [])]
    finally:
        backend.close()


def memory_facts(path: str | Path, budget: int | None = None, hbm_rows: int | None = None, ddr_rows: int | None = None) -> MemorySplit:
    """What a store of ``path``'s tables opened here with these sizes would hold, part by part
    (docs/memory-budget.md), with the memory limit detected here. The HBM tier is host
    memory unless this machine has CUDA (the store's default device)."""
    split = split_memory(budget, read_specs(path), hbm_rows=hbm_rows, ddr_rows=ddr_rows, hbm_on_host=not torch.cuda.is_available())
    split.limit = detect_limit()
    return split


def format_memory(m: MemorySplit) -> str:
    sizes = (f"memory_budget={format_bytes(m.budget)}" if m.budget is not None else
             f"no budget: hbm_rows={sum(m.hbm_rows.values()):,}, ddr_rows={sum(m.ddr_rows.values()):,} in all and the defaults")
    lines = [f"  memory      a store of these tables opened here with {sizes} holds {format_bytes(m.host_bytes)} of host memory",
             f"              limit here: {m.limit.describe() if m.limit else '-'}"]
    lines += _aligned(("part", "rows", "may hold"),
                      [(name + ("" if p.host else " (device)"), f"{p.rows:,}", format_bytes(p.bytes)) for name, p in m.parts.items()])
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def format_facts(f: StoreFacts) -> str:
    lines = [f"tierstore at {f.path} (format {f.format})"]
    flushed = f"{f.last_flush_utc} (store clock {f.last_flush:.3f})" if f.last_flush is not None else "never"
    lines.append(f"  last flush  {flushed}")
    lines.append(f"  disk        {_size(f.disk_bytes)} in data.mdb ({f.disk_bytes:,} bytes)")
    header = ("table", "num_rows", "dim", "state", "rows on disk", "of num_rows", "payload")
    body = [
        (t.name, "unbounded" if t.num_rows is None else f"{t.num_rows:,}", str(t.dim), str(t.state_dim), f"{t.rows_on_disk:,}",
         "-" if t.num_rows is None else f"{100 * t.rows_on_disk / t.num_rows:.2f}%", _size(t.payload_bytes))
        for t in f.tables
    ]
    body.append(("total", "", "", "", f"{sum(t.rows_on_disk for t in f.tables):,}", "", _size(sum(t.payload_bytes for t in f.tables))))
    lines += _aligned(header, body)
    lived = [t for t in f.tables if t.admit_after > 1 or t.ttl_steps is not None or t.evict_l2_below is not None or t.evicted_rows]
    if lived:  # docs/admission.md
        lines.append("  admission and eviction (evicted: deleted from disk, as of the last flush)")
        lines += _aligned(("table", "admit_after", "ttl_steps", "l2_below", "rows on disk", "evicted"),
                          [(t.name, str(t.admit_after), "-" if t.ttl_steps is None else f"{t.ttl_steps:,}",
                            "-" if t.evict_l2_below is None else f"{t.evict_l2_below:g}",
                            f"{t.rows_on_disk:,}", f"{t.evicted_rows:,}") for t in lived])
    return "\n".join(lines)


def _aligned(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    """Rows of a table, the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in [header, *body]]


def register(sub) -> None:
    p = add_verb(sub, "stats")
    p.add_argument("path", help="store directory (the one holding data.mdb)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--memory-budget", type=_budget, default=None,
                   help="show the memory of a store of these tables opened with memory_budget= this (e.g. 1GiB): its split into "
                        "tiers, staging, write-back queue, LMDB's dirty pages and page cache (docs/memory-budget.md)")
    p.add_argument("--hbm-rows", type=int, default=None, help="HBM tier rows per table for the memory shown (default: 0, or derived)")
    p.add_argument("--ddr-rows", type=int, default=None, help="DDR tier rows per table for the memory shown (default: 0, or derived)")
    p.set_defaults(func=run)
    c = add_verb(sub, "compact")
    c.add_argument("path", help="store directory (the one holding data.mdb); no process may have it open")
    c.set_defaults(func=run_compact)


def _budget(text: str) -> int:
    try:
        return parse_bytes(text, "--memory-budget")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    path = require_store(args.path)
    try:
        facts = read_facts(path)  # errors: tierstore.tools.cli prints them
    except ValueError:  # not a training store's LMDB environment; it may be a serving store
        serving = read_serving_facts(path)
        if serving is None:
            raise
        return _run_serving(args, serving)
    memory = memory_facts(args.path, args.memory_budget, args.hbm_rows, args.ddr_rows)
    if args.json:
        print(json.dumps({**facts.to_json(), "memory": memory.as_dict()}, indent=2))
    else:
        print(format_facts(facts) + "\n" + format_memory(memory))
    return 0


def _run_serving(args: argparse.Namespace, facts: ServingFacts) -> int:
    if args.memory_budget is not None or args.hbm_rows is not None or args.ddr_rows is not None:
        raise SettingError(f"{args.path} is a serving store: --memory-budget, --hbm-rows and --ddr-rows size a training store's "
                         "memory; a serving store's tiers are ServingStore(path, hbm_rows=, ddr_rows=)'s (docs/serving.md)")
    print(json.dumps(facts.to_json(), indent=2) if args.json else format_serving_facts(facts))
    return 0


def run_compact(args: argparse.Namespace) -> int:
    from tierstore import TieredStore

    before, after = TieredStore.compact(require_store(args.path))
    print(f"compacted {args.path}/data.mdb: {_size(before)} -> {_size(after)} ({before:,} -> {after:,} bytes)")
    return 0
