"""The sharding planner: which rank holds which rows and columns of every table.

``plan(tables, world_size, ...)`` balances three loads per rank: lookups per
step, SSD reads per step and bytes of rows held. Every item (a whole table or
one shard) is measured once, then placed; the strategy is greedy and
explainable:

1. Each table's share of the cluster's lookups, SSD reads and bytes. A table
   over ``1 / world_size`` of any of them (it alone would overload a rank) is
   split across all ranks: by row ranges (even ranges; by hash when
   ``num_rows=None``), or by columns when its lookups are what it is over,
   it is wide (``dim >= 2 * world_size``) and an even row split would still
   put more than ``COLUMN_SKEW`` x the mean lookups on one range. Unbounded
   tables are always hash-split (their size is unknown up front).
2. The rest go whole, largest load first, each to the rank where the largest
   of its normalised loads (load / cluster mean per rank) ends up smallest.
3. While a rank is over ``SPLIT_ABOVE`` x the mean in any load, its whole table
   carrying most of that load is split as in 1, and the tables are placed again.

With a trace (``tierstore.trace.Trace``; each call one step's global batch of a
table) the loads come from the capacity tools: lookups per step are unique ids
per call; SSD reads per step are the LRU misses at the tier sizes a rank gives
each item, for the sharded module's reads: each call's ids sorted and unique,
read twice a step (``READS_PER_STEP``). No scaling approximation is needed for
row shards: the trace is split into each shard's own sub-trace (the ids it
owns, call by call) and the sub-trace's exact LRU curve is computed, so a
shard's lookups and misses are what a store holding only that shard counts
under LRU (rows written but not yet committed, which the store's write-back
queue serves, are counted as SSD reads). ``exchange_bytes`` predicts the bytes
each rank sends per step under the module's protocol.
A column shard sees every id of its table (the table's curve) with narrower
rows. Each rank's ``hbm_bytes`` and ``ddr_bytes`` are split among the items it
holds as ``tierstore capacity --hbm-bytes/--ddr-bytes`` splits one store's
(``split_budget``: most hits for the bytes), HBM first and DDR on top. While
placing, an item's SSD reads are taken at its share of the whole cluster's
budget (the same split over every item with ``world_size`` times the bytes);
the prediction is recomputed per rank once placed. Other policies (LFU,
lookahead) are predicted as LRU.

Without a trace only bytes are balanced (rows x bytes per row, optimizer state
included when ``optimizer`` is given); lookups and SSD reads are not predicted.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tierstore.capacity.budget import split_budget
from tierstore.capacity.curves import LruCurve, lru_curves
from tierstore.trace import Trace, TraceTable, gather_ranges

from tierstore.precision import DTYPES
from tierstore.training.bags import sort_is_stable
from tierstore.training.sharding import SHARDING_TYPES, Shard, ShardingPlan, TablePlan
from tierstore.spec import TableSpec
from tierstore.validate import check_int
from tierstore.errors import ArgumentTypeError, SettingError, UnknownTableError

SPLIT_ABOVE = 1.25  # a rank's load over the mean per rank above which its largest whole table is split
COLUMN_SKEW = 1.5  # max / mean lookups of an even row split above which a wide, hot table is split by columns
LOADS = ("lookups_per_step", "ssd_reads_per_step", "bytes")
# ShardedEmbeddingBagCollection reads a step's rows twice from its store: the forward's
# fetch and the backward's update (read, step, write); the second read hits unless the
# shard's tiers cannot hold the step's rows, so SSD reads are predicted for both
READS_PER_STEP = 2


@dataclass(frozen=True)
class PlanConfig:
    """What ``plan`` is asked (validated)."""

    tables: tuple[TableSpec, ...]
    world_size: int
    trace: Trace | None = None
    hbm_bytes: int | None = None  # per rank
    ddr_bytes: int | None = None  # per rank
    batch_size: int | None = None
    sharding: Mapping[str, str] = field(default_factory=dict)
    optimizer: object | None = None  # a tierstore.optim.RowOptimizer: its state counts in a row's bytes

    def __post_init__(self):
        tables = tuple(self.tables)
        object.__setattr__(self, "tables", tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ArgumentTypeError("plan() needs a non-empty list of tierstore.TableSpec")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise SettingError(f"plan() got duplicate table names: {names}")
        check_int(self.world_size, "world_size", at_least=1, meaning="the number of ranks")
        if self.trace is not None and not isinstance(self.trace, Trace):
            raise ArgumentTypeError(f"trace must be a tierstore.trace.Trace (Trace.load(path)), got {type(self.trace).__name__}")
        for name in ("hbm_bytes", "ddr_bytes"):
            check_int(getattr(self, name), name, none=True)
        check_int(self.batch_size, "batch_size", at_least=1, none=True, meaning="samples per step on each rank")
        unknown = sorted(set(self.sharding) - set(names))
        if unknown:
            raise UnknownTableError(f"sharding names tables {unknown} that are not planned; the tables are {names}")
        bad = {k: v for k, v in self.sharding.items() if v not in SHARDING_TYPES}
        if bad:
            raise SettingError(f"sharding types must be one of {SHARDING_TYPES}, got {bad}")
        if self.hbm_bytes is not None or self.ddr_bytes is not None:
            smallest = min(tables, key=self.row_bytes)
            need = self.row_bytes(smallest)
            have = (self.hbm_bytes or 0) + (self.ddr_bytes or 0)
            if have < need:
                raise SettingError(f"hbm_bytes + ddr_bytes = {have} per rank cannot hold one row (the smallest, of table "
                                 f"{smallest.name!r}, needs {need} bytes); give at least {need}, or leave both out to plan by sizes alone")

    def row_bytes(self, spec: TableSpec) -> int:
        state = spec.state_dim
        if self.optimizer is not None:
            state = max(state, int(self.optimizer.state_dim(spec.dim)))
        return spec.dim * DTYPES[spec.dtype].itemsize + 4 * state


@dataclass
class _Item:
    """A whole table or one shard, with its loads."""

    table: str
    shard: Shard
    row_bytes: int
    rows: int  # rows it holds (the trace's working set for an unbounded table, 0 if unknown)
    curve: LruCurve | None = None
    lookups: float = 0.0
    steps: int = 1
    ssd: float = 0.0
    hbm_rows: int = 0
    ddr_rows: int = 0

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes

    def loads(self) -> np.ndarray:
        return np.array([self.lookups, self.ssd, self.bytes], dtype=np.float64)


def plan(tables: Sequence[TableSpec], world_size: int, trace: Trace | None = None, hbm_bytes: int | None = None,
         ddr_bytes: int | None = None, batch_size: int | None = None, sharding: Mapping[str, str] | None = None,
         optimizer=None) -> ShardingPlan:
    """A sharding plan for ``tables`` on ``world_size`` ranks (see the module docstring).

    ``hbm_bytes``/``ddr_bytes``: each rank's tier budgets (for the SSD reads a
    trace predicts, and each shard's tier rows in ``predicted``). ``sharding``:
    ``{table: "table" | "row" | "column"}`` forces a table's type.
    ``batch_size`` is recorded in the prediction (samples per rank per step).
    The same input gives the same plan.
    """
    cfg = PlanConfig(tuple(tables), world_size, trace, hbm_bytes, ddr_bytes, batch_size, dict(sharding or {}), optimizer)
    n = cfg.world_size
    specs = {t.name: t for t in cfg.tables}
    whole = dict(zip(specs, _items(cfg, [TablePlan(t.name, "table", (Shard(0, None, None, 0, t.dim),)) for t in cfg.tables])))
    if cfg.trace is not None:  # SSD reads at a fair share of the cluster's cache
        _give_cache(list(whole.values()), n * (cfg.hbm_bytes or 0), n * (cfg.ddr_bytes or 0))
    total = sum((it.loads() for it in whole.values()), np.zeros(len(LOADS)))
    share = {name: it.loads() / np.where(total > 0, total, np.inf) for name, it in whole.items()}
    kinds = {name: _choose(cfg, specs[name], share[name]) for name in specs}
    shards: dict[str, list[_Item]] = {}  # the split tables' items, measured once
    while True:  # a loop per table split for balance, at most one per table
        for name in specs:
            if kinds[name] != "table" and name not in shards:
                shards[name] = _items(cfg, [_split(cfg, specs[name], kinds[name])])
        placed, normalised = _place(cfg, [whole[t] for t in specs if kinds[t] == "table"],
                                    [it for t in specs if kinds[t] != "table" for it in shards[t]])
        worst = int(np.argmax(normalised.max(1)))
        movable = [it for it in placed[worst] if kinds[it.table] == "table" and it.table not in cfg.sharding]
        if normalised.max() <= SPLIT_ABOVE or not movable or n == 1:
            break
        # the worst rank is over in one load: split its whole table that carries most of it
        dim = int(np.argmax(normalised[worst]))
        name = max(movable, key=lambda it: (it.loads()[dim], it.table)).table
        kinds[name] = _split_kind(cfg, specs[name], share[name])
    table_plans = {}
    for t in cfg.tables:
        shards = sorted((it.shard for p in placed for it in p if it.table == t.name), key=lambda s: (s.rank, s.col_start))
        table_plans[t.name] = TablePlan(t.name, kinds[t.name], tuple(shards))
    sent = _sent(cfg, table_plans)
    result = ShardingPlan(n, table_plans, tuple(_predict(cfg, p, sent) for p in placed))
    result.check(cfg.tables)
    return result


def predict(sharding_plan: ShardingPlan, tables: Sequence[TableSpec], trace: Trace | None = None,
            hbm_bytes: int | None = None, ddr_bytes: int | None = None, batch_size: int | None = None,
            optimizer=None) -> tuple[dict, ...]:
    """``plan``'s prediction per rank for any plan of these tables (one made by hand,
    or round-robin to compare with)."""
    sharding_plan.check(tables)
    cfg = PlanConfig(tuple(tables), sharding_plan.world_size, trace, hbm_bytes, ddr_bytes, batch_size, {}, optimizer)
    items = _items(cfg, list(sharding_plan.tables.values()))
    sent = _sent(cfg, sharding_plan.tables)
    return tuple(_predict(cfg, [it for it in items if it.shard.rank == r], sent) for r in range(cfg.world_size))


# -- choosing and splitting --------------------------------------------------------------------------
def _place(cfg: PlanConfig, whole: list[_Item], split: list[_Item]) -> tuple[list[list[_Item]], np.ndarray]:
    """Split tables' shards stay on their ranks; whole tables go, largest normalised load
    first, where their largest normalised load ends smallest. The items on each rank,
    and each rank's loads divided by the cluster's mean per rank."""
    n = cfg.world_size
    if cfg.trace is not None:
        _give_cache(whole + split, n * (cfg.hbm_bytes or 0), n * (cfg.ddr_bytes or 0))
    placed: list[list[_Item]] = [[] for _ in range(n)]
    for it in split:  # one shard per rank, shard k on rank k
        placed[it.shard.rank].append(it)
    mean = sum((it.loads() for it in whole + split), np.zeros(len(LOADS))) / n
    scale = np.where(mean > 0, 1 / np.where(mean > 0, mean, 1), 0.0)
    rank_load = [sum((it.loads() for it in p), np.zeros(len(LOADS))) for p in placed]
    for it in sorted(whole, key=lambda it: (-float((it.loads() * scale).max()), it.table)):  # a loop per table
        after = [float(((rank_load[r] + it.loads()) * scale).max()) for r in range(n)]
        r = min(range(n), key=lambda r: (after[r], float((rank_load[r] * scale).sum()), r))
        it.shard = replace(it.shard, rank=r)
        placed[r].append(it)
        rank_load[r] += it.loads()
    return placed, np.array(rank_load) * scale


def _choose(cfg: PlanConfig, spec: TableSpec, share: np.ndarray) -> str:
    """The table's sharding type, from its share of the cluster's lookups, SSD reads and bytes."""
    forced = cfg.sharding.get(spec.name)
    if forced:
        return forced
    n = cfg.world_size
    if n == 1:
        return "table"
    if spec.num_rows is None:
        return "row"
    if not (share > 1 / n).any():
        return "table"
    return _split_kind(cfg, spec, share)


def _split_kind(cfg: PlanConfig, spec: TableSpec, share: np.ndarray) -> str:
    n = cfg.world_size
    lookups_over = share[0] > 1 / n and share[0] >= share.max()
    if lookups_over and spec.dim >= 2 * n and cfg.trace is not None and _range_skew(cfg.trace, spec, n) > COLUMN_SKEW:
        return "column"
    return "row"


def _range_skew(trace: Trace, spec: TableSpec, n: int) -> float:
    """Max / mean ids per range of an even row split."""
    ids, _, _ = _table_calls(trace, spec)
    if not len(ids):
        return 1.0
    counts = np.bincount(ids * n // spec.num_rows, minlength=n)
    return float(counts.max() / counts.mean())


def _split(cfg: PlanConfig, spec: TableSpec, kind: str) -> TablePlan:
    """One shard per rank (as many as the table has rows or columns), shard k on rank k:
    even row ranges, a hash split for an unbounded table, or even column ranges."""
    n = cfg.world_size
    if kind == "table":
        return TablePlan(spec.name, kind, (Shard(0, None, None, 0, spec.dim),))
    if kind == "column":
        m = min(n, spec.dim)
        return TablePlan(spec.name, kind, tuple(Shard(k, None, None, k * spec.dim // m, (k + 1) * spec.dim // m) for k in range(m)))
    if spec.num_rows is None:
        return TablePlan(spec.name, kind, tuple(Shard(k, None, None, 0, spec.dim) for k in range(n)))
    m = min(n, spec.num_rows)
    return TablePlan(spec.name, kind, tuple(Shard(k, k * spec.num_rows // m, (k + 1) * spec.num_rows // m, 0, spec.dim) for k in range(m)))


def _items(cfg: PlanConfig, table_plans: Sequence[TablePlan]) -> list[_Item]:
    """An item per shard, measured on the trace (when there is one) in one pass."""
    specs = {t.name: t for t in cfg.tables}
    items, parts = [], []
    for tp in table_plans:  # a loop per table
        spec = specs[tp.table]
        for s in tp.shards:
            rows = s.row_stop - s.row_start if s.row_start is not None else spec.num_rows or 0  # 0: from the trace
            # a column shard holds its share of the weights and of the optimizer state
            items.append(_Item(tp.table, s, math.ceil(cfg.row_bytes(spec) * s.dim / spec.dim), rows))
        if cfg.trace is not None:
            ids, offsets, calls = _table_calls(cfg.trace, spec)
            if tp.sharding == "column":  # every shard looks up every id
                parts += [(ids, offsets, calls)] * len(tp.shards)
                continue
            who = tp.owner(torch.from_numpy(ids)).numpy()
            for k in range(len(tp.shards)):  # a loop per shard: the ids it owns, call by call
                keep = who == k
                parts.append((ids[keep], np.concatenate([[0], np.cumsum(keep)])[offsets], calls))
    if cfg.trace is not None:
        _measure(cfg.trace, items, parts)
    return items


def _table_calls(trace: Trace, spec: TableSpec):
    try:
        return trace.table_calls(trace.table_index(spec.name))
    except KeyError:  # not in the trace: no lookups
        return np.empty(0, dtype=np.int64), np.zeros(1, dtype=np.int64), np.empty(0, dtype=np.int64)


# -- loads from a trace -------------------------------------------------------------------------------
def _measure(trace: Trace, items: list[_Item], parts: list) -> None:
    """Exact LRU curves of the items' calls (each part: ids, offsets, global call numbers),
    from one trace whose tables are the items, calls in the original trace's order."""
    if not items:
        return
    base = np.cumsum([0] + [len(ids) for ids, _, _ in parts])
    starts = np.concatenate([off[:-1] + b for (_, off, _), b in zip(parts, base)])
    lengths = np.concatenate([np.diff(off) for _, off, _ in parts])
    calls = np.concatenate([c for _, _, c in parts])
    item = np.concatenate([np.full(len(c), i, dtype=np.int32) for i, (_, _, c) in enumerate(parts)])
    order = np.lexsort((item, calls))  # by trace call, then item: a split call's shards in shard order
    order = np.repeat(order, READS_PER_STEP)
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths[order], out=offsets[1:])
    ids = gather_ranges(np.concatenate([ids for ids, _, _ in parts]), starts[order], lengths[order])
    # the module reads each call's rows as sorted unique ids: the order ties are broken in
    ids = ids[np.lexsort((ids, np.repeat(np.arange(len(order)), lengths[order])))]
    names = [str(i) for i in range(len(items))]
    sub = Trace(tuple(TraceTable(nm) for nm in names), ids, offsets, item[order], trace.call_step[calls[order]])
    steps = max(trace.n_steps, 1)
    for it, curve in zip(items, lru_curves(sub, names)):
        it.curve = curve
        it.lookups = curve.n_uses / READS_PER_STEP / steps
        it.steps = steps
        if it.rows == 0:
            it.rows = int(curve.working_set)


def _give_cache(items: list[_Item], hbm_bytes: int, ddr_bytes: int) -> None:
    """Split the bytes among the items for the most hits (LRU), HBM first, and set their SSD reads."""
    measured = [it for it in items if it.curve is not None]
    curves, rb = [it.curve for it in measured], [it.row_bytes for it in measured]
    h = split_budget(curves, rb, hbm_bytes)
    d = split_budget(curves, rb, ddr_bytes, start=h)
    for it, hi, di in zip(measured, h, d):
        it.hbm_rows, it.ddr_rows = int(hi), int(di)
        it.ssd = float(it.curve.tiers(hi, di)["misses"]) / it.steps


def _give_bytes(items: list[_Item], hbm_bytes: int, ddr_bytes: int) -> None:
    """Without a trace: the budgets split in proportion to the items' bytes, no tier larger than its rows."""
    total = sum(it.bytes for it in items)
    for it in items:
        share = it.bytes / total if total else 0.0
        it.hbm_rows = min(it.rows, int(hbm_bytes * share // it.row_bytes))
        it.ddr_rows = min(it.rows - it.hbm_rows, int(ddr_bytes * share // it.row_bytes))


def _sent(cfg: PlanConfig, table_plans: Mapping[str, TablePlan]) -> np.ndarray | None:
    """Bytes each rank sends a step (exchange_bytes), once for all ranks; None without a trace."""
    return None if cfg.trace is None else exchange_bytes(cfg, table_plans)


def _predict(cfg: PlanConfig, items: list[_Item], sent: np.ndarray | None) -> dict:
    order = {t.name: i for i, t in enumerate(cfg.tables)}
    items = sorted(items, key=lambda it: (order[it.table], it.shard.col_start))  # the same sums, however placed
    if cfg.trace is not None:
        _give_cache(items, cfg.hbm_bytes or 0, cfg.ddr_bytes or 0)
    else:
        _give_bytes(items, cfg.hbm_bytes or 0, cfg.ddr_bytes or 0)
    out = {"shards": len(items), "bytes": int(sum(it.bytes for it in items)),
           "hbm_rows": int(sum(it.hbm_rows for it in items)), "ddr_rows": int(sum(it.ddr_rows for it in items))}
    if cfg.trace is not None:
        out["lookups_per_step"] = float(sum(it.lookups for it in items))
        out["ssd_reads_per_step"] = float(sum(it.ssd for it in items))
        if items:
            out["exchange_bytes_per_step"] = float(sent[items[0].shard.rank])
    if cfg.batch_size is not None:
        out["batch_size"] = cfg.batch_size
    out["tiers"] = {it.table: [it.hbm_rows, it.ddr_rows] for it in items}
    return out


# -- what the ranks exchange ------------------------------------------------------------------------------
def exchange_bytes(cfg: PlanConfig, table_plans: Mapping[str, TablePlan]) -> np.ndarray:
    """Bytes each rank sends to the others per training step under ShardedEmbeddingBagCollection's
    protocol (float32 exchange), when each call of the trace is a step's global batch
    split into ``world_size`` contiguous equal parts, part r being rank r's local batch:

    - forward: the call's header (6 x 8 bytes); the sizes (3 x 8 bytes a table) to every
      other rank; each id (8 bytes) to the ranks holding the shard that holds its row
      (every shard of a column-sharded table; every shard of a row-sharded one too where
      torch.sort orders the step's ids of the table unstably, ``sort_is_stable``); the
      owners' header after reading their rows; each owner sends each rank the rows it
      asked for (unique ids per rank and table) that its shard holds, its shard's columns;
    - backward: its header, then each rank sends every occurrence's gradient (one per id, not per
      unique id) to the shards holding the row: their columns, or the whole row
      for a column shard under a row-coupled optimizer, RowWiseAdagrad (per-sample weights, 4 bytes an id, are
      not counted).

    Steps of the trace are the unit, as in the module (a step's sizes cover every table)."""
    n, trace = cfg.world_size, cfg.trace
    sent = np.zeros(n, dtype=np.float64)
    if n == 1 or trace is None:
        return sent
    for spec in cfg.tables:  # a loop per table
        tp = table_plans[spec.name]
        ids, offsets, calls = _table_calls(trace, spec)
        if not len(ids):
            continue
        lengths = np.diff(offsets)
        call = np.repeat(np.arange(len(calls)), lengths)
        part = (np.arange(len(ids)) - offsets[call]) * n // lengths[call]  # the rank whose local batch holds the id
        # unique ids per (call, part): the rows a rank asks for
        order = np.lexsort((ids, part, call))
        first = np.ones(len(ids), dtype=bool)
        first[1:] = (np.diff(ids[order]) != 0) | (np.diff(part[order]) != 0) | (np.diff(call[order]) != 0)
        uniq = order[first]
        who = tp.owner(torch.from_numpy(ids)).numpy() if tp.sharding != "column" else None
        unstable = np.array([not sort_is_stable(int(m)) for m in lengths])  # a loop per call
        whole = unstable[call] if tp.sharding == "row" and len(tp.shards) > 1 else np.zeros(len(ids), dtype=bool)
        for k, shard in enumerate(tp.shards):  # a loop per shard
            own = np.ones(len(ids), dtype=bool) if who is None else who == k
            whole_row = tp.sharding == "column" and getattr(cfg.optimizer, "row_coupled", False)
            grad_cols = spec.dim if whole_row else shard.dim
            asked = np.bincount(part[uniq][own[uniq]], minlength=n)  # rows this shard serves to each rank
            sent[shard.rank] += 4 * shard.dim * (asked.sum() - asked[shard.rank])
            occurrences = np.bincount(part[own], minlength=n)  # gradients each rank sends this shard
            occurrences[shard.rank] = 0
            sent += 4 * grad_cols * occurrences
            to_shard = np.bincount(part[own | whole], minlength=n)  # ids each rank sends this shard
            to_shard[shard.rank] = 0
            sent += 8 * to_shard
    steps = max(trace.n_steps, 1)
    # each step: three call headers (forward, the owners' ok, backward) and the sizes
    return sent / steps + (n - 1) * 8 * (3 * 6 + 3 * len(cfg.tables))
