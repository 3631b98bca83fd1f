"""What every store-backed torch module shares (TieredEmbeddingBag, the collections here and in
tierstore.torchrec): the store it reads (module_store), its place under torch.compile, torch.fx,
torch.export and torch.jit.script, the warning of a training forward that trains nothing, and a
table spec checked against the module's arguments."""
from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from tierstore.engine.interface import EmbeddingStore
from tierstore.spec import TableSpec
from tierstore.store import StoreConfig, TieredStore
from tierstore.errors import ArgumentTypeError, SettingError, UnsupportedError

if TYPE_CHECKING:
    from tierstore.nn.bag import TieredEmbeddingBag


def outside_graphs(fn):
    """``fn`` (a forward that reads the store) runs eagerly under torch.compile, the graph
    broken at its call, as torch.compiler.disable does. That decorator imports dynamo
    (2 s of every ``import tierstore``); this one marks the function as dynamo's tracer
    reads it and disables it once dynamo is loaded (nothing compiles before)."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True  # the attribute torch.compiler.disable sets: dynamo does not inline the call
    return call


def as_leaf(module: nn.Module, args: Sequence) -> "torch.fx.Proxy | None":
    """Under torch.fx symbolic tracing (torch.fx, torchrec.fx): the module's call as one
    call_module node, a leaf of the graph, as TorchRec's tables appear in theirs (its rows
    live in a store, not in tensors a graph can hold). None when not tracing."""
    proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
    if proxy is None:
        return None
    path = proxy.tracer.path_of_module(module)
    if not path:
        raise ArgumentTypeError(f"torch.fx cannot trace a {type(module).__name__} by itself: its rows live in a TieredStore, "
                        "not in tensors. Trace the model that holds it, where it is a leaf (a call_module node)")
    return proxy.tracer.create_proxy("call_module", path, tuple(args), {})


def refuse_export(module: nn.Module) -> None:
    """torch.export captures tensors and ops; a store lookup is neither."""
    if torch.compiler.is_exporting():
        raise UnsupportedError(
            f"torch.export cannot capture {type(module).__name__}: its rows live in a TieredStore, outside any graph. "
            "Call its hold_resident() first (every row in the top tier: the lookup is then an op export captures), "
            "use torch.compile(model) instead (the dense layers compile; the lookup runs between the graphs), or "
            "export the dense part alone and feed it the pooled embeddings from this module or from "
            "tierstore.ServingEmbeddingBagCollection")


def module_store(store, path, specs: Sequence[TableSpec], **options) -> tuple[EmbeddingStore, bool]:
    """The store a module reads, and whether the module opened it (and so closes it).

    ``store`` is an open store, taken as it was opened: options for opening one
    (``path=``, ``hbm_rows=``, ...) are refused, not ignored. Or it is a
    :class:`~tierstore.StoreConfig`: the settings of the TieredStore the module opens at
    ``path`` (else the config's path), the drop-in keywords in ``options`` beside it (a
    keyword also set in the config must agree). Or None: the keywords alone."""
    if store is None or isinstance(store, StoreConfig):
        where = path if path is not None else getattr(store, "path", None)
        if where is None:
            raise SettingError("pass path= (a directory for a new or existing store), store=StoreConfig(path=..., ...) "
                             "(the settings of the store to open) or store= (an open TieredStore)")
        return TieredStore(where, tables=specs, config=store, **options), True
    if not isinstance(store, EmbeddingStore):
        raise ArgumentTypeError(f"store must be a tierstore.StoreConfig (settings for the store to open), or an open store: a "
                        f"TieredStore, or tierstore.open_store(path, daemon=SOCK)'s client; got {type(store).__name__}")
    given = [name for name, value in [("path", path), *options.items()] if value != _OPEN_DEFAULTS.get(name)]
    if given:  # the store's own path, device, tiers, memory budget, policy and trace apply
        raise SettingError(f"with store= an open store, its own settings apply: drop {'=, '.join(given)}= "
                         "(or pass store=StoreConfig(...) for a store the module opens; record a store's reads by "
                         "opening it with TieredStore(..., record_trace=PATH))")
    return store, False


# the values of the opening keywords that mean "not given"
_OPEN_DEFAULTS = {"policy": "lru", "hbm_rows": None, "ddr_rows": None}


class ScriptRefusal:
    """torch.jit.script would compile forward, which calls into the store (Python, threads, LMDB)."""

    def __prepare_scriptable__(self):
        raise UnsupportedError(
            f"torch.jit.script cannot compile {type(self).__name__}: its forward reads rows from a TieredStore in "
            "Python. Use torch.compile(model) (the dense layers compile, the lookup runs eagerly between the graphs); "
            "to script the dense part, script those submodules alone")


def _warn_untrained(bags: Sequence[TieredEmbeddingBag], training: bool) -> None:
    """Warn once per module when a forward that looks like training trains nothing: training
    mode, grad enabled, no optimizer, and nobody said the rows are frozen. Inference (eval(),
    no_grad(), a readonly store) and requires_grad_(False) are the explicit ways not to train."""
    if not training or not torch.is_grad_enabled():
        return
    idle = [b for b in bags if b.optimizer is None and not b._frozen and not b._warned_untrained
            and not b.store.readonly]
    if not idle:
        return
    for b in idle:
        b._warned_untrained = True
    names = ", ".join(repr(b.table) for b in idle)
    warnings.warn(
        f"TieredEmbeddingBag (table {names}) has no optimizer, so its output has no grad and backward() trains none "
        "of its rows. To train them pass optimizer=tierstore.optim.Adagrad(lr=...) (or SGD, RowWiseAdagrad, Adam); "
        "for inference call .eval() or run under torch.no_grad(); to keep them frozen while the rest of the model "
        "trains call .requires_grad_(False) on it", UserWarning, stacklevel=2)


def _check_spec(spec: TableSpec, num_embeddings, embedding_dim, optimizer) -> None:
    if spec.num_rows != num_embeddings or spec.dim != embedding_dim:
        raise SettingError(
            f"table {spec.name!r} has num_rows={spec.num_rows}, dim={spec.dim}; the module asks for "
            f"num_embeddings={num_embeddings}, embedding_dim={embedding_dim}"
        )
    if optimizer is not None and spec.state_dim != optimizer.state_dim(spec.dim):
        raise SettingError(
            f"table {spec.name!r} stores state_dim={spec.state_dim} per row but {optimizer!r} needs "
            f"{optimizer.state_dim(spec.dim)}; create the table with state_dim=optimizer.state_dim(dim)"
        )
