"""TieredEmbeddingBagCollection: several TieredEmbeddingBags over the tables of one store."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from tierstore.training.checkpointing import FusedOptimizer
from tierstore.engine.interface import EmbeddingStore
from tierstore.optim import RowOptimizer
from tierstore.spec import TableSpec
from tierstore.store import Sizes, StoreConfig
from tierstore.errors import ArgumentTypeError, SettingError, UnknownTableError
from tierstore.nn.bag import TieredEmbeddingBag, pool_group
from tierstore.nn.common import ScriptRefusal, _warn_untrained, as_leaf, module_store, outside_graphs, refuse_export


def feature_parts(name: str, feature) -> tuple:
    """(values, offsets, per_sample_weights) of one table's feature in a collection's batch."""
    if isinstance(feature, torch.Tensor):
        return feature, None, None
    if isinstance(feature, (tuple, list)) and len(feature) in (2, 3):
        return (*feature, None)[:3]
    raise ArgumentTypeError(f"feature {name!r} must be (values, offsets), (values, offsets, per_sample_weights) or a 2-D tensor")


class TieredEmbeddingBagCollection(ScriptRefusal, nn.Module):
    """Several TieredEmbeddingBags over the tables of one store.

    ``ebc = TieredEmbeddingBagCollection(tables=[TableSpec(...), ...], path=..., optimizer=...)``;
    ``ebc({"user": (values, offsets), "item": (values, offsets)})`` returns
    ``{"user": pooled [B, dim], "item": ...}``. A feature may also be
    ``(values, offsets, per_sample_weights)`` or a 2-D tensor of fixed-length bags.
    Each table's ``state_dim`` is set to what the optimizer needs. ``store=StoreConfig(...)``
    gives the settings of the store it opens; ``store=`` an open store uses its tables. ``record_trace=PATH``
    records the store's reads as a trace for ``tierstore capacity`` (TieredStore's option).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        *,
        path: str | Path | None = None,
        store: EmbeddingStore | StoreConfig | None = None,
        hbm_rows: Sizes | None = None,
        ddr_rows: Sizes | None = None,
        policy: str = "lru",
        device: str | torch.device | None = None,
        optimizer: RowOptimizer | None = None,
        mode: str = "sum",
        include_last_offset: bool = False,
        kernels: str = "torch",
        memory_budget: int | str | None = None,
        record_trace: str | Path | None = None,
    ):
        super().__init__()
        tables = list(tables)
        if not tables or not all(isinstance(t, TableSpec) for t in tables):
            raise ArgumentTypeError("tables must be a non-empty list of tierstore.TableSpec")
        specs = []
        for spec in tables:
            if optimizer is not None:
                need = optimizer.state_dim(spec.dim)
                if spec.state_dim not in (0, need):
                    raise SettingError(f"table {spec.name!r}: state_dim={spec.state_dim} but {optimizer!r} needs {need}; leave state_dim=0")
                spec = dataclasses.replace(spec, state_dim=need)
            specs.append(spec)
        store, self._owns_store = module_store(store, path, specs, hbm_rows=hbm_rows, ddr_rows=ddr_rows, policy=policy,
                                               device=device, memory_budget=memory_budget, record_trace=record_trace)
        self.store = store
        self.optimizer = optimizer
        self._bags = {
            s.name: TieredEmbeddingBag(s.num_rows, s.dim, mode=mode, store=store, table=s.name, optimizer=optimizer,
                                       include_last_offset=include_last_offset, kernels=kernels)
            for s in specs
        }

    @property
    def bags(self) -> Mapping[str, TieredEmbeddingBag]:
        return dict(self._bags)

    def requires_grad_(self, requires_grad: bool = True) -> "TieredEmbeddingBagCollection":
        """Freezes (False) or trains (True, needs optimizer=) every table's rows, as torch does a module's."""
        for bag in self._bags.values():
            bag.requires_grad_(requires_grad)
        return self

    def __getitem__(self, name: str) -> TieredEmbeddingBag:
        return self._bags[self._known(name)]

    def _known(self, name) -> str:
        if name not in self._bags:
            raise UnknownTableError(f"unknown table {name!r}; the collection has tables {sorted(self._bags)}")
        return name

    def forward(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        leaf = as_leaf(self, (features,))
        if leaf is not None:
            return leaf
        if isinstance(features, Mapping) and features and all(
                name in self._bags and isinstance(f, (tuple, list)) and len(f) == 2
                and self._bags[name]._steps_on_device(f[0], f[1], None) for name, f in features.items()):
            return {name: self._bags[name].forward(*f) for name, f in features.items()}
        return self._host_forward(features)

    def hold_resident(self) -> "TieredEmbeddingBagCollection":
        """Every table's TieredEmbeddingBag.hold_resident: the device step for each."""
        for bag in self._bags.values():
            bag.hold_resident()
        return self

    def resolve_ahead(self) -> "TieredEmbeddingBagCollection":
        """Every table's TieredEmbeddingBag.resolve_ahead: the device step over each one's cache."""
        for bag in self._bags.values():
            bag.resolve_ahead()
        return self

    def resolve_batch(self, features: Mapping[str, object]) -> None:
        """Each table's TieredEmbeddingBag.resolve_batch of its feature."""
        for name, feature in features.items():
            self[name].resolve_batch(feature)

    def begin_step(self, features: Mapping[str, object]) -> None:
        """Each table's TieredEmbeddingBag.begin_step of its feature."""
        for name, feature in features.items():
            self[name].begin_step(feature)

    @property
    def resolves_ahead(self) -> bool:
        return any(bag.resolves_ahead for bag in self._bags.values())

    def release_steps(self) -> None:
        for bag in self._bags.values():
            bag.release_steps()

    @outside_graphs  # torch.compile: a graph break; the dense layers around it compile
    def _host_forward(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        refuse_export(self)
        if not isinstance(features, Mapping):
            raise ArgumentTypeError("features must be a mapping {table: (values, offsets)}")
        plans = {}
        for name, feature in features.items():  # validate every table before touching the store
            bag = self._bags[self._known(name)]
            values, offsets, psw = feature_parts(name, feature)
            plans[name] = (bag, bag._plan(values, offsets, psw), psw)
        _warn_untrained([bag for bag, _, _ in plans.values()], self.training)  # its bags are not submodules
        return dict(zip(plans, pool_group(tuple(plans.values()))))

    def batch_reads(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """The ids a forward of ``features`` reads, by table."""
        return {table: ids for name, f in features.items() for table, ids in self[name].batch_reads(f).items()}

    def prefetch(self, features: Mapping[str, object]):
        """Start bringing up the rows of a later ``forward(features)``; returns at once
        with a tierstore.engine.prefetch.PrefetchGroup of one ticket per table."""
        from tierstore.engine.prefetch import PrefetchGroup

        return PrefetchGroup(
            self._bags[self._known(name)].prefetch(f[0] if isinstance(f, (tuple, list)) else f)
            for name, f in features.items()
        )

    def close(self) -> None:
        """Close the store if this collection opened it (flushes every row)."""
        if self._owns_store:
            self.store.close()

    # -- checkpoints: TorchRec's keys, embedding_bags.<table>.weight ---------------------------
    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The fused optimizer's state: ``{"state": {"embedding_bags.<table>.weight": {"<table>.momentum1": ...}}}``."""
        return FusedOptimizer(self.optimizer, {f"embedding_bags.{name}.weight": state for name, bag in self._bags.items()
                                               if (state := bag.views().state)})

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, bag in self._bags.items():
            destination[f"{prefix}embedding_bags.{name}.weight"] = bag.views().weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        for name, bag in self._bags.items():
            bag._load_weight(state_dict, f"{prefix}embedding_bags.{name}.weight", missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"tables={sorted(self._bags)}, store={str(self.store.path)!r}, optimizer={self.optimizer!r}"
