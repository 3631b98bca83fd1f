"""Tables in ``state_dict()`` and ``torch.distributed.checkpoint`` (DCP), read and written in chunks.

A module's table appears in its ``state_dict()`` as a ``TableView``: a tensor of
the table's shape with no storage of its own. Like the key-value tables of
TorchRec (FBGEMM's KVTensorWrapper behind a ShardedTensor), it hands DCP its
rows a chunk at a time (``CHUNK_BYTES``): DCP's save reads each chunk from the
store as it writes it, and DCP's load copies each chunk it reads straight
into the store, so neither holds more than a chunk of a table in memory. A
sharded collection's views hold this rank's shard only (DCP reshards on load).

Any other use of a view (``torch.save``, ``deepcopy``, ``torch.equal``,
``.clone()``) gives a plain tensor of the rows, read whole, up to
``MAX_MATERIALIZE_BYTES``; a larger table raises ``TableTooLargeError``
naming the DCP call instead (never a partial copy). Writing into a view
(``copy_``, what ``load_state_dict`` and DCP's load do) changes only the rows
whose bits differ, and a row given its initial value and zero optimizer state
is deleted rather than stored: a fresh store loaded from a checkpoint holds the
rows that were trained, not every row of the id space.

Optimizer state: ``module.fused_optimizer.state_dict()`` is
``{"state": {"<param key>": {"<table>.momentum1": view, ...}}}``, the keys of
TorchRec's fused optimizers (row-wise Adagrad's ``momentum1`` is [num_rows],
Adagrad's [num_rows, dim]; Adam adds ``exp_avg_sq`` and its per-row ``step``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map


from tierstore.errors import BadValuesError, SettingError, TierstoreError, UnsupportedError
from tierstore.optim import Adam, RowOptimizer
from tierstore.precision import DTYPES
from tierstore.spec import initial_rows

__all__ = ["CHUNK_BYTES", "MAX_MATERIALIZE_BYTES", "FusedOptimizer", "OptimizerMismatchError", "TableTooLargeError",
           "TableView"]

CHUNK_BYTES = 64 << 20  # a DCP chunk of a table (one item in its files)
IO_BYTES = 8 << 20  # stored rows read or written by one store call: the store's transients (e.g. initial
# values made in float64 for rows never written) are several times this
MAX_MATERIALIZE_BYTES = 1 << 30  # a view larger than this is refused as one tensor (torch.save, clone, ...)

_DCP_HINT = ("torch.distributed.checkpoint.save(model.state_dict(), checkpoint_id=DIR) and, to restore, "
             "sd = model.state_dict(); torch.distributed.checkpoint.load(sd, checkpoint_id=DIR); model.load_state_dict(sd)")


class TableTooLargeError(RuntimeError, TierstoreError):
    """A table asked for as one in-memory tensor that is larger than MAX_MATERIALIZE_BYTES."""


class OptimizerMismatchError(ValueError, TierstoreError):
    """Optimizer state saved by one kind of optimizer, loaded into a module trained by another."""


@dataclass(frozen=True)
class Block:
    """Rows [r0, r1) and columns [c0, c1) of a view that this process's store holds;
    view column c0 is stored column ``base`` (a 1-D view has the one column [0, 1))."""

    r0: int
    r1: int
    c0: int
    c1: int
    base: int
    saves: bool = True  # DCP's save writes it from here (one column shard saves a row's shared state)
    shift: int = 0  # view row r is the store's row r - shift (a column shard's per-row state, TorchRec's layout)
    store: object = None  # the store holding it, where not the view's (a rank's shards of a table in several stores)


def state_layout(optimizer: RowOptimizer | None) -> tuple[int, int]:
    """(per-column state segments, per-row state values) of a row: state_dim(dim) = a * dim + b,
    stored as the a column segments then the b row values (Adagrad 1, 0; row-wise Adagrad 0, 1;
    Adam 2, 1: m, v, then the step count)."""
    if optimizer is None:
        return 0, 0
    a = optimizer.state_dim(2) - optimizer.state_dim(1)
    return a, optimizer.state_dim(1) - a


def state_names(optimizer: RowOptimizer | None) -> tuple[list[str], list[str]]:
    """Names of the column segments and row values of the state, as TorchRec's fused optimizers name them."""
    a, b = state_layout(optimizer)
    if isinstance(optimizer, Adam):
        return ["momentum1", "exp_avg_sq"], ["step"]
    return [f"momentum{j + 1}" for j in range(a)], [f"momentum{a + j + 1}" for j in range(b)]


class TableView(torch.Tensor):
    """Rows of a store's table (weights or one optimizer state) as a tensor without storage.

    ``shape`` is the whole table's, ``blocks`` what this process's ``store`` holds of it.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, store, table: str, what: str, shape: Sequence[int], dtype: torch.dtype,
                blocks: Sequence[Block], region: tuple[tuple[int, int], ...] | None = None):
        region = region or tuple((0, n) for n in shape)
        view = torch.Tensor._make_wrapper_subclass(cls, [hi - lo for lo, hi in region], dtype=dtype, device="cpu")
        view._store, view._table, view._what, view._full = store, table, what, tuple(shape)
        view._blocks, view._region, view._saving = tuple(blocks), region, False
        return view

    def _with(self, region) -> "TableView":
        return TableView(self._store, self._table, self._what, self._full, self.dtype, self._blocks, tuple(region))

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"TableView({self._what} of table {self._table!r}, size={tuple(self.shape)}, dtype={self.dtype})"

    @property
    def _cols(self) -> int:
        return self._full[1] if len(self._full) == 2 else 1

    def _pieces(self):
        """(block, rows [a, b), columns [c, d)) of each block within the region."""
        (R0, R1), (C0, C1) = self._region[0], (self._region[1] if len(self._full) == 2 else (0, 1))
        for blk in self._blocks:
            a, b, c, d = max(R0, blk.r0), min(R1, blk.r1), max(C0, blk.c0), min(C1, blk.c1)
            if a < b and c < d:
                yield blk, a, b, c, d

    def _chunk_rows(self) -> int:
        return max(1, CHUNK_BYTES // (self._cols * 4))

    def _store_of(self, blk: Block):
        return self._store if blk.store is None else blk.store

    def _io_rows(self, blk: Block) -> int:
        return max(1, IO_BYTES // (self._store_of(blk).tables[self._table].width * 4))

    def _read(self, blk: Block, a: int, b: int, c: int, d: int) -> torch.Tensor:
        rows = self._store_of(blk).peek(self._table, torch.arange(a - blk.shift, b - blk.shift), with_state=True)
        part = rows[:, blk.base + c - blk.c0: blk.base + d - blk.c0].to(self.dtype)
        return part if len(self._full) == 2 else part.reshape(-1)

    def materialize(self, limit: int | None = None) -> torch.Tensor:
        """The region's rows as a plain tensor (read whole: at most ``limit`` bytes,
        MAX_MATERIALIZE_BYTES by default)."""
        limit = MAX_MATERIALIZE_BYTES if limit is None else limit
        size = self.numel() * self.element_size()
        if size > limit:
            raise TableTooLargeError(
                f"{self._what} of table {self._table!r} is {size / 2**20:.1f} MiB, more than "
                f"tierstore.training.checkpointing.MAX_MATERIALIZE_BYTES ({limit / 2**20:.1f} MiB) allows as one tensor "
                f"(torch.save, deepcopy, clone, ...). Save it in chunks with {_DCP_HINT}")
        out = torch.empty(self.shape, dtype=self.dtype)
        flat = out if out.dim() == 2 else out.unsqueeze(1)
        R0, C0 = self._region[0][0], (self._region[1][0] if len(self._full) == 2 else 0)
        covered = 0
        for blk, a, b, c, d in self._pieces():
            step = self._io_rows(blk)
            for lo in range(a, b, step):
                hi = min(b, lo + step)
                flat[lo - R0: hi - R0, c - C0: d - C0] = self._read(blk, lo, hi, c, d).reshape(hi - lo, d - c)
            covered += (b - a) * (d - c)
        if covered != out.numel():
            raise UnsupportedError(
                f"{self._what} of table {self._table!r} is sharded: this rank holds {covered} of its {out.numel()} values. "
                f"Save and load a sharded collection with {_DCP_HINT} (every rank calls them)")
        return out

    def write(self, src: torch.Tensor) -> None:
        """Copy ``src`` (the region's shape) into the store's rows, a chunk at a time."""
        if tuple(src.shape) != tuple(self.shape):
            raise BadValuesError(f"{self._what} of table {self._table!r} has shape {tuple(self.shape)}; "
                             f"the tensor to load has shape {tuple(src.shape)}")
        if isinstance(src, TableView) and src._store is self._store and src._table == self._table \
                and src._what == self._what and src._region == self._region:
            return  # the rows themselves: DCP's load wrote them already
        R0, C0 = self._region[0][0], (self._region[1][0] if len(self._full) == 2 else 0)
        for blk, a, b, c, d in self._pieces():
            spec = self._store_of(blk).tables[self._table]
            step = self._io_rows(blk)
            for lo in range(a, b, step):
                hi = min(b, lo + step)
                part = src[lo - R0: hi - R0]
                if src.dim() == 2:
                    part = part[:, c - C0: d - C0]
                if isinstance(part, TableView):
                    part = part.materialize(limit=IO_BYTES * 8)
                self._put(spec, blk, lo, hi, c, part.reshape(hi - lo, d - c))

    def _put(self, spec, blk: Block, lo: int, hi: int, c: int, part: torch.Tensor) -> None:
        """Set columns of rows [lo, hi): rows whose bits change are written, or deleted
        when they become their initial value with zero state."""
        ids = torch.arange(lo - blk.shift, hi - blk.shift)
        store = self._store_of(blk)
        old = store.peek(self._table, ids, with_state=True)
        new = old.clone()
        at = blk.base + c - blk.c0
        new[:, at: at + part.shape[1]] = part.to(torch.float32)
        if spec.dtype != "float32":  # the stored precision: compare what would be stored
            new[:, :spec.dim] = new[:, :spec.dim].to(DTYPES[spec.dtype]).to(torch.float32)
        changed = (new.view(torch.int32) != old.view(torch.int32)).any(1)
        if not bool(changed.any()):
            return
        # a row back at its initial value: its first column is, which costs 1/dim of the whole row's
        first = torch.from_numpy(initial_rows(dataclasses.replace(spec, dim=1, state_dim=0), ids.numpy()))
        maybe = torch.nonzero(changed & (new[:, :1].view(torch.int32) == first.view(torch.int32)).squeeze(1)).squeeze(1)
        to_init = torch.zeros(len(ids), dtype=torch.bool)
        if len(maybe):
            init = torch.from_numpy(initial_rows(spec, ids[maybe].numpy()))
            to_init[maybe] = (new[maybe].view(torch.int32) == init.view(torch.int32)).all(1)
        if bool(to_init.any()):
            store.evict(self._table, ids[to_init])
        keep = changed & ~to_init
        if bool(keep.any()):
            store.write(self._table, ids[keep], new[keep], with_state=True)

    # -- torch.distributed.checkpoint (its _Checkpointable protocol, as DTensor's) -------------
    def _chunks(self, saving: bool) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of this process's chunks: blocks split by rows."""
        out = []
        for blk in self._blocks:
            if saving and not blk.saves:
                continue
            step = self._chunk_rows()
            for lo in range(blk.r0, blk.r1, step):
                hi = min(blk.r1, lo + step)
                if len(self._full) == 2:
                    out.append(((lo, blk.c0), (hi - lo, blk.c1 - blk.c0)))
                else:
                    out.append(((lo,), (hi - lo,)))
        return out

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        self._saving = True  # __get_tensor_shard__ now serves DCP's save: chunks read from the store
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(size)),
                                                      properties=TensorProperties(dtype=self.dtype),
                                                      size=torch.Size(self._full)))
                for off, size in self._chunks(saving=True)]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        self._saving = False  # DCP's load: chunks are views its reads copy into
        return [ChunkStorageMetadata(torch.Size(off), torch.Size(size)) for off, size in self._chunks(saving=False)]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for off, size in self._chunks(saving=self._saving):
            if tuple(index.offset) == off:
                view = self._with(tuple((o, o + s) for o, s in zip(off, size)))
                return view.materialize(limit=2 * CHUNK_BYTES) if self._saving else view
        raise BadValuesError(f"{self._what} of table {self._table!r} has no chunk at {tuple(index.offset)} on this process")

    # -- everything else sees a plain tensor ------------------------------------------------------
    def __reduce_ex__(self, protocol):
        return self.materialize().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self.materialize()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._with(args[0]._region)
        if func is aten.slice.Tensor and (len(args) < 5 or args[4] == 1):
            view, dim = args[0], args[1] if len(args) > 1 else 0
            dim = dim % view.dim()
            lo, hi = view._region[dim]
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            stop = args[3] if len(args) > 3 and args[3] is not None else hi - lo
            start, stop = (max(0, min(hi - lo, x + (hi - lo if x < 0 else 0))) for x in (start, stop))
            region = list(view._region)
            region[dim] = (lo + start, lo + max(start, stop))
            return view._with(region)
        if func is aten.copy_.default and isinstance(args[0], TableView):
            args[0].write(args[1])
            return args[0]
        written = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        if any(isinstance(a, TableView) for a in written):
            raise UnsupportedError(f"{func} would change a copy of the rows, not the table: load rows with "
                               "module.load_state_dict(...) or write them with store.write(table, ids, rows)")
        plain = lambda x: x.materialize() if isinstance(x, TableView) else x  # noqa: E731
        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


class FusedOptimizer:
    """The optimizer state of tables trained by a fused row optimizer, keyed as
    TorchRec's fused optimizers key theirs. ``step()`` and ``zero_grad()`` do nothing
    (the update runs in the backward); ``state_dict()``/``load_state_dict()`` save and
    restore the state (with DCP as well: its values are TableViews)."""

    def __init__(self, optimizer: RowOptimizer | None, state: Mapping[str, Mapping[str, TableView]]):
        self.optimizer = optimizer
        self.state = {k: dict(v) for k, v in state.items()}

    def state_dict(self) -> dict:
        return {"state": {k: dict(v) for k, v in self.state.items()}, **optimizer_record(self.optimizer)}

    def load_state_dict(self, state_dict: Mapping) -> None:
        check_optimizer_record(self.optimizer, state_dict)
        new = state_dict.get("state") if isinstance(state_dict, Mapping) else None
        if new is None or set(new) != set(self.state):
            got = sorted(new) if isinstance(new, Mapping) else new
            raise OptimizerMismatchError(f"optimizer state for {sorted(self.state)} expected, got {got}")
        for key, views in self.state.items():
            if set(new[key]) != set(views):
                raise OptimizerMismatchError(f"optimizer state of {key!r} has {sorted(views)}; the state to load has {sorted(new[key])}")
        for key, views in self.state.items():  # checked first: nothing is written unless every shape fits
            for name, view in views.items():
                if tuple(new[key][name].shape) != tuple(view.shape):
                    raise BadValuesError(f"optimizer state {key!r}/{name!r} has shape {tuple(view.shape)}; "
                                     f"the state to load has {tuple(new[key][name].shape)}")
        with torch.no_grad():
            for key, views in self.state.items():
                for name, view in views.items():
                    view.write(new[key][name])

    def step(self, closure=None) -> None:
        """Nothing: the rows were updated by the backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the rows have no .grad."""


def optimizer_record(optimizer: RowOptimizer | None) -> dict:
    """What an optimizer's state_dict() says of the optimizer that made the state:
    ``{"optimizer": {"<kind>": "<its repr>"}}`` (nothing without an optimizer).

    Adam's first moment has the key and shape of Adagrad's sum of squares (TorchRec's
    names: both ``<table>.momentum1``), so keys and shapes alone let one load as the
    other. The kind is a key, not a value, so that DCP's load planner, which matches a
    state dict's keys against the checkpoint's before it reads any row, refuses the
    state of another kind ("Missing key ... optimizer.<kind>") with nothing written; the
    hyperparameters are a value, informative only (another lr is the same state)."""
    return {} if optimizer is None else {"optimizer": {type(optimizer).__name__: repr(optimizer)}}


def check_optimizer_record(optimizer: RowOptimizer | None, state_dict: object) -> None:
    """Raise OptimizerMismatchError if ``state_dict`` says another kind of optimizer made it.
    A state dict without the record (TorchRec's own, or older) is taken on its keys and shapes."""
    saved = state_dict.get("optimizer") if isinstance(state_dict, Mapping) else None
    if optimizer is None or not isinstance(saved, Mapping) or type(optimizer).__name__ in saved:
        return
    made_by = ", ".join(str(v) for v in saved.values()) or "an unnamed optimizer"
    raise OptimizerMismatchError(
        f"the optimizer state was saved by {made_by}; this module trains with {optimizer!r}, which would read that "
        "state as its own (another optimizer's moments as its sums of squares). Load it into a module with the "
        "optimizer it was saved by, or load the model's state_dict() alone to start this optimizer afresh")


@dataclass(frozen=True)
class TableViews:
    """A table's weight view and its optimizer state views, by TorchRec's state names."""

    weight: TableView
    state: dict[str, TableView]


def table_views(store, table: str, num_rows: int | None, dim: int, dtype: str, optimizer: RowOptimizer | None,
                rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                col_shard: tuple[int, int] | None = None) -> TableViews:
    """Views of ``table`` in ``store``, which holds rows ``rows`` and columns ``cols`` of it
    (a shard; default all), for a table of ``num_rows`` x ``dim`` trained by ``optimizer``.

    A row's per-row state (row-wise Adagrad's accumulator) is one value, saved by the shard
    at column 0, unless ``col_shard`` = (k, n) says that each of the table's n column shards
    keeps its own, this shard being the k-th by column: then the state is [num_rows x n] with
    this shard's at rows k x num_rows on, as TorchRec lays out a column-sharded table's."""
    if num_rows is None:
        raise SettingError(
            f"table {table!r} has an unbounded id space (num_rows=None), which no tensor in state_dict() can hold; "
            "checkpoint it with store.checkpoint(path) (ShardedEmbeddingBagCollection.checkpoint) and restore by "
            "opening that directory, or create the table with num_rows")
    r0, r1 = rows or (0, num_rows)
    c0, c1 = cols or (0, dim)
    local = c1 - c0
    a, _ = state_layout(optimizer)
    segments, values = state_names(optimizer)
    weight = TableView(store, table, "weight", (num_rows, dim), DTYPES[dtype], [Block(r0, r1, c0, c1, 0)])
    state = {f"{table}.{name}": TableView(store, table, name, (num_rows, dim), torch.float32,
                                          [Block(r0, r1, c0, c1, local * (j + 1))])
             for j, name in enumerate(segments)}
    k, n = col_shard or (0, 1)
    shift = k * num_rows
    state.update({f"{table}.{name}": TableView(store, table, name, (num_rows * n,), torch.float32,
                                               [Block(r0 + shift, r1 + shift, 0, 1, local * (a + 1) + j,
                                                      saves=col_shard is not None or c0 == 0, shift=shift)])
                  for j, name in enumerate(values)})
    return TableViews(weight, state)


def check_loadable(views: Mapping[str, TableView], state_dict: Mapping[str, object], missing: list[str],
                   errors: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``state_dict`` for ``views`` (by key) whose shapes fit; others go to
    ``missing`` or ``errors`` as nn.Module.load_state_dict reports them."""
    found = {}
    for key, view in views.items():
        if key not in state_dict:
            missing.append(key)
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            errors.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object '
                          f"from checkpoint but received {type(value)}")
        elif tuple(value.shape) != tuple(view.shape):
            errors.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, "
                          f"the shape in current model is {tuple(view.shape)}.")
        else:
            found[key] = value
    return found


class SharedViews:
    """state_dict()/load_state_dict() of a module (mixed in before nn.Module) whose tables are
    TableViews under TorchRec's keys, ``embedding_bags.<table>.weight``: the module gives its
    table names (``_view_tables()``) and each table's views (``views(name)``)."""

    def _view_tables(self) -> Sequence[str]:
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._view_tables():
            destination[f"{prefix}embedding_bags.{name}.weight"] = self.views(name).weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        views = {f"{prefix}embedding_bags.{name}.weight": self.views(name).weight for name in self._view_tables()}
        unexpected_keys[:] = [k for k in unexpected_keys if k not in views]
        load_views(views, check_loadable(views, state_dict, missing_keys, error_msgs))


def load_views(views: Mapping[str, TableView], values: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, value in values.items():
            views[key].write(value)
