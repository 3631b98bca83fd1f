"""TorchRec's DistributedModelParallel over tierstore shards.

``TieredEmbeddingBagCollectionSharder(path, hbm_rows=..., ddr_rows=..., memory_budget=...,
optimizer=...)`` is a TorchRec ``ModuleSharder``: passed to
``DistributedModelParallel(model, sharders=[sharder], plan=plan)``, it shards each
``torchrec.EmbeddingBagCollection`` of the model (or tierstore's, ``module_type=``) as
TorchRec's own EmbeddingBagCollectionSharder does, with each rank's shards in
tierstore stores under ``path``.

The route: TorchRec's ``CUSTOMIZED_KERNEL`` compute kernel in the plan, and a
``ShardedEmbeddingBagCollection`` subclass whose lookups are tierstore's
(tierstore.torchrec.lookup.ShardLookup). Everything else is TorchRec's own code:
the plan, the input dists (ids to the ranks that own them), the output dists
(pooled embeddings back, the backward dividing gradients by the world size), the
grouping of tables per sharding type, the embedding names and the permutes. A
custom BaseEmbedding kernel would have to be created by TorchRec's lookup, which
builds kernels from a fixed list (no hook for a new one); a whole custom
ShardedModule would repeat TorchRec's dists. CUSTOMIZED_KERNEL is the kernel
TorchRec leaves to subclasses: its sharded module skips the kernel's state_dict
handling, which the subclass gives (TableViews, read and written in chunks).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embedding_types import BaseEmbeddingSharder, EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer

from tierstore.errors import ArgumentTypeError, SettingError, TierstoreError, kind
from tierstore.optim import RowOptimizer
from tierstore.spec import RowInit
from tierstore.store import Sizes, StoreConfig
from tierstore.validate import check_choice, set_fields, with_keywords
from tierstore.torchrec import _DTYPES, _FusedKeyedOptimizer, row_init
from tierstore.training.checkpointing import SharedViews, TableView, TableViews, table_views
from tierstore.training.sharding import RankFailedError
from tierstore.torchrec.lookup import RankStores, ShardLookup

KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
FBGEMM_OPTIMIZER_KEYS = {"optimizer", "learning_rate", "eps", "beta1", "beta2", "weight_decay", "weight_decay_mode", "momentum"}
# what TorchRec 1.8 runs on the CPU with its own sharder; row-wise types need a GPU there too
SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value,
                  ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


def local_groups(sharding) -> list[GroupedEmbeddingConfig]:
    """The grouped tables a TorchRec sharding gives this rank's lookup."""
    grouped = getattr(sharding, "_grouped_embedding_configs", None)
    if grouped is None:  # table-row-wise keeps them per rank
        grouped = sharding._grouped_embedding_configs_per_rank[sharding._rank]
    return grouped


class TieredShardedEmbeddingBagCollection(SharedViews, ShardedEmbeddingBagCollection):
    """TorchRec's ShardedEmbeddingBagCollection with the rank's shards in tierstore stores."""

    def __init__(self, module, table_name_to_parameter_sharding: dict[str, ParameterSharding], env: ShardingEnv,
                 sharder: "TieredEmbeddingBagCollectionSharder", fused_params: dict[str, Any] | None = None,
                 device: torch.device | None = None, qcomm_codecs_registry=None, module_fqn: str | None = None):
        # construct_module_sharding_plan's helpers name TorchRec's dense kernel unless told otherwise: every
        # table this sharder shards is stored by tierstore, whichever of TorchRec's kernels the plan names
        table_name_to_parameter_sharding = {name: dataclasses.replace(p, compute_kernel=KERNEL)
                                            for name, p in table_name_to_parameter_sharding.items()}
        self._sharder = sharder  # read by _create_lookups, which the base class's __init__ calls
        self._stores: RankStores | None = None
        self._built = False
        super().__init__(module, table_name_to_parameter_sharding, env, fused_params=fused_params, device=device,
                         qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn)
        self._built = True
        # TorchRec's base collects its kernels' fused optimizers; the tierstore shards' state is their views
        self._optim = CombinedOptimizer([("", self._fused_state())])
        self.register_load_state_dict_post_hook(self._loaded_views)

    def _create_lookups(self) -> None:
        s = self._sharder
        configs = {c.name: c for c in self._embedding_bag_configs}
        shards = [t for sharding in self._embedding_shardings for g in local_groups(sharding) for t in g.embedding_tables]
        if self._stores is None:
            inits = {name: s.init if s.init is not None else row_init(c) for name, c in configs.items()}
            dtypes = {name: _DTYPES[c.data_type][0] for name, c in configs.items()}
            device = self._device if self._device is not None and self._device.type != "meta" else torch.device("cpu")
            self._stores = RankStores(s.path, self._env.rank, shards, inits, dtypes, s.optimizer,
                                      {**s.store_options, "device": device})
        for sharding_type, sharding in zip(self._sharding_types, self._embedding_shardings):
            self._lookups.append(ShardLookup(local_groups(sharding), sharding_type, self._stores, s.optimizer, s.kernels,
                                             self._device))

    def forward(self, *args, **kwargs):
        """TorchRec's: the input dist, the lookup, the output dist started. A collective that
        fails there (a rank died, or did not answer within the process group's timeout) raises
        RankFailedError; a failed lookup raises its own error (a bad id, a store's fault)."""
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, TierstoreError):
                raise
            raise RankFailedError(
                f"rank {self._env.rank}: TorchRec's dists with the other ranks failed ({kind(e)}: {e}); a rank died or did "
                "not answer within the process group's timeout (init_process_group(timeout=...))") from e

    def reset_parameters(self) -> None:
        """Every row of this rank's shards back to its initial value, with zero optimizer state.
        (TorchRec's base class calls this while it is built: a store reopened keeps its rows.)"""
        if not self._built:
            return
        for lookup in self._lookups:
            for shard in lookup.shards:
                shard.bag.reset_parameters()

    # -- checkpoints: TorchRec's keys, this rank's shards as TableViews (tierstore.training.checkpointing) --
    def views(self, table: str) -> TableViews:
        """This rank's shards of ``table`` and their optimizer state as TableViews of the whole
        table's shape: what state_dict() and fused_optimizer hold, read and written a chunk at a
        time; DCP saves each rank's rows and reshards them on load."""
        config = self._table_name_to_config[table]
        dtype = _DTYPES[config.data_type][0]
        # each column shard trains its own per-row state (row-wise Adagrad's accumulator), as
        # TorchRec's do: their states side by side, by column, in TorchRec's layout
        columns = sorted({int(s.shard_offsets[1]) for s in self.module_sharding_plan[table].sharding_spec.shards})

        def col_shard(col: int) -> tuple[int, int] | None:
            return (columns.index(col), len(columns)) if len(columns) > 1 else None

        parts = [table_views(shard.bag.store, table, config.num_embeddings, config.embedding_dim, dtype, self._sharder.optimizer,
                             (shard.key.row_offset, shard.key.row_offset + shard.rows),
                             (shard.key.col_offset, shard.key.col_offset + shard.dim), col_shard(shard.key.col_offset))
                 for lookup in self._lookups for shard in lookup.shards if shard.key.table == table]
        if not parts:  # no shard here: views of no rows
            return table_views(None, table, config.num_embeddings, config.embedding_dim, dtype, self._sharder.optimizer,
                               (0, 0), None, col_shard(columns[0]))

        def merged(views: list[TableView]) -> TableView:
            first = views[0]
            blocks = [dataclasses.replace(b, store=v._store) for v in views for b in v._blocks]
            return TableView(first._store, table, first._what, first._full, first.dtype, blocks)

        return TableViews(merged([p.weight for p in parts]), {k: merged([p.state[k] for p in parts]) for k in parts[0].state})

    def _fused_state(self) -> KeyedOptimizer:
        views = {f"embedding_bags.{name}.weight": self.views(name) for name in self._table_names}
        params = {key: v.weight for key, v in views.items()}
        return _FusedKeyedOptimizer(self._sharder.optimizer, params, {v.weight: v.state for v in views.values() if v.state},
                                    [{"params": list(params.values())}])

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The fused optimizer's state, keyed as TorchRec's: ``{"state": {"embedding_bags.<table>.weight":
        {"<table>.momentum1": ...}}}`` (this rank's shards, as TableViews); ``step()`` does nothing."""
        return self._optim

    def _view_tables(self) -> list[str]:
        return self._table_names

    @staticmethod
    def _loaded_views(module: "TieredShardedEmbeddingBagCollection", incompatible) -> None:
        """The tables' keys were loaded here, not by the empty ``embedding_bags.<table>`` modules
        below, which report them unexpected."""
        ours = tuple(f"embedding_bags.{name}.weight" for name in module._table_names)
        incompatible.unexpected_keys[:] = [k for k in incompatible.unexpected_keys if not k.endswith(ours)]

    @property
    def stores(self) -> RankStores:
        """This rank's stores (``stores.stores``: TieredStores, one per shard of a table the rank holds)."""
        return self._stores

    def flush(self) -> None:
        """Every row of this rank's shards durable in LMDB."""
        self._stores.flush()

    def close(self) -> None:
        """Flush and close this rank's stores."""
        self._stores.close()


class TieredEmbeddingBagCollectionSharder(BaseEmbeddingSharder[EmbeddingBagCollection]):
    """A TorchRec sharder that stores each rank's shards in tierstore stores under ``path``.

    ``hbm_rows``/``ddr_rows`` size each store's tiers (per table, an int or {table: rows}),
    ``memory_budget`` a rank's host memory for its stores (bytes or "4GiB"), ``policy`` the
    DDR tier's eviction ("lru", "lfu"); ``optimizer`` is the fused row optimizer
    (tierstore.optim: SGD, RowWiseAdagrad, Adagrad, Adam) run in the backward, as TorchRec's
    fused TBEs run FBGEMM's. ``init`` (a tierstore.RowInit) gives every table's initial rows;
    by default each table's config says (its init_fn, else uniform(weight_init_min,
    weight_init_max)), as tierstore.torchrec.TieredEmbeddingBagCollection reads it.
    ``module_type`` is the collection class it shards: TorchRec's EmbeddingBagCollection, or
    tierstore.torchrec.TieredEmbeddingBagCollection (built with ``device="meta"``).
    ``store=StoreConfig(...)`` gives the settings of every rank's stores whole (any of the
    config's fields but its path, which is ``path``'s, and its device, DMP's), as for
    ShardedEmbeddingBagCollection. The settings are checked here, before DMP shards.
    """

    def __init__(self, path: str | Path, *, hbm_rows: Sizes | None = None, ddr_rows: Sizes | None = None,
                 memory_budget: int | str | None = None, policy: str = "lru", optimizer: RowOptimizer | None = None,
                 init=None, kernels: str = "torch", module_type: type[nn.Module] = EmbeddingBagCollection,
                 fused_params: dict[str, Any] | None = None, qcomm_codecs_registry=None, store: StoreConfig | None = None):
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"path must be the directory of the ranks' stores (a str or Path), got {type(path).__name__}")
        if init is not None and not isinstance(init, RowInit):
            raise ArgumentTypeError(f"init must be a tierstore.RowInit (e.g. RowInit.normal(0, 0.01)) or None (each table's "
                                    f"config says), got {type(init).__name__}")
        check_choice(kernels, "kernels", ("torch", "fbgemm"), "fbgemm: FBGEMM's fused backward")
        # TorchRec's own sharder takes its fused optimizer here; tierstore's lookups would leave these unread
        fbgemm_optimizer = sorted(set(fused_params or {}) & FBGEMM_OPTIMIZER_KEYS)
        if fbgemm_optimizer:
            raise SettingError(f"fused_params {fbgemm_optimizer} configure FBGEMM's fused optimizer, which tierstore's shards do "
                               "not run: pass optimizer=tierstore.optim.RowWiseAdagrad(lr=...) (or SGD, Adagrad, Adam) instead")
        if optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise ArgumentTypeError(f"optimizer must be a tierstore.optim optimizer (SGD, RowWiseAdagrad, Adagrad, Adam), "
                                    f"got {type(optimizer).__name__}")
        if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
            raise ArgumentTypeError(f"module_type must be the collection class to shard, got {module_type!r}")
        self.path = Path(path)
        self.optimizer = optimizer
        self.init = init
        self.kernels = kernels
        self._module_type = module_type
        self.store_options = _store_options(store, hbm_rows=hbm_rows, ddr_rows=ddr_rows, memory_budget=memory_budget,
                                            policy=policy)

    def planner(self, topology, batch_size: int = 512, constraints=None, **kwargs):
        """TorchRec's EmbeddingShardingPlanner for this sharder: its storage estimates count a
        shard's tiers (``hbm_rows``, ``ddr_rows``, ``memory_budget`` per rank), not its table
        (tierstore.torchrec.planning). ``plan = sharder.planner(Topology(...)).collective_plan(model,
        [sharder], pg)``."""
        from tierstore.torchrec.planning import planner

        return planner(self, topology, batch_size=batch_size, constraints=constraints, **kwargs)

    def shard(self, module, params: dict[str, ParameterSharding], env: ShardingEnv, device: torch.device | None = None,
              module_fqn: str | None = None) -> TieredShardedEmbeddingBagCollection:
        return TieredShardedEmbeddingBagCollection(module, params, env, self, fused_params=self.fused_params, device=device,
                                                   qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn)

    def shardable_parameters(self, module) -> dict[str, nn.Parameter]:
        return {name.split(".")[0]: param for name, param in module.embedding_bags.named_parameters()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [KERNEL]

    @property
    def module_type(self) -> type[nn.Module]:
        return self._module_type

    @property
    def sharded_module_type(self) -> type[TieredShardedEmbeddingBagCollection]:
        return TieredShardedEmbeddingBagCollection


def _store_options(store: StoreConfig | None, **keywords) -> dict[str, Any]:
    """The ranks' TieredStore settings, checked now (StoreConfig's checks): a bad size or policy
    fails where the sharder is made, not on every rank once DMP shards the model."""
    config = StoreConfig(**keywords)
    if store is not None:
        if not isinstance(store, StoreConfig):
            raise ArgumentTypeError(f"store must be a tierstore.StoreConfig (the settings of each rank's stores), got {type(store).__name__}")
        if store.path is not None:
            raise SettingError(f"store=StoreConfig(path={str(store.path)!r}): each rank's stores are PATH/rank-K under the "
                               "sharder's path; leave the config's path unset")
        config = with_keywords(store, config, set_fields(StoreConfig, keywords), "TieredEmbeddingBagCollectionSharder")
    # the device is the one DMP shards onto
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(StoreConfig) if f.name not in ("path", "device")}
