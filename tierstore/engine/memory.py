"""The store's memory budget: how it splits, the sizes it accepts, the limit it must fit.

``TieredStore(..., memory_budget="1GiB")`` sizes every part of the store's host
memory from one figure (split_memory); without a budget the same function says
what the given (or default) sizes take, so ``stats()["memory"]`` always shows it.
Everything here is arithmetic over TableSpecs and small files: the detection
functions take their paths as parameters (tests point them at fixture files).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tierstore.io import WRITE_TXN_ROWS, dense_bytes, index_bytes_bound, mapped_bytes_bound, runs_bytes_bound  # rows per LMDB write transaction at most, by default

from tierstore.engine.hashindex import PROBE_WINDOW
from tierstore.precision import DTYPES
from tierstore.spec import TableSpec
from tierstore.errors import SettingError

PAGE = 4096  # LMDB's page: a transaction copies (mallocs) a dirty page for every random row it writes
PAGE_CACHE_SHARE = 4  # 1/4 of the budget is left to the page cache of data.mdb
DIRTY_SHARE = 16  # 1/16 of it (at most WRITE_TXN_ROWS pages, at least MIN_TXN_ROWS): one write transaction's dirty pages
MIN_TXN_ROWS = 1024  # fewer rows a transaction and its commit costs more than its rows
INDEX_SHARE = 16  # 1/16 of it at most: the row index's runs (io.rowindex); past it they are mapped from its file
UNBUDGETED_INDEX_BYTES = 4  # without a budget, the row index's runs may take this much a declared row before they are mapped
# 1/6 of the budget is left to the page cache where it would keep none of the rows a step reads (_read_past)
READ_PAST_PAGE_CACHE_SHARE = 6
HELD_INDEX_SHARE = 3  # 1/3 of it at most: the row index stored dense (4 bytes a declared row), held in memory (_held_index)
QUEUE_SHARE = 8  # 1/8 of what is left after the page cache and LMDB's dirty pages: the write-back queue
STAGING_SHARE = 8  # 1/8 of it: prefetch staging; the rest: the DDR tier
DEFAULT_WRITEBACK_ROWS = 65536
DEFAULT_STAGED_ROWS = 65536
# a tier's per-slot working buffers beside its tensors: the two rank arrays eviction
# fills (tierstore.engine.step.StepPlanner, kept per tier between steps) and prefetch's next-use array (Prefetcher.next_use)
WORK_BYTES_PER_SLOT = 24
# a queued row beside its values: id, pool slot, sequence number, last-use step, where LMDB had it (tierstore.io.writeback)
QUEUE_BYTES_PER_ROW = 40
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as 9223372036854771712

Sizes = int | Mapping[str, int]

# as `tierstore capacity`'s sizes (tools/capacity_cli.py): K/M/G/T are powers of 1000, as in Kubernetes
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
ACCEPTED = ("bytes as an int (1073741824) or a string such as '1GiB', '512MiB', '2G' or '1.5GB' "
            "(KiB/MiB/GiB/TiB, or Ki/Mi/Gi/Ti, are powers of 1024; K/M/G/T, or KB/MB/GB/TB, powers of 1000)")


def size_bytes(text: str) -> int | None:
    """The bytes a size's text names (a number and an optional unit, see ACCEPTED); None if
    it is not a size. The one reading of sizes: the budget's and the command line's flags."""
    m = _SIZE.fullmatch(text)
    if m is None:
        return None
    number, unit = m.group(1), _UNITS[(m.group(2) or "").lower()]
    return int(number) * unit if "." not in number else math.floor(float(number) * unit)


def parse_bytes(value: int | str, what: str = "memory budget") -> int:
    """``value`` as a number of bytes > 0: an int, or a string of a number and a unit
    (see ACCEPTED). Raises ValueError naming the accepted forms."""
    if isinstance(value, bool) or not isinstance(value, (int, str, np.integer)):
        raise SettingError(f"{what} must be {ACCEPTED}; got {value!r}")
    if isinstance(value, str):
        n = size_bytes(value)
        if n is None:
            raise SettingError(f"{what} {value!r} is not a size: give {ACCEPTED}")
    else:
        n = int(value)
    if n <= 0:
        raise SettingError(f"{what} must be more than 0 bytes, got {value!r}: give {ACCEPTED}")
    return n


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# -- what one part takes ---------------------------------------------------------------------
def _index_bytes(spec: TableSpec, rows: int) -> int:
    """A tier's id -> slot index (tierstore.engine.hashindex.make_index): dense over the id space
    where that is at most 32 ids a slot, else a hash table at load <= 0.5 of int64 keys
    and values."""
    if spec.num_rows is not None and spec.num_rows <= 32 * rows:
        return 4 * spec.num_rows
    bits = max(4, (2 * max(rows, 1) - 1).bit_length())
    return (16 << bits) + 8 * PROBE_WINDOW  # and its probe offsets


def slot_bytes(spec: TableSpec) -> int:
    """A tier slot's tensors (tierstore.engine.tiers.CacheTier: weights in the table's dtype,
    float32 state, int64 id, use clock, step count, free-list entry and where LMDB had its row,
    a dirty byte) and its working buffers; its index entry is apart (_index_bytes)."""
    return spec.dim * DTYPES[spec.dtype].itemsize + 4 * spec.state_dim + 5 * 8 + 1 + WORK_BYTES_PER_SLOT


def tier_bytes(spec: TableSpec, rows: int) -> int:
    """Bytes of a cache tier (HBM, DDR or prefetch staging) of ``rows`` slots; 0 for none."""
    return 0 if rows <= 0 else rows * slot_bytes(spec) + _index_bytes(spec, rows)


def fit_rows(spec: TableSpec, nbytes: int) -> int:
    """The most slots (up to num_rows) whose tier takes at most ``nbytes``, or the end of
    the last run of such sizes below that: an index turning dense is a step up, so the
    bytes are not monotone in the rows; whatever is returned fits."""
    lo, hi = 0, (spec.num_rows if spec.num_rows is not None else max(nbytes, 0) // slot_bytes(spec)) + 1
    while hi - lo > 1:  # invariant: lo fits, hi does not (or is past num_rows)
        mid = (lo + hi) // 2
        if tier_bytes(spec, mid) <= nbytes:
            lo = mid
        else:
            hi = mid
    return lo


def queue_row_bytes(specs: Sequence[TableSpec]) -> int:
    """A row in the write-back queue: float32 values of the widest table and its index entries."""
    return max((4 * s.width for s in specs), default=0) + QUEUE_BYTES_PER_ROW


# -- the split -------------------------------------------------------------------------------
@dataclass
class MemoryPart:
    """One part of the store's memory: what it may hold (rows, bytes) and what it holds
    now (used_rows, used_bytes; None where the store cannot see it). ``host``: False for
    an HBM tier on a GPU, which is device memory, outside the budget."""
    rows: int
    bytes: int
    used_rows: int | None = None
    used_bytes: int | None = None
    host: bool = True


@dataclass
class MemorySplit:
    """split_memory's result, and (with the used figures and ``limit``) ``stats()["memory"]``."""
    budget: int | None
    parts: dict[str, MemoryPart]
    hbm_rows: dict[str, int]  # per table
    ddr_rows: dict[str, int]
    staged_rows: dict[str, int]
    writeback_rows: int
    txn_rows: int = WRITE_TXN_ROWS  # rows per LMDB write transaction at most (LmdbBackend.txn_rows)
    limit: "MemoryLimit | None" = None  # detected at open
    index_limits: dict[str, int] | None = None  # bytes each log table's index runs may hold (RowBackend.limit_index)
    held_index: dict[str, int] | None = None  # bytes of a dense index level each log table holds in memory (the same)

    @property
    def host_bytes(self) -> int:
        """What the store may hold in host memory, every part together."""
        return sum(p.bytes for p in self.parts.values() if p.host)

    def as_dict(self) -> dict:
        return {"budget": self.budget, "host_bytes": self.host_bytes,
                "limit": None if self.limit is None else {**asdict(self.limit), "bytes": self.limit.bytes},
                "parts": {name: asdict(p) for name, p in self.parts.items()}}


def _per_table(value: Sizes | None, specs: Sequence[TableSpec]) -> dict[str, int] | None:
    """{table: rows} as TieredStore reads hbm_rows/ddr_rows (a table a dict leaves out: 0);
    None stays None (left out)."""
    if value is None:
        return None
    return {s.name: int(value.get(s.name, 0)) if isinstance(value, Mapping) else int(value) for s in specs}


def _capped(rows: dict[str, int], specs: Sequence[TableSpec]) -> dict[str, int]:
    """A tier holds at most num_rows rows (TieredStore._make_table)."""
    return {s.name: min(rows[s.name], s.num_rows) if s.num_rows is not None else rows[s.name] for s in specs}


def _shared_out(specs: Sequence[TableSpec], nbytes: int) -> dict[str, int]:
    """Rows of each table's tier out of ``nbytes`` for all of them: shares in proportion to
    the tables' slot bytes, so that every table gets about the same rows; a table whose
    share would hold all its num_rows takes only those, and the others share the rest."""
    rows: dict[str, int] = {}
    todo = list(specs)
    while todo:
        total = sum(slot_bytes(s) for s in todo)
        whole = [s for s in todo if s.num_rows is not None and tier_bytes(s, s.num_rows) <= nbytes * slot_bytes(s) // total]
        if not whole:
            break
        for s in whole:
            rows[s.name] = s.num_rows
            nbytes -= tier_bytes(s, s.num_rows)
        todo = [s for s in todo if s.name not in rows]
    total = sum(slot_bytes(s) for s in todo)
    rows.update({s.name: fit_rows(s, nbytes * slot_bytes(s) // total) for s in todo})
    return rows


def rows_bytes(specs: Sequence[TableSpec]) -> int:
    """The bytes of the rows of the tables of bounded id spaces: what a page cache would need
    to keep them (direct reads, a held index and the page cache's share are decided by it)."""
    return sum(s.num_rows * s.row_bytes for s in specs if s.num_rows is not None)


def _index_share(budget: int | None, logged: Sequence[TableSpec], page_cache: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """(bytes, {table: runs limit}, {table: held bytes}) of the row index of the tables ``logged``. A table's index
    is its segments' entries (these grow with the rows written, about 60 bytes for a segment's
    hundreds of rows, and are not spilled: io.rowlog.segment_bytes_bound) and its runs, limited:
    under a budget to the table's share of B/16 (in proportion to its rows), or to all its rows
    could take where less (index_bytes_bound); the runs get half of the share at least, and
    where the entries take more than the other half the index is charged their bound and the
    runs' half (a 200M x 16 table of 64 KiB segments: 27.5 MiB of entries, 8 MiB of runs, under
    256 MiB), so that the store never holds more than it was given. Without a budget the runs
    may take UNBUDGETED_INDEX_BYTES a declared row (a dense map of the ids would take that much).
    What a table's mapped levels hold (a bit a page: io.rowlog.mapped_bytes_bound) counts in its
    runs' limit (RowIndex.limit), which keeps a quarter of it for the runs at least; a table past
    its share may besides hold its index stored dense in memory (_held_index)."""
    rows = max(sum(s.num_rows for s in logged), 1)
    index, limits, past = 0, {}, []
    for s in logged:
        runs = runs_bytes_bound(s.num_rows)
        full = index_bytes_bound(s.num_rows, s.row_bytes + (8 if s.ttl_steps is not None else 0))
        if budget is None:
            limits[s.name] = min(runs, UNBUDGETED_INDEX_BYTES * s.num_rows)
            index += full - runs + limits[s.name]
            continue
        share = budget // INDEX_SHARE * s.num_rows // rows
        if full <= share:
            index, limits[s.name] = index + full, runs
        else:
            entries = full - runs
            limits[s.name] = max(share - entries, share // 2, mapped_bytes_bound(s.num_rows) * 4 // 3)
            index += max(share, entries + limits[s.name])
            past.append(s)
    held = _held_index(budget, logged, past, page_cache)
    return index + sum(held.values()), limits, held


def _held_index(budget: int | None, logged: Sequence[TableSpec], past: Sequence[TableSpec], page_cache: int) -> dict[str, int]:
    """{table: bytes} of the log tables ``past`` their index share whose row index, stored
    dense, is held in memory (io.rowindex.Dense): under a budget whose page-cache share cannot
    keep the rows of the tables ``logged``, while their dense levels (4 bytes a declared row)
    take B/3 at most together. Mapped, a dense level
    shares the page cache with the write-back's pages and a lookup costs a disk read where
    its page was dropped: on the bench-scale table (34M rows, 136 MB dense, 0.5 GiB) a row
    fetched read 1.9 pages; held, at the cost of 40% of the DDR tier, 1.2, the DLRM step
    0.55x as long."""
    if not past or rows_bytes(logged) <= page_cache:  # no budget: none past
        return {}
    held, room = {}, budget // HELD_INDEX_SHARE
    for s in past:
        nbytes = dense_bytes(s.num_rows)
        if nbytes <= room:
            held[s.name], room = nbytes, room - nbytes
    return held


def _read_past(specs: Sequence[TableSpec], logged: Sequence[TableSpec], index_limits: Mapping[str, int],
               held_index: Mapping[str, int], page_cache: int) -> bool:
    """Whether a step's reads would pass the page cache by: every table in the log layout,
    their rows past the page cache's share (so a store reads them directly: io.direct), and
    no lookup in their row index reading a mapped level (each table's runs within its share,
    or its dense level held). The page cache then keeps LMDB's own pages, the pages the
    write-back writes and its collection reads, and the direct reads' buffers; the rows'
    pages it would have cached are better spent on the DDR tier, whose hits save reads."""
    if len(logged) != len(specs) or rows_bytes(logged) <= page_cache:
        return False
    return all(s.name in held_index or index_limits[s.name] >= runs_bytes_bound(s.num_rows) for s in logged)


def split_memory(budget: int | None, specs: Sequence[TableSpec], *, hbm_rows: Sizes | None = None,
                 ddr_rows: Sizes | None = None, staged_rows: Sizes | Mapping[str, int | None] | None = None,
                 writeback_rows: int | None = None, hbm_on_host: bool = True, writes: bool = True,
                 indexed_tables: Sequence[str] | None = None, direct_reads: bool | None = None) -> MemorySplit:
    """How a store of ``specs`` divides its host memory.

    The rule, for a budget B (bytes):
    - page_cache: B/4 is left to the page cache of data.mdb (LMDB reads through it; under a
      memory cgroup its pages count against the limit, and a cache squeezed to nothing makes
      every get a disk read), to the buffers of direct reads (io.direct: 2 MiB for each
      thread that reads, in place of the pages those reads would have cached), and to the
      pages of the log tables' mapped index levels and live-slot bits (io.liveslots); B/6
      where a step's reads would pass it by (_read_past; ``direct_reads=False`` keeps B/4);
    - row_index: where the log layout keeps where each row is (io.rowlog), for every table with
      num_rows (of the tables ``indexed_tables`` names, where given; a table of an unbounded id
      space, or of a store written before the log layout, keeps its rows by key): its segments'
      entries (a few bytes per segment of rows) and its runs (io.rowindex), at most B/16 for all
      tables (shared in proportion to their rows), or what their rows could take where less
      (io.rowlog.index_bytes_bound), and more where a table's segments' entries would take more
      than half of its share (the runs keep that half); runs past it are mapped from the index's file; and,
      where the page cache's share cannot keep the rows, a dense level of the index (4 bytes
      a declared row: io.rowindex.Dense) held in memory for each table whose runs could
      outgrow their share, while those take B/3 at most together (_held_index);
    - lmdb_dirty: B/16 for one write transaction's dirty pages, a 4 KiB page for each row it
      writes (the worst case: every row on its own page), so a transaction writes at most
      B/16 / 4 KiB rows (txn_rows; within MIN_TXN_ROWS..WRITE_TXN_ROWS); 0 for a readonly store;
    - of the rest R = B - page_cache - lmdb_dirty - row_index: R/8 to the write-back queue (writeback_rows
      rows of the widest table's float32 values, ids and bookkeeping), R/8 to prefetch staging,
      and what is left to the DDR tier; staging and the DDR tier are shared among the tables in
      proportion to their slot bytes (about the same rows each), each at most num_rows;
    - a size given explicitly (hbm_rows, ddr_rows, staged_rows, writeback_rows) is taken as
      given and comes out of the rest first; hbm_rows left out is 0 (the budget is host
      memory: an HBM tier on a GPU is device memory, give hbm_rows for one).
    Raises ValueError when the parts cannot fit: the figures, and what to change.

    Without a budget the parts are what the given sizes take, with today's defaults for the
    ones left out (no tiers, staging of ddr_rows, else hbm_rows, else 65536 rows, a queue of
    65536 rows) and nothing set aside for the page cache.
    """
    specs = list(specs)
    names = [s.name for s in specs]
    hbm, ddr = _per_table(hbm_rows, specs), _per_table(ddr_rows, specs)
    given_staged = dict(staged_rows) if isinstance(staged_rows, Mapping) else {n: staged_rows for n in names}
    qrow = queue_row_bytes(specs) if writes else 0
    txn_rows = WRITE_TXN_ROWS if budget is None else min(WRITE_TXN_ROWS, max(MIN_TXN_ROWS, budget // DIRTY_SHARE // PAGE))
    dirty = txn_rows * PAGE if writes else 0
    page_cache = 0 if budget is None else budget // PAGE_CACHE_SHARE
    logged = [s for s in specs if s.num_rows is not None and (indexed_tables is None or s.name in indexed_tables)]
    indexed = sum(s.num_rows for s in logged)
    index, index_limits, held_index = _index_share(budget, logged, page_cache)
    if budget is not None and direct_reads is not False and _read_past(specs, logged, index_limits, held_index, page_cache):
        page_cache = budget // READ_PAST_PAGE_CACHE_SHARE
    rest = 0 if budget is None else budget - page_cache - dirty - index
    if budget is not None and rest <= 0:
        need = ((dirty + index) * PAGE_CACHE_SHARE) // (PAGE_CACHE_SHARE - 1) + (1 << 20)
        raise SettingError(f"memory_budget={format_bytes(budget)} is too small: the share left to the page cache "
                         f"({format_bytes(page_cache)}), LMDB's dirty pages of one write transaction ({txn_rows:,} rows "
                         f"x 4 KiB = {format_bytes(dirty)}) and the row index ({indexed:,} rows: "
                         f"{format_bytes(index)}) alone take it; give at least {format_bytes(need)}")

    if writeback_rows is None:
        writeback_rows = DEFAULT_WRITEBACK_ROWS if budget is None else (rest // QUEUE_SHARE) // qrow if qrow else 0
    if hbm is None:
        hbm = dict.fromkeys(names, 0)
    staged: dict[str, int] = {}
    for s in specs:
        given = given_staged.get(s.name)
        if given is not None:
            staged[s.name] = int(given)
        elif budget is None:  # tierstore.engine.prefetch.Prefetcher's own default (not capped at num_rows)
            staged[s.name] = (ddr or {}).get(s.name) or hbm[s.name] or DEFAULT_STAGED_ROWS
    left = [s for s in specs if s.name not in staged]
    if left:
        staged.update(_shared_out(left, (rest // STAGING_SHARE) * sum(slot_bytes(s) for s in left) // sum(slot_bytes(s) for s in specs)))
    if ddr is None:
        if budget is None:
            ddr = dict.fromkeys(names, 0)
        else:
            held = _capped(hbm, specs)
            fixed = (writeback_rows * qrow + sum(tier_bytes(s, staged[s.name]) for s in specs)
                     + (sum(tier_bytes(s, held[s.name]) for s in specs) if hbm_on_host else 0))
            ddr = _shared_out(specs, max(rest - fixed, 0))
    hbm, ddr = _capped(hbm, specs), _capped(ddr, specs)

    by_name = {s.name: s for s in specs}

    def part(rows: dict[str, int], host: bool = True) -> MemoryPart:
        return MemoryPart(sum(rows.values()), sum(tier_bytes(by_name[n], r) for n, r in rows.items()), host=host)

    parts = {"hbm": part(hbm, hbm_on_host), "ddr": part(ddr), "staging": part(staged),
             "writeback": MemoryPart(writeback_rows, writeback_rows * qrow),
             "lmdb_dirty": MemoryPart(txn_rows if writes else 0, dirty),
             "row_index": MemoryPart(indexed, index),
             "page_cache": MemoryPart(0, page_cache)}
    split = MemorySplit(budget, parts, hbm, ddr, staged, writeback_rows, txn_rows, index_limits=index_limits,
                        held_index=held_index)
    if budget is not None and split.host_bytes > budget:
        given = ", ".join(f"{name} {format_bytes(p.bytes)}" for name, p in parts.items() if p.host and p.bytes)
        raise SettingError(f"memory_budget={format_bytes(budget)} cannot hold the sizes given: {given} take "
                         f"{format_bytes(split.host_bytes)}; give a larger memory_budget=, or leave ddr_rows=, "
                         "staged_rows= and writeback_rows= out so that the budget sizes them")
    return split


# -- the limit the store must fit under --------------------------------------------------------
@dataclass(frozen=True)
class MemoryLimit:
    """The memory this process may use: the machine's, and its memory cgroup's where one is set."""
    machine: int  # MemTotal
    cgroup: int | None = None  # the lowest limit of the process's memory cgroup and its ancestors; None: no limit set
    cgroup_file: str | None = None  # the file it was read from

    @property
    def bytes(self) -> int:
        return self.machine if self.cgroup is None else min(self.machine, self.cgroup)

    def describe(self) -> str:
        if self.cgroup is not None and self.cgroup < self.machine:
            return f"the memory cgroup's limit {format_bytes(self.cgroup)} ({self.cgroup_file})"
        return f"the machine's memory {format_bytes(self.machine)} (MemTotal)"


def machine_memory(meminfo: str | Path = "/proc/meminfo") -> int:
    """MemTotal in bytes (sysconf where there is no /proc/meminfo)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def process_rss(status: str | Path = "/proc/self/status") -> int:
    """The process's resident memory (VmRSS) in bytes; 0 where it cannot be read."""
    try:
        for line in Path(status).read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cgroup_memory_limit(proc_cgroup: str | Path = "/proc/self/cgroup",
                        root: str | Path = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes, file) of the lowest memory limit set on the process's cgroup or an ancestor,
    cgroup v1 (``memory.limit_in_bytes`` under ``root/memory``) or v2 (``memory.max`` under
    ``root``), or None where none is set ("max", v1's ~2**63) or there is no cgroup.
    A group path that is not under ``root`` (a container that sees the host's path) is
    read at ``root``'s own file, the container's group."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(root)
    found: list[tuple[int, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        here = base / path.strip("/")
        dirs = [here, *here.parents] if here.is_dir() else [base]
        for d in dirs:
            value = _read_limit(d / name)
            if value is not None:
                found.append((value, str(d / name)))
            if d == base:
                break
    return min(found) if found else None


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit() or int(text) >= _UNLIMITED:
        return None
    return int(text)


# glibc's malloc raises its mmap threshold (up to 32 MiB) each time a large block is freed, so
# a step's temporaries (index_select, cat, fetched rows: 0.1-30 MiB each) come to live in its
# arenas, one per thread, and stay there freed: at a 0.5 GiB budget with prefetch, 115-137 MiB
# held free by malloc (BENCHMARKS.md, "Memory held free by malloc"), a quarter of the budget outside
# every part of the split, and the kernel's OOM killer at close. A fixed threshold
# sends every block of this size or more to its own mapping, returned to the kernel when freed.
MMAP_THRESHOLD = 128 << 10
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_freed_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc's malloc give blocks of ``threshold`` bytes or more back to the kernel when
    freed (mallopt M_MMAP_THRESHOLD, process-wide; see MMAP_THRESHOLD). A store opened with a
    memory budget calls this: what malloc keeps freed is memory the budget cannot see. False
    where the C library is not glibc (nothing changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: other libcs' mallopt numbers differ
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1


def detect_limit(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup",
                 meminfo: str | Path = "/proc/meminfo") -> MemoryLimit:
    cgroup = cgroup_memory_limit(proc_cgroup, root)
    return MemoryLimit(machine_memory(meminfo), *(cgroup or (None, None)))


def check_fits(split: MemorySplit, limit: MemoryLimit, rss: int, what: str) -> None:
    """Raise ValueError when what the store may hold (the budget, or the host bytes of
    the sizes given) is more than ``limit`` leaves beside the ``rss`` the process holds."""
    need = split.budget if split.budget is not None else split.host_bytes
    room = limit.bytes - rss
    if need <= room:
        return
    fix = (f"pass memory_budget= of at most {format_bytes(max(room, 0))}" if split.budget is not None else
           f"give smaller ddr_rows=/hbm_rows= (or memory_budget= of at most {format_bytes(max(room, 0))}, which sizes them)")
    parts = ", ".join(f"{name} {format_bytes(p.bytes)}" for name, p in split.parts.items() if p.host and p.bytes)
    raise SettingError(f"{what} needs {format_bytes(need)} ({parts}), but {limit.describe()} less the "
                     f"{format_bytes(rss)} this process already holds (RSS) leaves {format_bytes(max(room, 0))}; "
                     f"{fix}, or raise the memory limit")
