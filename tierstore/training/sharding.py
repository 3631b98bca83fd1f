"""Sharding plans: which rank holds which rows and columns of every table.

Plain data (no torch.distributed, no store): a plan is made by
``tierstore.distributed.plan``, saved and loaded as JSON, compared across
ranks and read by ``ShardedEmbeddingBagCollection``.

- ``"table"``: one shard, the whole table, on one rank.
- ``"row"``: shards own disjoint row ranges ``[row_start, row_stop)`` covering
  ``[0, num_rows)``; an unbounded table (``num_rows=None``) is split by hash
  instead: shard ``k`` of ``n`` owns the ids with ``row_hash(id) % n == k``
  (every shard then has ``row_start = row_stop = None``).
- ``"column"``: shards own disjoint column ranges ``[col_start, col_stop)``
  covering ``[0, dim)``, every row on every shard.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from tierstore.errors import TierstoreError

SHARDING_TYPES = ("table", "row", "column")


class PlanMismatchError(ValueError, TierstoreError):
    """A plan does not fit the tables, or differs between ranks."""


class RankFailedError(RuntimeError, TierstoreError):
    """Another rank failed this collective step (named in the message), the ranks
    called different collectives (each rank's call named), or the collective itself
    failed: a rank died or did not answer within the timeout. (tierstore.distributed's
    sharded collection; tierstore.torchrec's DMP shards)"""


@dataclass(frozen=True)
class Shard:
    rank: int
    row_start: int | None
    row_stop: int | None
    col_start: int
    col_stop: int

    @property
    def dim(self) -> int:
        return self.col_stop - self.col_start


@dataclass(frozen=True)
class TablePlan:
    table: str
    sharding: str
    shards: tuple[Shard, ...]

    def __post_init__(self):
        if self.sharding not in SHARDING_TYPES:
            raise PlanMismatchError(f"table {self.table!r}: sharding must be one of {SHARDING_TYPES}, got {self.sharding!r}")
        if not self.shards:
            raise PlanMismatchError(f"table {self.table!r}: a plan needs at least one shard")
        if self.sharding == "table" and len(self.shards) != 1:
            raise PlanMismatchError(f"table {self.table!r}: table sharding has one shard, got {len(self.shards)}")

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.shards)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """Index into ``shards`` of the shard owning each id (row and table sharding)."""
        if self.sharding != "row":
            return torch.zeros(len(ids), dtype=torch.int64)
        if self.shards[0].row_start is None:
            return row_hash(ids) % len(self.shards)
        starts = torch.tensor([s.row_start for s in self.shards], dtype=torch.int64)
        order = torch.argsort(starts)
        return order[torch.searchsorted(starts[order], ids.to(torch.int64), right=True) - 1]


@dataclass(frozen=True)
class ShardingPlan:
    """Every table's sharding and shards, plus the planner's per-rank prediction.

    ``predicted`` holds one dict per rank (e.g. ``lookups_per_step``,
    ``ssd_reads_per_step``, ``bytes``); it is informative and not compared
    across ranks.
    """

    world_size: int
    tables: dict[str, TablePlan]
    predicted: tuple[dict, ...] = field(default=(), compare=False)

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise PlanMismatchError(f"world_size must be a positive int, got {self.world_size!r}")
        for tp in self.tables.values():
            for s in tp.shards:
                if not 0 <= s.rank < self.world_size:
                    raise PlanMismatchError(f"table {tp.table!r}: shard on rank {s.rank}, outside world size {self.world_size}")

    def check(self, specs) -> None:
        """Raise PlanMismatchError unless the shards exactly cover every table in ``specs``."""
        specs = {s.name: s for s in specs}
        if set(specs) != set(self.tables):
            missing, extra = sorted(set(specs) - set(self.tables)), sorted(set(self.tables) - set(specs))
            raise PlanMismatchError(f"plan and tables differ: tables without a plan {missing}, planned tables not given {extra}")
        for name, tp in self.tables.items():
            spec = specs[name]
            cols = sorted((s.col_start, s.col_stop) for s in tp.shards)
            if tp.sharding == "column":
                _check_cover(name, "columns", cols, spec.dim)
            elif cols != [(0, spec.dim)] * len(tp.shards):
                raise PlanMismatchError(f"table {name!r}: {tp.sharding} shards hold every column [0, {spec.dim}), got {cols}")
            by_range = tp.sharding == "row" and spec.num_rows is not None
            if by_range:
                _check_cover(name, "rows", sorted((s.row_start, s.row_stop) for s in tp.shards), spec.num_rows)
            elif any(s.row_start is not None or s.row_stop is not None for s in tp.shards):
                how = "split by hash" if tp.sharding == "row" else "hold every row"
                raise PlanMismatchError(f"table {name!r}: its {tp.sharding} shards {how} (row_start = row_stop = None)")

    def ranks_of(self, table: str) -> tuple[int, ...]:
        return self.tables[table].ranks

    def to_json(self) -> str:
        return json.dumps({"world_size": self.world_size,
                           "tables": [asdict(tp) for tp in self.tables.values()],
                           "predicted": list(self.predicted)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        try:
            d = json.loads(text)
            tables = {t["table"]: TablePlan(t["table"], t["sharding"], tuple(Shard(**s) for s in t["shards"]))
                      for t in d["tables"]}
            return cls(d["world_size"], tables, tuple(d.get("predicted", ())))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise PlanMismatchError(f"not a sharding plan ({e}); write one with tierstore plan ... --json") from None

    def __str__(self) -> str:
        lines = [f"{'table':<24} {'sharding':<8} {'rank':>4} {'rows':>23} {'cols':>11}"]
        for tp in self.tables.values():
            for s in tp.shards:
                rows = "hash" if tp.sharding == "row" and s.row_start is None else \
                    "all" if s.row_start is None else f"[{s.row_start}, {s.row_stop})"
                lines.append(f"{tp.table:<24} {tp.sharding:<8} {s.rank:>4} {rows:>23} {f'[{s.col_start}, {s.col_stop})':>11}")
        return "\n".join(lines + _prediction_lines(self.predicted))


def row_hash(ids: torch.Tensor) -> torch.Tensor:
    """A fixed 64-bit mix of each id, non-negative, for splitting unbounded tables by hash.

    Fixed across processes and versions: a checkpoint's rows land on the same
    shards whenever the plan has the same number of row shards.
    """
    x = ids.to(torch.int64).numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return torch.from_numpy((x >> np.uint64(1)).view(np.int64))


def _check_cover(table: str, what: str, ranges: list, total: int) -> None:
    at = 0
    for start, stop in ranges:
        if start != at or stop <= start:
            raise PlanMismatchError(f"table {table!r}: shard {what} {ranges} must cover [0, {total}) without gaps or overlaps")
        at = stop
    if at != total:
        raise PlanMismatchError(f"table {table!r}: shard {what} {ranges} must cover [0, {total}) without gaps or overlaps")


def _prediction_lines(predicted: tuple[dict, ...]) -> list[str]:
    """The per-rank prediction as a table of its numbers (nested values, such as
    each shard's tier rows, are left to the JSON)."""
    keys = [k for k in dict.fromkeys(k for p in predicted for k in p) if all(isinstance(p.get(k, 0), (int, float)) for p in predicted)]
    if not keys:
        return []
    width = [max(len(k), 10) for k in keys]
    out = ["", "predicted per rank:", f"{'rank':>4} " + " ".join(f"{k:>{w}}" for k, w in zip(keys, width))]
    for r, p in enumerate(predicted):
        cells = [f"{p[k]:>{w},.1f}" if isinstance(p.get(k), float) else f"{p.get(k, ''):>{w},}" if k in p else " " * w
                 for k, w in zip(keys, width)]
        out.append(f"{r:>4} " + " ".join(cells))
    return out
