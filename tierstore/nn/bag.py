"""TieredEmbeddingBag: a torch module whose weights live in a TieredStore.

``TieredEmbeddingBag`` follows the torch.nn.EmbeddingBag contract; the store is
its parameter store (the module has no torch Parameters). A forward reads each
unique id once (with its optimizer state when training), pools the bags from
those rows, and keeps everything its backward needs in the autograd graph
(``ctx``): nothing is pinned in the store and nothing is pending, so a forward
without backward (evaluation, ``torch.no_grad()``) leaves no trace but the
cache's use counts, and several forwards may precede their backwards. The
backward computes the summed gradient of every touched row, applies the fused
optimizer step and writes the rows back in one ``store.write``.

Determinism: the gradient of a row is summed in an order that depends only on
the ids of the batch (that of torch.sort, which torch's own sparse gradients
use too), with kernels that use no atomics, and the update depends only on
row values, so training is bit-identical whatever the tier sizes and eviction
policy. On CPU the row gradients equal nn.EmbeddingBag(sparse=True)'s bit for
bit (sum or mean mode without per-sample weights); see tierstore.optim for how
each update compares with torch.optim's.

When every row of a forward is in the table's top tier, the bags are pooled
from the tier's weight matrix by slot and the backward updates the tier's rows
in place (index_add_): no row is copied out or back, and the result is the same
bit for bit as the general path's read, update and write.

The modules use the store through its public calls and ``store.trainer(table)``
(tierstore.engine.trainer.TableTrainer: the resident forward, the in-place update, the
rounding key, admission, re-reads and the count of backwards written); the bag
math they share with tierstore.distributed is tierstore.training.bags.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from tierstore.training import devstep, fbgemm
from tierstore.training.bags import MODES, Bags, EmbeddingBagConfig, plan_bags
from tierstore.training.checkpointing import FusedOptimizer, TableViews, check_loadable, load_views, table_views
from tierstore.engine.interface import EmbeddingStore
from tierstore.engine.trainer import DeviceRows
from tierstore.optim import RowOptimizer
from tierstore.spec import RowInit, TableSpec
from tierstore.store import Sizes, StoreConfig
from tierstore.errors import ArgumentTypeError, BadValuesError, SettingError, UnknownTableError, UnsupportedError
from tierstore.nn.common import ScriptRefusal, _check_spec, _warn_untrained, as_leaf, module_store, outside_graphs, refuse_export
from tierstore.nn.update import BagUpdates

_CHUNK_ROWS = 1 << 18  # from_pretrained writes in chunks of this many rows


class _Pooled:
    """What one module's backward needs of its forward in a group (_TieredBagFunction).
    ``weights``/``index`` are what the bags were pooled from: the unique rows read and
    each entry's position among them, or, when every row is resident in the top tier
    (``resident``), that tier's weight matrix and each entry's slot, so no row is copied."""

    __slots__ = ("owner", "bags", "train", "rows", "resident", "weights", "psw", "psw_shape", "max_idx", "writes")

    def __init__(self, owner: "TieredEmbeddingBag", bags: Bags, train: bool):
        self.owner, self.bags, self.train = owner, bags, train
        self.rows = self.resident = self.weights = self.psw = self.psw_shape = self.max_idx = None
        self.writes = 0


class _TieredBagFunction(torch.autograd.Function):
    """Pools the bags of a group of modules, one node of the graph for all of them (a
    collection's tables, a rank's shards: the graph's per-node cost is paid once); its
    backward runs each trained module's fused update, in the group's order.

    ``anchor`` is an empty tensor that requires grad when some module's rows are trained:
    it puts the function in the graph (the rows are not torch Parameters) and gets None
    back. ``members`` are (module, bags, whether it trains, whether its per-sample weights
    need a gradient) and ``psws`` those weights (or None): one output each, without grad
    where neither. Each
    module's rows are read and pooled in turn, as its own forward would (a resident
    forward holds its tier steady only while it pools).
    """

    @staticmethod
    def forward(ctx, anchor, members, *psws):
        ctx.set_materialize_grads(False)  # an output not used gets None: its module takes no step
        ctx.pooled, outs, frozen = [], [], []
        for (owner, bags, train, psw_grad), psw in zip(members, psws):
            p = _Pooled(owner, bags, train)
            outs.append(owner._pool(p, psw, psw_grad))
            ctx.pooled.append(p)
            if not (train or psw_grad):
                frozen.append(outs[-1])
        ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        grad_psws = []
        for i, (p, grad_out) in enumerate(zip(ctx.pooled, grad_outs)):
            grad_psw = None
            if grad_out is not None:
                grad_out = grad_out.contiguous()
                if ctx.needs_input_grad[2 + i]:  # never with a resident forward: see TieredEmbeddingBag._pool
                    grad_psw = p.bags.psw_grad(grad_out, p.weights, p.psw_shape)
                if p.train:
                    p.owner._update(p, grad_out)
            grad_psws.append(grad_psw)
        return None, None, *grad_psws


Group = Sequence[tuple["TieredEmbeddingBag", Bags, "torch.Tensor | None"]]  # (module, its bags, per-sample weights)


@outside_graphs  # torch.compile: a graph break; the dense layers around it compile
def forward_group(members: Group) -> tuple[torch.Tensor, ...]:
    """The host forward of several modules' bags planned already (tierstore.training.bags.
    jagged_bags: a KeyedJaggedTensor's, whose layout TorchRec checked), without forward's
    checks of the input: each module's pooled bags, as its own forward gives them, in one
    node of the autograd graph (see pool_group). TorchRec's sharded lookup runs it."""
    for bag, _, _ in members:
        refuse_export(bag)
    _warn_untrained([bag for bag, _, _ in members if bag.training], True)
    return pool_group(members)


def pool_group(members: Group) -> tuple[torch.Tensor, ...]:
    """Each module's pooled bags (planned already) as its own forward gives them, in one
    node of the autograd graph, whose backward updates each trained module's rows: the
    graph's cost per node is paid once for the group (a collection's tables, a rank's
    shards)."""
    if not members:
        return ()
    grad = torch.is_grad_enabled()
    group = tuple((bag, bags, bag.trains and grad, psw is not None and psw.requires_grad and grad) for bag, bags, psw in members)
    anchor = torch.empty(0, requires_grad=True) if any(m[2] for m in group) else None
    return _TieredBagFunction.apply(anchor, group, *(psw for _, _, psw in members))


class TieredEmbeddingBag(ScriptRefusal, BagUpdates, nn.Module):
    """torch.nn.EmbeddingBag over a TieredStore, with a fused row optimizer.

    ``TieredEmbeddingBag(num_embeddings, embedding_dim, mode=..., path=...,
    hbm_rows=..., ddr_rows=..., policy=..., device=..., optimizer=...)`` creates
    (or reopens) a store at ``path`` holding one table; ``store=StoreConfig(...)``
    gives the settings of that store (any of the config's fields, beside these
    keywords); ``store=``/``table=`` use a table of an open store instead. ``num_embeddings=None`` is an
    unbounded id space. ``record_trace=PATH`` records the store's reads as a
    trace for ``tierstore capacity`` (TieredStore's option).

    Without ``optimizer`` the rows are not trained: the output has no grad. That
    is for inference (``.eval()`` or ``torch.no_grad()``) or for rows kept frozen
    while the rest of a model trains (``.requires_grad_(False)``, as torch freezes
    a module); a forward in training mode with grad enabled and neither warns once.
    ``requires_grad_(False)`` freezes a module with an optimizer too.

    ``mode`` defaults to "mean" as in torch. Rows never written start as
    ``init`` (default N(0, 1), as torch), a pure function of (table, id, seed).
    A row's optimizer state is stored after its weights
    (``store.read(table, ids, with_state=True)``).
    """

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        *,
        mode: str = "mean",
        path: str | Path | None = None,
        store: EmbeddingStore | StoreConfig | None = None,
        table: str = "t0",
        hbm_rows: Sizes | None = None,
        ddr_rows: Sizes | None = None,
        policy: str = "lru",
        device: str | torch.device | None = None,
        optimizer: RowOptimizer | None = None,
        padding_idx: int | None = None,
        include_last_offset: bool = False,
        init: RowInit | None = None,
        dtype: str | None = None,
        max_norm: float | None = None,
        scale_grad_by_freq: bool = False,
        sparse: bool = True,
        kernels: str = "torch",
        memory_budget: int | str | None = None,
        record_trace: str | Path | None = None,
    ):
        super().__init__()
        if kernels not in ("torch", "fbgemm"):
            raise SettingError(f'kernels must be "torch" or "fbgemm" (FBGEMM\'s fused backward), got {kernels!r}')
        if max_norm is not None or scale_grad_by_freq:
            raise SettingError(
                "max_norm and scale_grad_by_freq are not supported by TieredEmbeddingBag; "
                "leave them at their defaults (None, False)"
            )
        del sparse  # the rows are always updated sparsely, by the fused optimizer
        if optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise ArgumentTypeError(
                f"optimizer must be a tierstore.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam), got {type(optimizer).__name__}; "
                "torch.optim optimizers cannot update rows that live in the store"
            )
        self.optimizer = optimizer
        self._rows = None  # hold_resident: the table's rows, as the device step uses them
        self._ahead = self._done = None  # resolve_ahead: batches resolved, not yet forwarded; forwarded, still pinned
        self._step = None  # resolve_ahead: (input, rows, slots) of the batch the loader handed out (begin_step)
        self._frozen = False  # requires_grad_(False)
        self._warned_untrained = False
        opening = store is None or isinstance(store, StoreConfig)
        if opening:
            cfg = EmbeddingBagConfig(num_embeddings, embedding_dim, mode, include_last_offset, padding_idx, table,
                                     init if init is not None else RowInit.normal(0.0, 1.0))
            state_dim = optimizer.state_dim(embedding_dim) if optimizer else 0
            spec = TableSpec(table, num_embeddings, embedding_dim, dtype=dtype or "float32", init=cfg.init, state_dim=state_dim)
        store, self._owns_store = module_store(store, path, [spec] if opening else None, hbm_rows=hbm_rows, ddr_rows=ddr_rows,
                                               policy=policy, device=device, memory_budget=memory_budget,
                                               record_trace=record_trace)
        if not opening:
            spec = store.tables.get(table)
            if spec is None:
                raise UnknownTableError(
                    f"store {store.path} has no table {table!r} (it has {sorted(store.tables)}); open the store with "
                    f"tables=[TableSpec({table!r}, num_rows, dim, state_dim=optimizer.state_dim(dim))], "
                    "or use TieredEmbeddingBagCollection"
                )
            cfg = EmbeddingBagConfig(num_embeddings, embedding_dim, mode, include_last_offset, padding_idx, table, spec.init)
            _check_spec(spec, num_embeddings, embedding_dim, optimizer)
            if init is not None and init != spec.init:
                raise SettingError(f"init={init!r} contradicts table {table!r}'s stored init {spec.init!r}")
            if dtype is not None and dtype != spec.dtype:
                raise SettingError(f"dtype={dtype!r} contradicts table {table!r}'s dtype {spec.dtype!r}; drop dtype= to use the table's")
        if kernels == "fbgemm":
            try:
                fbgemm.check(optimizer, cfg.mode, spec.dtype, store.device)
            except Exception:
                if self._owns_store:
                    store.close()
                raise
        self.kernels = kernels
        self.dtype = spec.dtype  # of the stored weights; forward returns float32
        self.config = cfg
        self.store = store
        self.table = table
        if cfg.padding_idx is not None and not store.readonly:
            # torch starts the padding row at zero; it is never read or updated by forward/backward
            store.write(table, [cfg.padding_idx], torch.zeros(1, embedding_dim))

    # -- torch.nn.EmbeddingBag-like surface ----------------------------------------------
    @property
    def num_embeddings(self) -> int | None:
        return self.config.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.config.embedding_dim

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def padding_idx(self) -> int | None:
        return self.config.padding_idx

    @property
    def include_last_offset(self) -> bool:
        return self.config.include_last_offset

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        **kwargs,
    ) -> "TieredEmbeddingBag":
        """Like nn.EmbeddingBag.from_pretrained: every row of ``embeddings`` is
        written to the store (optimizer state zero). ``freeze`` defaults to
        "no optimizer given"; freeze=True trains nothing."""
        if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
            raise BadValuesError("Embeddings parameter is expected to be 2-dimensional")
        optimizer = kwargs.get("optimizer")
        if freeze is None:
            freeze = optimizer is None
        if freeze and optimizer is not None:
            raise SettingError("freeze=True with an optimizer: drop optimizer= to freeze the rows, or pass freeze=False to train them")
        if not freeze and optimizer is None:
            raise SettingError("freeze=False needs optimizer= (a tierstore.optim optimizer) to update the rows")
        n, dim = embeddings.shape
        module = cls(n, dim, mode=mode, max_norm=max_norm, scale_grad_by_freq=scale_grad_by_freq,
                     include_last_offset=include_last_offset, padding_idx=padding_idx, **kwargs)
        module.requires_grad_(not freeze)
        width = module.store.tables[module.table].width
        src = embeddings.detach().to("cpu", torch.float32)
        for lo in range(0, n, _CHUNK_ROWS):
            hi = min(n, lo + _CHUNK_ROWS)
            rows = torch.zeros((hi - lo, width))
            rows[:, :dim] = src[lo:hi]
            module.store.write(module.table, torch.arange(lo, hi), rows, with_state=True)
        return module

    def requires_grad_(self, requires_grad: bool = True) -> "TieredEmbeddingBag":
        """Like torch's: ``False`` freezes the rows (the output has no grad, backward updates
        none of them); ``True`` trains them again, which needs ``optimizer=``."""
        if requires_grad and self.optimizer is None:
            raise SettingError("requires_grad_(True) needs an optimizer: create the module with optimizer= "
                             "(a tierstore.optim optimizer) to train its rows")
        self._frozen = not requires_grad
        return self

    @property
    def trains(self) -> bool:
        """Whether a forward with grad enabled trains the rows (an optimizer, not frozen)."""
        return self.optimizer is not None and not self._frozen

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        leaf = as_leaf(self, (input, offsets, per_sample_weights))
        if leaf is not None:
            return leaf
        if self._on_device(input, offsets, per_sample_weights):
            return self._device_forward(input, offsets)
        step = self._step  # handed out by the loader (begin_step): only its slots left to use, no host part
        if step is not None and step[0] is input and self._device_input(input, offsets, per_sample_weights):
            return self._device_forward(input, offsets, step[1], step[2])
        if self._ahead is not None and self._device_input(input, offsets, per_sample_weights):
            return self._resolved_forward(input, offsets)
        return self._host_forward(input, offsets, per_sample_weights)

    def hold_resident(self) -> "TieredEmbeddingBag":
        """Keep every row of the table in the store's top tier (bringing them there now),
        so that each step is the device step (tierstore.training.devstep): two custom ops,
        no host sync, compiled by ``torch.compile(fullgraph=True)`` and captured by
        ``torch.export`` as leaves. Needs a top tier of at least ``num_embeddings`` rows,
        float32 rows, sum or mean pooling, no padding_idx, kernels="torch" and an additive
        optimizer (SGD, Adagrad, RowWiseAdagrad). Steps with per-sample weights or 2-D
        input, and any step once rows have left the tier (``store.evict``), take the host
        path; the held table's steps are not counted in the store's hit counts."""
        self._check_device_step("hold_resident")
        self._rows = self.store.trainer(self.table).hold_resident()
        self._anchor = torch.empty(0, device=self._rows.weights.device, requires_grad=True)
        devstep.warm(self.optimizer, self.embedding_dim, self._anchor.device)
        return self

    def resolve_ahead(self) -> "TieredEmbeddingBag":
        """The device step over a cache, for a table larger than its top tier: each batch's
        rows are brought into the top tier by the host ahead of its step (``resolve_batch``:
        what LookaheadLoader calls ``depth`` batches ahead; with depth 0 or no loader the
        forward resolves its own batch first), pinned there until the step is done (until
        the loader hands out the next batch, or the next forward without a loader), and the
        step itself is the device step on their slots. The conditions of ``hold_resident``,
        and the forward gets the batch's own ids tensor (the module moves it to the device)."""
        self._check_device_step("resolve_ahead")
        self._ahead, self._done = deque(), []
        self._anchor = torch.empty(0, device=self.store.device, requires_grad=True)
        devstep.warm(self.optimizer, self.embedding_dim, self._anchor.device)
        return self

    def resolve_batch(self, batch) -> None:
        """Resolve the rows of a later forward's ``batch`` (``(input, offsets)``, as forward
        takes them) now: checked, brought into the top tier and pinned (resolve_ahead)."""
        if self._ahead is None:
            raise SettingError(f"table {self.table!r} resolves no batch ahead: call resolve_ahead() first")
        input, offsets = batch[0], batch[1]
        self._plan(input, offsets, None)  # a bad batch is refused now, naming the problem
        self._ahead.append(self._resolve(input))

    @property
    def holds_resident(self) -> bool:
        """Whether every row is held in the top tier for the device step (hold_resident),
        and still is (rows leave it only by ``store.evict``)."""
        return self._rows is not None and self._rows.valid()

    @property
    def resolves_ahead(self) -> bool:
        """Whether the steps run on the device over a cache (resolve_ahead)."""
        return self._ahead is not None

    def begin_step(self, batch) -> None:
        """``batch`` (resolved ahead by ``resolve_batch``) is handed out for its step: its
        rows and slots are set aside, on the host, for the forward of its ids tensor, which
        then only pools from the slots (under torch.compile, no graph break). What
        LookaheadLoader calls as it yields a batch; a batch not resolved ahead is left to its
        forward, which resolves it then."""
        input = batch[0]
        if not self._ahead or self._ahead[0][0] is not input:
            return
        self._step = (input, *self._in_flight(self._ahead.popleft()))

    def release_steps(self) -> None:
        """The steps forwarded so far are done: their rows may leave the top tier again."""
        self._step = None
        trainer = self.store.trainer(self.table)
        for _, _, pins in self._done or ():
            trainer.release(pins)
        self._done = [] if self._done is not None else None

    def _resolve(self, input: torch.Tensor):
        hit, pins = self.store.trainer(self.table).resolve(torch.as_tensor(input).reshape(-1))
        return input, hit, pins

    def _check_device_step(self, call: str) -> None:
        why = [what for what, bad in (
            ("mode='max'", self.config.mode == "max"), ("padding_idx", self.config.padding_idx is not None),
            (f"dtype={self.dtype!r}", self.dtype != "float32"), ("kernels='fbgemm'", self.kernels != "torch"),
            (f"optimizer={self.optimizer!r}", self.optimizer is not None and not self.optimizer.additive)) if bad]
        if why:
            raise UnsupportedError(f"table {self.table!r} cannot take the device step with {', '.join(why)}; "
                                   f"keep the host step (do not call {call})")

    @staticmethod
    def _device_input(input, offsets, per_sample_weights) -> bool:
        return per_sample_weights is None and isinstance(input, torch.Tensor) and input.dim() == 1 \
            and isinstance(offsets, torch.Tensor)

    def _on_device(self, input, offsets, per_sample_weights) -> bool:
        """Whether this forward is the held device step: held rows, still in place, 1-D ids and offsets."""
        return self.holds_resident and self._device_input(input, offsets, per_sample_weights)

    def _steps_on_device(self, input, offsets, per_sample_weights) -> bool:
        """Whether this forward is a device step, held or resolved."""
        return self._on_device(input, offsets, per_sample_weights) or \
            (self._ahead is not None and self._device_input(input, offsets, per_sample_weights))

    def _device_forward(self, input: torch.Tensor, offsets: torch.Tensor, rows=None, slots=None) -> torch.Tensor:
        rows = self._rows if rows is None else rows
        device = rows.weights.device
        # an exported program is the forward alone: its update needs the store, not a graph
        train = self.trains and torch.is_grad_enabled() and not torch.compiler.is_exporting()
        # a batch from the host goes up without waiting (torch stages a pageable source itself)
        ids, offsets = (t.to(device, non_blocking=t.device.type == "cpu") for t in (input, offsets))
        return devstep.device_step(rows, ids, slots, offsets, self.config.mode,
                                   self.config.include_last_offset, self.optimizer, self._anchor if train else None)

    @outside_graphs  # the host's part (which batch, its slots) is Python: a graph break
    def _resolved_forward(self, input: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self._ahead and self._ahead[0][0] is input:
            entry = self._ahead.popleft()
        else:  # not resolved ahead (depth 0, no loader, or not the batch announced): resolve it now
            self._done.extend(self._ahead)  # announced, never to be forwarded: released with the steps done
            self._ahead.clear()
            self.release_steps()
            self._plan(input, offsets, None)
            entry = self._resolve(input)
        return self._device_forward(input, offsets, *self._in_flight(entry))

    def _in_flight(self, entry) -> tuple[DeviceRows, torch.Tensor]:
        """A resolved batch's step begins: its rows (pinned until release_steps) and slots."""
        self._done.append(entry)
        hit = entry[1]
        return DeviceRows(hit.tier, hit.generation, hit.tier.weights, hit.tier.state, hit.tier.dirty, None), hit.slots

    @outside_graphs  # torch.compile: a graph break; the dense layers around it compile
    def _host_forward(self, input, offsets, per_sample_weights) -> torch.Tensor:
        refuse_export(self)
        bags = self._plan(input, offsets, per_sample_weights)  # validates before the store is touched
        _warn_untrained([self], self.training)
        return self._run(bags, per_sample_weights)

    def forward_bags(self, bags: Bags, per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The host forward of bags planned already (forward_group's, for one module)."""
        return forward_group(((self, bags, per_sample_weights),))[0]

    def batch_reads(self, batch) -> dict[str, torch.Tensor]:
        """The ids a batch in forward's input form (``input`` or ``(input, offsets[, ...])``)
        reads, by table: what LookaheadLoader prefetches."""
        return {self.table: torch.as_tensor(batch[0] if isinstance(batch, (tuple, list)) else batch).reshape(-1)}

    def prefetch(self, input: torch.Tensor, offsets: torch.Tensor | None = None):
        """Start bringing up the rows a later ``forward(input, offsets)`` reads; returns at
        once with a tierstore.PrefetchTicket (``wait()`` raises a failure, such as a bad id)."""
        ids = torch.as_tensor(input).reshape(-1)
        # ids on the meta device have no values to mask: the store refuses them, on the ticket
        if self.config.padding_idx is not None and ids.device.type != "meta":
            ids = ids[ids != self.config.padding_idx]
        return self.store.prefetch(self.table, ids)

    def close(self) -> None:
        """Close the store if this module opened it (flushes every row)."""
        if self._owns_store:
            self.store.close()

    def reset_parameters(self) -> None:
        """Every row back to its initial value with zero optimizer state, as nn.EmbeddingBag's
        re-initializes its weight: the table's rows are deleted (they read as ``init`` again)."""
        self.store.flush()  # every row is then in LMDB, where stored_ids sees it
        ids = self.store.stored_ids(self.table)
        for lo in range(0, len(ids), _CHUNK_ROWS):
            self.store.evict(self.table, ids[lo: lo + _CHUNK_ROWS])
        if self.config.padding_idx is not None:
            self.store.write(self.table, [self.config.padding_idx], torch.zeros(1, self.embedding_dim))

    # -- checkpoints (tierstore.training.checkpointing) ------------------------------------------------
    def views(self) -> TableViews:
        """The table's rows and optimizer state as TableViews (what state_dict() and
        fused_optimizer.state_dict() hold)."""
        return table_views(self.store, self.table, self.num_embeddings, self.embedding_dim, self.dtype, self.optimizer)

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        """The fused optimizer's state, keyed as TorchRec's fused optimizers key theirs:
        ``{"state": {"weight": {"<table>.momentum1": ...}}}``."""
        state = self.views().state
        return FusedOptimizer(self.optimizer, {"weight": state} if state else {})

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.views().weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        self._load_weight(state_dict, prefix + "weight", missing_keys, unexpected_keys, error_msgs)

    def _load_weight(self, state_dict, key: str, missing_keys, unexpected_keys, error_msgs) -> None:
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        views = {key: self.views().weight}
        load_views(views, check_loadable(views, state_dict, missing_keys, error_msgs))

    def extra_repr(self) -> str:
        c = self.config
        s = f"{c.num_embeddings}, {c.embedding_dim}, mode={c.mode!r}, table={c.table!r}, store={str(self.store.path)!r}"
        if c.padding_idx is not None:
            s += f", padding_idx={c.padding_idx}"
        if c.include_last_offset:
            s += ", include_last_offset=True"
        return s + f", optimizer={self.optimizer!r}"

    # -- the data path -------------------------------------------------------------------
    def _plan(self, input, offsets, per_sample_weights) -> Bags:
        return plan_bags(self.config, input, offsets, per_sample_weights)

    def _run(self, bags: Bags, per_sample_weights) -> torch.Tensor:
        return pool_group(((self, bags, per_sample_weights),))[0]

    def _pool(self, p: _Pooled, per_sample_weights: torch.Tensor | None, psw_grad: bool) -> torch.Tensor:
        """This module's part of a group's forward (_TieredBagFunction): reads or finds its
        rows, pools its bags, and keeps in ``p`` what its backward needs."""
        bags = p.bags
        # Pool straight from the top tier's weights, once every row is there (the
        # backward then updates them in place). Not for max pooling (its backward
        # indexes the rows read) nor per-sample weights that need a gradient (it
        # reads the rows as the forward saw them).
        if self.config.mode != "max" and not psw_grad:
            with self.store.trainer(self.table).resident(bags.ids, admit=True) as hit:
                if hit is not None:
                    bags.admitted = self._admitted_rows(bags) if p.train else None
                    weights, index = hit.tier.weights, hit.slots
                    # pool in float32, as from rows read: FBGEMM sums float16 rows so in place;
                    # else the batch's rows are gathered once and upcast
                    fbgemm_sums = weights.dtype == torch.float16 and self.config.mode == "sum" and \
                        weights.device.type == "cpu" and fbgemm.installed()
                    if weights.dtype != torch.float32 and not fbgemm_sums:
                        weights = weights.index_select(0, hit.slots.index_select(0, bags.rows.firsts().to(hit.slots.device))).to(torch.float32)
                        index = bags.rows.positions()
                    p.resident = hit if p.train else None
                    return self._pool_from(p, weights, index, per_sample_weights)
        rows = self.store.read(self.table, bags.rows.uid, with_state=p.train)
        bags.admitted = self._admitted_rows(bags) if p.train else None
        dim = self.config.embedding_dim
        weights = rows if rows.shape[1] == dim else rows[:, :dim].contiguous()
        if weights is rows and p.train and psw_grad:
            weights = rows.clone()  # the update must not alter what the per-sample-weight gradient reads
        p.rows, p.weights = rows if p.train else None, weights
        return self._pool_from(p, weights, bags.rows.positions(), per_sample_weights)

    def _pool_from(self, p: _Pooled, weights: torch.Tensor, index: torch.Tensor, per_sample_weights) -> torch.Tensor:
        if per_sample_weights is not None:
            p.psw = p.bags.select(per_sample_weights.reshape(-1).to(weights.device))
            p.psw_shape = per_sample_weights.shape
        out, p.max_idx = p.bags.pool(weights, index, MODES[self.config.mode], p.psw)
        p.writes = self.store.trainer(self.table).written  # a backward written after this one's read: re-read
        return out

    def _update(self, p: _Pooled, grad_out: torch.Tensor) -> None:
        """This module's part of a group's backward: the fused update of its rows."""
        if p.resident is not None:
            self._backward_in_place(p.bags, p.resident, grad_out, p.psw)
        else:
            rows, p.rows = p.rows, None  # a failed or repeated backward re-reads
            self._backward_from_rows(p.bags, grad_out, p.psw, p.max_idx, rows, p.writes)

    def _admitted_rows(self, bags: Bags) -> torch.Tensor | None:
        """After the forward's read: which rows its backward may update (admit_after)."""
        if self.store.spec(self.table).admit_after == 1:
            return None
        mask = self.store.trainer(self.table).admitted(bags.rows.uid)
        return None if mask is None or bool(mask.all()) else mask
