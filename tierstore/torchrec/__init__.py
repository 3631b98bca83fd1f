"""TorchRec models on tierstore tables: ``KeyedJaggedTensor`` in, ``KeyedTensor`` out.

``TieredEmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig, ...], path=...)``
is a drop-in for ``torchrec.EmbeddingBagCollection`` (it drops into
``torchrec.models.dlrm.DLRM(embedding_bag_collection=...)``) whose tables live in
one TieredStore: HBM and DDR tiers over LMDB, trained by a fused row optimizer
(tierstore.optim) in the backward, as ``tierstore.TieredEmbeddingBag`` does.
Its output has the keys, order, lengths and layout of TorchRec's own: a table's
features in ``feature_names`` order, tables in order, a feature that several
tables share named ``feature@table``.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

try:
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType
    from torchrec.modules.embedding_configs import DataType
    from torchrec.modules.embedding_modules import (EmbeddingBagCollectionInterface, get_embedding_names_by_table,
                                                    reorder_inverse_indices)
    from torchrec.sparse.tensor_dict import maybe_td_to_kjt
    from torchrec.optim.keyed import KeyedOptimizer
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "tierstore.torchrec needs TorchRec: pip install --no-deps torchrec==1.8.0 && pip install 'tierstore[torchrec]' "
        "(TorchRec's package names the CUDA build of FBGEMM; the extra installs the CPU build and TorchRec's other dependencies)"
    ) from e

torch.fx.wrap("reorder_inverse_indices")  # a leaf when traced here too, as where TorchRec calls it

from tierstore.training.checkpointing import check_optimizer_record, optimizer_record
from tierstore.engine.interface import EmbeddingStore
from tierstore.lazy import submodule
from tierstore.nn import ScriptRefusal, TieredEmbeddingBag, module_store, outside_graphs, refuse_export
from tierstore.optim import RowOptimizer
from tierstore.spec import RowInit, TableSpec
from tierstore.store import Sizes, StoreConfig
from tierstore.errors import ArgumentTypeError, SettingError, UnknownTableError, UnsupportedError

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
_DTYPES = {DataType.FP32: ("float32", torch.float32), DataType.FP16: ("float16", torch.float16),
           DataType.BF16: ("bfloat16", torch.bfloat16)}
_INITS = {torch.nn.init.uniform_: ("uniform", {"a": 0.0, "b": 1.0}), torch.nn.init.normal_: ("normal", {"mean": 0.0, "std": 1.0}),
          torch.nn.init.zeros_: ("zeros", {})}


def row_init(config: EmbeddingBagConfig) -> RowInit:
    """The RowInit of a config: its init_fn where that is a partial of torch.nn.init's uniform_,
    normal_ or zeros_, else uniform(weight_init_min, weight_init_max) as TorchRec's default."""
    fn = config.init_fn
    if fn is None:
        return RowInit.uniform(config.get_weight_init_min(), config.get_weight_init_max())
    base = fn.func if isinstance(fn, functools.partial) else fn
    if base not in _INITS:
        raise SettingError(
            f"table {config.name!r}: init_fn={fn!r} cannot give each row its value from its id alone (the store creates "
            "rows when first read, in any order); use functools.partial(torch.nn.init.uniform_, a=..., b=...), "
            "normal_(mean=..., std=...) or zeros_, weight_init_min/weight_init_max, or init=tierstore.RowInit(...)")
    kind, defaults = _INITS[base]
    given = fn.keywords if isinstance(fn, functools.partial) else {}
    if (isinstance(fn, functools.partial) and fn.args) or set(given) - set(defaults):
        raise SettingError(f"table {config.name!r}: init_fn {fn!r} must give only the keywords {sorted(defaults)} "
                         "(the rows' values are made per row from them)")
    args = [float(given.get(n, d)) for n, d in defaults.items()]
    return RowInit("zeros") if kind == "zeros" else getattr(RowInit, kind)(*args)


@torch.fx.wrap
def _pool_per_sample(pooled: list[torch.Tensor], inverse_indices: torch.Tensor) -> torch.Tensor:
    """The features' pooled bags side by side, [B, sum of dims]; with variable batch sizes
    (inverse indices, [features, B]) each feature's bags spread to the B samples first, as
    TorchRec's process_pooled_embeddings does (with index_select in place of FBGEMM's
    group_index_select_dim0: the same rows copied)."""
    if inverse_indices.numel() > 0:
        pooled = [p.index_select(0, i) for p, i in zip(pooled, torch.unbind(inverse_indices))]
    return torch.cat(pooled, dim=1)


def _output_layout(tables: Sequence[EmbeddingBagConfig]) -> tuple[list[str], list[int]]:
    """The KeyedTensor keys and widths of the configs' features, TorchRec's order and names."""
    return ([n for names in get_embedding_names_by_table(tables) for n in names],
            [t.embedding_dim for t in tables for _ in t.feature_names])


def _pooled(collection, features: KeyedJaggedTensor) -> KeyedTensor:
    """A collection's forward, TorchRec's layout: each table's features pooled by its bag
    module (``collection.embedding_bags[name]``), tables in order, per sample."""
    features = maybe_td_to_kjt(features, None)
    configs = collection._configs
    flat = [f for t in configs for f in t.feature_names]
    inverse_indices = reorder_inverse_indices(inverse_indices=features.inverse_indices_or_none(), feature_names=flat)
    jagged = features.to_dict()
    if not isinstance(jagged, torch.fx.Proxy):
        missing = list(dict.fromkeys(f for f in flat if f not in jagged))
        if missing:
            raise UnknownTableError(f"features {missing} are not in the KeyedJaggedTensor (it has {list(jagged)})")
    pooled = []
    for t in configs:
        parts = [jagged[f] for f in t.feature_names]
        weights = torch.cat([jt.weights() for jt in parts]) if collection._is_weighted else None
        # a table's features in one lookup, as TorchRec's fused tables (FBGEMM's TBE) pool them: a row that
        # several features read takes one optimizer step on its summed gradient, not one per feature
        lengths = torch.cat([jt.lengths() for jt in parts])
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0, dtype=lengths.dtype)])
        out = collection.embedding_bags[t.name](torch.cat([jt.values() for jt in parts]), offsets, weights)
        pieces = out.split([jt.lengths().shape[0] for jt in parts])
        pooled.extend(pieces[i] for i in range(len(parts)))  # indexed, not iterated: torch.fx traces it
    return KeyedTensor(keys=collection._embedding_names, length_per_key=collection._lengths_per_embedding,
                       values=_pool_per_sample(pooled, inverse_indices))


class _FusedKeyedOptimizer(KeyedOptimizer):
    """A KeyedOptimizer over TableViews: the update itself runs in the backward. Its
    state_dict() also says which optimizer made the state (checkpointing.optimizer_record)."""

    def __init__(self, optimizer: RowOptimizer | None, params, state, param_groups):
        super().__init__(params, state, param_groups)
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return {**super().state_dict(), **optimizer_record(self.optimizer)}

    def load_state_dict(self, state_dict) -> None:
        check_optimizer_record(self.optimizer, state_dict)
        super().load_state_dict(state_dict)

    def step(self, closure=None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class TieredEmbeddingBagCollection(ScriptRefusal, EmbeddingBagCollectionInterface):
    """torchrec.EmbeddingBagCollection over the tables of one TieredStore.

    ``TieredEmbeddingBagCollection(tables, is_weighted=False, device=None, *, path=..., ...)``
    (TorchRec's signature, then the store's arguments). ``tables`` are TorchRec's
    EmbeddingBagConfigs (sum or mean pooling; FP32, FP16 or BF16 rows, pooled in float32);
    each becomes a store table of the same name. A config without ``feature_names`` gets
    ``[name]``, as TorchRec does. ``is_weighted`` pools the features' weights (sum pooling).
    Rows never written start as the config says, a pure function of (table, id, seed)
    (tierstore.RowInit): ``init_fn`` when it is ``functools.partial`` of
    ``torch.nn.init.uniform_``, ``normal_`` or ``zeros_``, else uniform(weight_init_min,
    weight_init_max) (TorchRec's default +-1/sqrt(num_embeddings)); ``init=`` (a RowInit)
    sets every table's instead. Without ``optimizer`` the rows are not trained.
    ``device="meta"`` builds the module as TorchRec does on meta (nn.EmbeddingBags of meta
    tensors, for shapes and planning) and creates no store. ``record_trace=PATH`` records the
    store's reads as a trace for ``tierstore capacity`` (TieredStore's option).
    ``store=StoreConfig(...)`` gives the settings of the store it opens (any of the config's
    fields, beside the keywords here); ``store=`` an open store holding the tables uses it.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: str | torch.device | None = None,
        *,
        path: str | Path | None = None,
        store: EmbeddingStore | StoreConfig | None = None,
        hbm_rows: Sizes | None = None,
        ddr_rows: Sizes | None = None,
        policy: str = "lru",
        optimizer: RowOptimizer | None = None,
        init: RowInit | None = None,
        kernels: str = "torch",
        memory_budget: int | str | None = None,
        record_trace: str | Path | None = None,
    ):
        super().__init__()
        tables = list(tables)
        if not tables or not all(isinstance(t, EmbeddingBagConfig) for t in tables):
            raise ArgumentTypeError("tables must be a non-empty list of torchrec.EmbeddingBagConfig")
        if not isinstance(is_weighted, bool):
            raise ArgumentTypeError(f"is_weighted must be a bool (TorchRec's signature is (tables, is_weighted, device)), got {is_weighted!r}")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise SettingError(f"Duplicate table name in {names}")
        inits = {}
        for t in tables:
            if t.pooling not in _MODES:
                raise SettingError(f"table {t.name!r}: pooling {t.pooling} is not supported; use PoolingType.SUM or PoolingType.MEAN")
            if t.data_type not in _DTYPES:
                raise SettingError(f"table {t.name!r}: data_type {t.data_type} is not supported; use DataType.FP32, FP16 or BF16 "
                                 "(for int8/int4 serving rows see tierstore.export)")
            if is_weighted and t.pooling != PoolingType.SUM:
                raise SettingError(f"table {t.name!r}: weighted features need PoolingType.SUM (as torch.nn.EmbeddingBag)")
            if not t.feature_names:
                t.feature_names = [t.name]
            inits[t.name] = init if init is not None else row_init(t)
        self._configs = tables
        self._is_weighted = is_weighted
        self._optimizer = optimizer
        self._embedding_names, self._lengths_per_embedding = _output_layout(tables)
        if device is not None and torch.device(device).type == "meta":
            # shapes only, as TorchRec's EBC on meta: no store, no files
            if record_trace is not None:
                raise SettingError("device='meta' builds shapes only and reads no rows: there is nothing to record; "
                                 "drop record_trace= or build the collection with path= on a real device")
            self.store = None
            self.embedding_bags = nn.ModuleDict({
                t.name: nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=_MODES[t.pooling], include_last_offset=True,
                                        device="meta", dtype=_DTYPES[t.data_type][1])
                for t in tables})
            return
        specs = [TableSpec(t.name, t.num_embeddings, t.embedding_dim, dtype=_DTYPES[t.data_type][0],
                           state_dim=optimizer.state_dim(t.embedding_dim) if optimizer else 0, init=inits[t.name])
                 for t in tables]
        self.store, self._owns_store = module_store(store, path, specs, hbm_rows=hbm_rows, ddr_rows=ddr_rows, policy=policy,
                                                    device=device, memory_budget=memory_budget, record_trace=record_trace)
        self.embedding_bags = nn.ModuleDict({
            t.name: TieredEmbeddingBag(t.num_embeddings, t.embedding_dim, mode=_MODES[t.pooling], store=self.store, table=t.name,
                                       optimizer=optimizer, include_last_offset=True, kernels=kernels)
            for t in tables
        })

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """As TorchRec's: a KeyedJaggedTensor (or TensorDict), variable batch sizes by its
        inverse indices. Under torch.fx tracing this is traced, its tables leaves. With every
        table on the device step (held or resolved ahead, unweighted) it is ops alone, so
        torch.compile and torch.export see it whole, as they see TorchRec's own collection."""
        if not self._is_weighted and self.embedding_bags and all(  # (on the meta device, the bags are torch's)
                isinstance(bag, TieredEmbeddingBag) and (bag.resolves_ahead or bag.holds_resident)
                for bag in self.embedding_bags.values()):
            return _pooled(self, features)
        return self._host_forward(features)

    @outside_graphs  # torch.compile: a graph break; the dense layers around it compile
    def _host_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        refuse_export(self)
        return _pooled(self, features)

    def batch_reads(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """The ids a forward of ``features`` reads, by table: what LookaheadLoader prefetches."""
        jagged = features.to_dict()
        return {t.name: torch.cat([jagged[f].values().reshape(-1) for f in t.feature_names]) for t in self._configs}

    @property
    def bags(self) -> nn.ModuleDict:
        """The tables' modules (TorchRec's name for them is ``embedding_bags``)."""
        return self.embedding_bags

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The fused optimizer's state as TorchRec's fused optimizers present theirs (a
        KeyedOptimizer): ``{"state": {"embedding_bags.<table>.weight": {"<table>.momentum1": ...}}}``,
        TableViews that DCP saves and loads in chunks. ``step()`` does nothing (the rows
        are updated in the backward)."""
        if self.store is None:
            raise UnsupportedError("a collection built on the meta device has no rows and no optimizer state; "
                               "build it with path= and a real device to checkpoint it")
        views = {f"embedding_bags.{name}.weight": bag.views() for name, bag in self.embedding_bags.items()}
        params = {key: v.weight for key, v in views.items()}
        state = {v.weight: v.state for v in views.values() if v.state}
        return _FusedKeyedOptimizer(self._optimizer, params, state, [{"params": list(params.values())}])

    def hold_resident(self) -> "TieredEmbeddingBagCollection":
        """Every table held in its top tier: each table's step is the device step
        (tierstore.TieredEmbeddingBag.hold_resident; unweighted tables)."""
        for bag in self.embedding_bags.values():
            bag.hold_resident()
        return self

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self.store.device if self.store is not None else torch.device("meta")

    def reset_parameters(self) -> None:
        """Every row back to its initial value, with zero optimizer state (as TorchRec's re-runs init_fn)."""
        for bag in self.embedding_bags.values():
            bag.reset_parameters()

    def close(self) -> None:
        """Flush every row and close the store, if the collection opened it (not one given as ``store=``)."""
        if self.store is not None and self._owns_store:
            self.store.close()


class ServingEmbeddingBagCollection(nn.Module):
    """Inference over a serving store (``tierstore export``: float32, float16, int8 or int4
    rows) with TorchRec's interface: the training collection's EmbeddingBagConfigs,
    ``forward(KeyedJaggedTensor) -> KeyedTensor`` in the same keys, order and layout, pooled
    from the serving tiers (tierstore.serving.store), without gradients. ``hbm_rows``/``ddr_rows``
    size the serving store's tiers."""

    def __init__(self, tables: Sequence[EmbeddingBagConfig], path: str | Path, is_weighted: bool = False,
                 hbm_rows: int = 0, ddr_rows: int = 0, device: str | torch.device | None = None):
        super().__init__()
        from tierstore.serving.store import ServingEmbeddingBag, ServingStore

        tables = list(tables)
        if not tables or not all(isinstance(t, EmbeddingBagConfig) for t in tables):
            raise ArgumentTypeError("tables must be a non-empty list of torchrec.EmbeddingBagConfig")
        store = ServingStore(path, hbm_rows=hbm_rows, ddr_rows=ddr_rows, device=device)
        for t in tables:
            if t.name not in store.tables:
                store.close()
                raise UnknownTableError(f"table {t.name!r} is not in the serving store at {path} (it has {sorted(store.tables)})")
            dim = store.tables[t.name].dim
            if t.pooling not in _MODES or dim != t.embedding_dim:
                store.close()
                raise SettingError(f"table {t.name!r}: the serving store holds dim {dim} rows and pools "
                                 f"sum or mean; the config says embedding_dim={t.embedding_dim}, pooling {t.pooling}")
            if not t.feature_names:
                t.feature_names = [t.name]
        self.store = store
        self._configs, self._is_weighted = tables, is_weighted
        self._embedding_names, self._lengths_per_embedding = _output_layout(tables)
        self.embedding_bags = nn.ModuleDict({t.name: ServingEmbeddingBag(store, t.name, _MODES[t.pooling], include_last_offset=True)
                                             for t in tables})

    @torch.no_grad()
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return _pooled(self, features)

    def close(self) -> None:
        self.store.close()


def __getattr__(name: str):
    # the sharder loads TorchRec's distributed package (a second's import): on first use only
    if name in ("TieredEmbeddingBagCollectionSharder", "TieredShardedEmbeddingBagCollection"):
        return getattr(submodule(__name__, "sharder"), name)
    return submodule(__name__, name)
