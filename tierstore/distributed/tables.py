"""What ShardedEmbeddingBagCollection knows of each table (its plan, this rank's shard, the
columns a shard holds) and of each forward (kept for its backward)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tierstore.optim import RowOptimizer
from tierstore.spec import TableSpec
from tierstore.training.bags import Bags
from tierstore.training.sharding import TablePlan


@dataclass
class _Table:
    spec: TableSpec  # the whole table, state_dim set for the optimizer
    tplan: TablePlan
    mine: int | None  # index of this rank's shard, if it has one
    layout: tuple[int, int]
    coupled: bool  # column shards exchange whole-row gradients

    @property
    def column(self) -> bool:
        return self.tplan.sharding == "column"

    def rank_of(self, k: int) -> int:
        return self.tplan.shards[k].rank

    def masks(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Per shard, which of ``ids`` it holds."""
        if self.column:
            return [torch.ones(len(ids), dtype=torch.bool)] * len(self.tplan.shards)
        owner = self.tplan.owner(ids) if len(ids) else torch.zeros(0, dtype=torch.int64)
        return [owner == k for k in range(len(self.tplan.shards))]

    def cols(self, k: int, with_state: bool) -> torch.Tensor:
        """Columns of the whole row (weights, then state) that shard k's stored row holds."""
        s, dim = self.tplan.shards[k], self.spec.dim
        own = torch.arange(s.col_start, s.col_stop)
        if not with_state:
            return own
        a, b = self.layout
        return torch.cat([own, *(dim * (j + 1) + own for j in range(a)), dim * (a + 1) + torch.arange(b)])

    def grad_cols(self, k: int) -> torch.Tensor:
        return torch.arange(self.spec.dim) if self.coupled else self.cols(k, False)

    def shard_spec(self, k: int, optimizer: RowOptimizer | None) -> TableSpec:
        s = self.tplan.shards[k]
        return dataclasses.replace(self.spec, dim=s.dim, state_dim=optimizer.state_dim(s.dim) if optimizer else 0,
                                   init=dataclasses.replace(self.spec.init, col_start=s.col_start))


@dataclass
class _Step:
    """One forward's local bags and the table's ids on every rank, kept for backward."""

    names: list[str]  # tables of the batch, in the features' order
    bags: dict[str, Bags]
    psw: dict[str, torch.Tensor | None]  # per used entry
    segs: dict[str, list[torch.Tensor]]  # per table of the plan: the used ids each rank sent this rank's shard
    psw_from: dict[str, list[bool]]  # per table: which ranks send per-sample weights
    weights: dict[str, torch.Tensor]  # rows each bag was pooled from
    number: int  # which forward of the module (the same on every rank)
    partial: set[str]  # row-sharded tables whose owners got only their own ids (sorted stably)

