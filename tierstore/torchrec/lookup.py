"""The lookup of a rank's tierstore shards, in TorchRec's sharded EmbeddingBagCollection.

TorchRec's ``ShardedEmbeddingBagCollection`` runs, per sharding type, an input
dist (ids to the ranks that own them), a lookup (the rank's shards pool their
bags) and an output dist (pooled embeddings back to the ranks that asked, the
backward dividing gradients by the world size). ``ShardLookup`` is that middle
step over tierstore stores, in place of TorchRec's ``GroupedPooledEmbeddingsLookup``
over FBGEMM's TBEs: the same input (a KeyedJaggedTensor of the rank's features,
grouped as TorchRec groups its tables) and the same output ([batch, the
features' dims side by side]).

Each shard is a ``TieredEmbeddingBag`` over a table of a store under
``path/rank-<r>``: the shard's columns of the table's rows, keyed by the
table's global row ids (row-wise shards get their ids back from TorchRec's
local ones), initialized as the whole table would be (the config's init, the
shard's columns of it). All features of a shard are pooled together, so a
row read by several features takes one optimizer step on its summed gradient,
as in FBGEMM's table-batched kernel.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.distributed.embedding_types import BaseEmbeddingLookup, GroupedEmbeddingConfig, ShardedEmbeddingTable
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType

from tierstore.engine.memory import parse_bytes
from tierstore.errors import SettingError, UnsupportedError
from tierstore.nn import TieredEmbeddingBag, forward_group
from tierstore.optim import RowOptimizer
from tierstore.spec import RowInit, TableSpec
from tierstore.training.bags import Bags, jagged_bags
from tierstore.store import TieredStore

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


@dataclasses.dataclass(frozen=True)
class ShardKey:
    """Where one shard of a table lives on its rank: its first row and column in the table."""

    table: str
    row_offset: int
    col_offset: int


def shard_key(table: ShardedEmbeddingTable) -> ShardKey:
    offsets = table.local_metadata.shard_offsets
    return ShardKey(table.name, int(offsets[0]), int(offsets[1]))


class RankStores:
    """The stores of one rank's shards. A store's tables are named as the tables (a row's
    initial value is a function of its table's name and id), so a rank holding two shards
    of one table keeps the second in a second store: store k holds the k-th shard of each
    table on the rank, at ``path/rank-<r>`` (k = 0) or ``path/rank-<r>.<k>``. The rank's
    ``memory_budget`` is split evenly between its stores."""

    def __init__(self, path: str | Path, rank: int, shards: Sequence[ShardedEmbeddingTable], inits: dict[str, RowInit],
                 dtypes: dict[str, str], optimizer: RowOptimizer | None, options: dict):
        slots: dict[ShardKey, int] = {}
        specs: list[list[TableSpec]] = []
        for t in shards:
            key = shard_key(t)
            if key in slots:
                continue
            k = sum(1 for other in slots if other.table == t.name)
            slots[key] = k
            while len(specs) <= k:
                specs.append([])
            dim = t.local_cols
            specs[k].append(TableSpec(t.name, t.num_embeddings, dim, dtype=dtypes[t.name],
                                      init=dataclasses.replace(inits[t.name], col_start=key.col_offset),
                                      state_dim=optimizer.state_dim(dim) if optimizer else 0))
        options = dict(options)
        if options.get("memory_budget") is not None and len(specs) > 1:
            options["memory_budget"] = _split_budget(options["memory_budget"], len(specs))
        root = Path(path)
        self.slots = slots
        self.stores: list[TieredStore] = []
        try:
            for k, table_specs in enumerate(specs):
                where = root / (f"rank-{rank}" if k == 0 else f"rank-{rank}.{k}")
                names = {t.name for t in table_specs}
                # per-table sizes name every table of the model: each store takes its own
                given = {key: {t: n for t, n in v.items() if t in names} if isinstance(v, dict) else v
                         for key, v in options.items()}
                self.stores.append(TieredStore(where, tables=table_specs, name=str(where), **given))
        except BaseException:
            self.close()
            raise

    def store_of(self, key: ShardKey) -> TieredStore:
        return self.stores[self.slots[key]]

    def flush(self) -> None:
        for s in self.stores:
            s.flush()

    def close(self) -> None:
        for s in self.stores:
            s.close()


def _split_budget(budget, parts: int) -> int:
    return parse_bytes(budget, "memory_budget") // parts


class _Shard(nn.Module):
    """One shard of a table on this rank: its features' bags, pooled from its store table."""

    def __init__(self, table: ShardedEmbeddingTable, stores: RankStores, optimizer: RowOptimizer | None, kernels: str,
                 partial_sums: bool):
        super().__init__()
        if table.pooling not in _MODES:
            raise SettingError(f"table {table.name!r}: pooling {table.pooling} is not supported by tierstore shards; "
                               "use PoolingType.SUM or PoolingType.MEAN")
        self.key = shard_key(table)
        self.num_features = table.num_features()
        self.dim = table.local_cols
        self.rows = table.local_rows
        self.row_offset = self.key.row_offset
        store = stores.store_of(self.key)
        # a row shard pools part of each bag: mean tables are summed here and divided by the
        # bags' lengths after TorchRec's reduce-scatter, as its kernels do for row-wise shards
        mode = "sum" if partial_sums else _MODES[table.pooling]
        self.bag = TieredEmbeddingBag(table.num_embeddings, table.local_cols, mode=mode, store=store,
                                      table=table.name, optimizer=optimizer, include_last_offset=True, kernels=kernels)

    def ids(self, values: torch.Tensor) -> torch.Tensor:
        """The table's global row ids of ``values`` (ids of this shard's keys, TorchRec's local ones)."""
        return values + self.row_offset if self.row_offset else values

    def bags(self, values: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor) -> Bags:
        """This shard's features' bags: their ids, bag offsets ([features x batch + 1], from 0)
        and sizes, as TorchRec's input dist gave them."""
        return jagged_bags(self.bag.config, self.ids(values), offsets, sizes)

    def arrange(self, pooled: torch.Tensor, batch: int) -> torch.Tensor:
        """The shard's pooled bags ([features x batch, dim]) as [batch, features x dim], each
        feature's bags side by side."""
        if self.num_features == 1:
            return pooled
        return pooled.view(self.num_features, batch, self.dim).transpose(0, 1).reshape(batch, self.num_features * self.dim)


class ShardLookup(BaseEmbeddingLookup[KeyedJaggedTensor, torch.Tensor]):
    """TorchRec's pooled lookup for one sharding type, over tierstore shards (see the module)."""

    def __init__(self, grouped_configs: list[GroupedEmbeddingConfig], sharding_type: str, stores: RankStores,
                 optimizer: RowOptimizer | None, kernels: str, device: torch.device | None):
        super().__init__()
        self.grouped_configs = grouped_configs
        partial_sums = sharding_type in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
        self.shards = nn.ModuleList(_Shard(t, stores, optimizer, kernels, partial_sums)
                                    for g in grouped_configs for t in g.embedding_tables)
        # where each shard's features start among the lookup's, and where the last ends
        self._bounds = list(itertools.accumulate((s.num_features for s in self.shards), initial=0))
        self._device = device
        self._prefetched: list = []  # tickets of the prefetches ahead of the next forward

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if sparse_features.variable_stride_per_key():
            raise UnsupportedError("tierstore shards take one batch size for every feature; variable batch sizes per "
                                   "feature (KeyedJaggedTensor's stride_per_key_per_rank) are not supported under DMP")
        if not self.shards:  # a rank without shards of this sharding type: TorchRec's empty [batch, 0]
            return torch.empty([0], device=sparse_features.device(), requires_grad=True).view(sparse_features.stride(), 0)
        tickets, self._prefetched = self._prefetched, []
        for ticket in tickets:  # a failed prefetch (a bad id) raises here, before any row is read
            ticket.wait()
        batch = sparse_features.stride()
        # every shard pooled by one call: one node of the graph for the rank's shards, as
        # TorchRec's table-batched kernel takes them
        pooled = forward_group([(shard.bag, shard.bags(ids, offsets, sizes), weights)
                                for shard, (ids, offsets, sizes, weights) in zip(self.shards, self._parts(sparse_features))])
        return torch.cat([shard.arrange(p, batch) for shard, p in zip(self.shards, pooled)], dim=1)

    def _parts(self, features: KeyedJaggedTensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Each shard's (ids, bag offsets from 0, bag sizes, weights) of ``features``: slices of
        its values, in place of KeyedJaggedTensor.split's new jagged tensors."""
        values, offsets, weights = features.values(), features.offsets(), features.weights_or_none()
        stride = features.stride()
        at = offsets[::stride].tolist()  # where each feature's ids start, and where the last ends
        sizes = torch.diff(offsets)
        parts = []
        for i in range(len(self.shards)):  # a loop per shard: slices, no copies
            first, end = self._bounds[i], self._bounds[i + 1]
            lo, hi = at[first], at[end]
            starts = offsets[first * stride: end * stride + 1]
            parts.append((values[lo:hi], starts - lo if lo else starts, sizes[first * stride: end * stride],
                          None if weights is None else weights[lo:hi]))
        return parts

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream=None) -> None:
        """Start bringing up the rows of a later forward of ``sparse_features`` (this rank's ids,
        after TorchRec's input dist): TorchRec's prefetching pipelines
        (PrefetchTrainPipelineSparseDist) call it for the batch ahead. Returns at once."""
        if self.shards:
            self._prefetched += [shard.bag.prefetch(shard.ids(part[0]))
                                 for shard, part in zip(self.shards, self._parts(sparse_features))]

    # TorchRec's sharded module asks its lookups for these; the rows' state is the sharded module's
    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return {} if destination is None else destination

    def named_parameters_by_table(self):
        return iter(())

    def purge(self) -> None:
        pass

    def flush(self) -> None:
        """TorchRec's sharded module flushes its lookups before a state_dict: the rows become durable."""
        for shard in self.shards:
            shard.bag.store.flush()
