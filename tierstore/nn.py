"""torch modules whose weights live in a TieredStore.

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
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import fbgemm
from .checkpointing import FusedOptimizer, TableViews, check_loadable, load_views, table_views
from .errors import TierstoreError
from .optim import RowOptimizer
from .precision import round_stochastic
from .spec import MAX_ID, RowInit, TableSpec
from .store import Sizes, TieredStore, check_has_values

__all__ = [
    "BagIndexError",
    "BagOffsetsError",
    "BagTypeError",
    "EmbeddingBagConfig",
    "TieredEmbeddingBag",
    "TieredEmbeddingBagCollection",
]

MODES = {"sum": 0, "mean": 1, "max": 2}
_CHUNK_ROWS = 1 << 18  # from_pretrained writes in chunks of this many rows


class BagIndexError(IndexError, RuntimeError, TierstoreError):
    """An id outside [0, num_embeddings). A RuntimeError too, as torch raises."""


class BagOffsetsError(ValueError, RuntimeError, TierstoreError):
    """Offsets that do not describe bags of the input. A RuntimeError too, as torch raises."""


class BagTypeError(TypeError, RuntimeError, TierstoreError):
    """Ids, offsets or per-sample weights of the wrong dtype. A RuntimeError too, as torch raises."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class EmbeddingBagConfig:
    """What a TieredEmbeddingBag computes; the store's layout is in its TableSpec."""

    num_embeddings: int | None
    embedding_dim: int
    mode: str = "mean"
    include_last_offset: bool = False
    padding_idx: int | None = None
    table: str = "t0"
    init: RowInit = field(default_factory=lambda: RowInit.normal(0.0, 1.0))

    def __post_init__(self):
        n = self.num_embeddings
        if n is not None and (not _is_int(n) or not 0 < n <= MAX_ID + 1):
            raise ValueError(f"num_embeddings must be a positive int (or None for an unbounded id space), got {n!r}")
        if not _is_int(self.embedding_dim) or self.embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be a positive int, got {self.embedding_dim!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode has to be one of sum, mean or max, got {self.mode!r}")
        if not isinstance(self.include_last_offset, bool):
            raise TypeError(f"include_last_offset must be a bool, got {self.include_last_offset!r}")
        if self.padding_idx is not None:
            p = self.padding_idx
            if not _is_int(p):
                raise TypeError(f"padding_idx must be an int or None, got {p!r}")
            if n is None:
                if p < 0:
                    raise ValueError(f"padding_idx must be >= 0 for an unbounded table (num_embeddings=None), got {p}")
            elif not -n <= p < n:
                raise ValueError(f"padding_idx must be within num_embeddings: got {p} for num_embeddings={n}")
            elif p < 0:
                self.padding_idx = p + n  # as torch does
        if not isinstance(self.init, RowInit):
            raise TypeError("init must be a tierstore.RowInit, e.g. RowInit.normal(0, 1)")


def _index_dtype_error(what: str, t: torch.Tensor) -> BagTypeError:
    return BagTypeError(
        f"Expected tensor for argument {what} to have one of the following scalar types: Long, Int; "
        f"but got {t.type()} instead"
    )


def _is_index_dtype(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


@dataclass
class _Bags:
    """One forward's bags over the used entries of its input (all CPU tensors)."""

    ids: torch.Tensor  # [M] id of each used input entry
    sizes: torch.Tensor  # [B] used entries per bag
    offsets: torch.Tensor  # [B] start of each bag among the used entries
    used: torch.Tensor | None  # [M] positions in the flat input of the used entries; None = all, in order
    n_input: int  # entries in the flat input
    sort_on: torch.device | None = None  # the GPU the ids came from: it groups them (rows), the host takes milliseconds
    admitted: torch.Tensor | None = None  # [U] rows whose update is kept (admit_after); None = all
    _bag_of: torch.Tensor | None = None
    _rows: "_Rows | None" = None

    @property
    def bag_of(self) -> torch.Tensor:
        """[M] bag of each used entry; only backward needs it, so it is made on first use."""
        if self._bag_of is None:
            self._bag_of = torch.repeat_interleave(torch.arange(len(self.sizes)), self.sizes, output_size=len(self.ids))
        return self._bag_of

    @property
    def rows(self) -> "_Rows":
        """The entries grouped by row."""
        if self._rows is None:
            self._rows = _Rows.group(self.ids, sort_on=self.sort_on)
        return self._rows

    def ends(self) -> torch.Tensor:
        """[B + 1] bag offsets ending with the number of entries (FBGEMM's form)."""
        return torch.cat([self.offsets, torch.tensor([len(self.ids)])])

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-entry values of the flat input restricted to the used entries."""
        return flat if self.used is None else flat.index_select(0, self.used.to(flat.device))

    def pool(self, weights: torch.Tensor, index: torch.Tensor, mode: int,
             psw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pooled bags, max_idx) from ``weights``, entry j being row ``index[j]``;
        float16 weights only where FBGEMM sums them (TieredEmbeddingBag._run)."""
        if weights.dtype == torch.float16:
            return fbgemm.pool_half_sum(weights, index, self.ends(), psw), None
        dev = weights.device
        out, _, _, max_idx = torch.embedding_bag(weights, index.to(dev), self.offsets.to(dev), False, mode, False, psw, False, None)
        return out, max_idx

    def psw_grad(self, grad_out: torch.Tensor, weights: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Gradient of the per-sample weights (of the input's ``shape``), given the
        bags' output gradient and the rows pooled (``weights``, by rows.positions())."""
        dev = grad_out.device
        per = (grad_out.index_select(0, self.bag_of.to(dev)) * weights.to(dev).index_select(0, self.rows.positions().to(dev))).sum(1)
        return self.expand(per).reshape(shape)

    def expand(self, per_used: torch.Tensor) -> torch.Tensor:
        """Inverse of select: zeros at entries the bags do not use."""
        if self.used is None:
            return per_used
        out = torch.zeros(self.n_input, dtype=per_used.dtype, device=per_used.device)
        out[self.used.to(per_used.device)] = per_used
        return out


@dataclass
class _Rows:
    """A forward's entries grouped by row: sorted by id with torch.sort's default
    (not stable=True), which orders equal ids as torch's sparse coalesce does,
    so a row's summed gradient equals torch's (see _row_grads)."""

    uid: torch.Tensor  # [U] sorted unique ids
    perm: torch.Tensor  # [M] entries in id order
    counts: torch.Tensor  # [U] entries per row
    _local: torch.Tensor | None = None

    @classmethod
    def group(cls, ids: torch.Tensor, keep: torch.Tensor | None = None, sort_on: torch.device | None = None) -> "_Rows":
        """``keep`` [M] (bool) leaves entries out after the sort, so the kept ones stay
        in the order the sort of all ``ids`` gives them (a sharded owner's rows).
        ``sort_on``: a device that sorts; the result is on ``ids``' device either way.
        The sort is torch's default, as its sparse gradients' coalesce uses: a row's
        entries are in the order that sums them as nn.EmbeddingBag does."""
        on = ids if sort_on is None else ids.to(sort_on)
        sorted_ids, perm = torch.sort(on)
        if keep is not None:
            perm = perm[keep.to(perm.device)[perm]]
            sorted_ids = on.index_select(0, perm)
        uid, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        return cls(uid.to(ids.device), perm.to(ids.device), counts.to(ids.device))

    def positions(self) -> torch.Tensor:
        """[M] position in ``uid`` of each entry."""
        if self._local is None:
            self._local = torch.empty_like(self.perm)
            self._local[self.perm] = torch.repeat_interleave(torch.arange(len(self.uid)), self.counts, output_size=len(self.perm))
        return self._local

    def firsts(self) -> torch.Tensor:
        """[U] one entry of each row."""
        return self.perm.index_select(0, torch.cumsum(self.counts, 0) - self.counts)


# Rows a module's backward wrote, per (store, table): a backward whose forward
# read rows before another backward wrote re-reads them instead of
# overwriting that update with its stale copy.
_WRITES: "weakref.WeakKeyDictionary[TieredStore, dict[str, int]]" = weakref.WeakKeyDictionary()


def _write_count(store: TieredStore, table: str) -> int:
    return _WRITES.get(store, {}).get(table, 0)


class _TieredBagFunction(torch.autograd.Function):
    """Pools bags from the rows one forward read; its backward runs the fused update.

    ``anchor`` is an empty tensor that requires grad when the rows are trained:
    it puts the function in the graph (the rows are not torch Parameters) and
    gets None back. ``weights``/``index`` are what the bags are pooled from: the
    unique rows read and each entry's position among them, or, when every row
    is resident in the top tier (``resident``), that tier's weight matrix and
    each entry's slot, so no row is copied.
    """

    @staticmethod
    def forward(ctx, anchor, per_sample_weights, weights, index, rows, resident, bags: _Bags, owner: "TieredEmbeddingBag"):
        dev = weights.device
        psw = None
        if per_sample_weights is not None:
            psw = bags.select(per_sample_weights.reshape(-1).to(dev))
        out, max_idx = bags.pool(weights, index, MODES[owner.config.mode], psw)
        ctx.bags, ctx.owner, ctx.rows, ctx.resident = bags, owner, rows, resident
        ctx.weights = None if resident is not None else weights
        ctx.psw, ctx.psw_shape, ctx.max_idx = psw, None if per_sample_weights is None else per_sample_weights.shape, max_idx
        ctx.writes = _write_count(owner.store, owner.table)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        bags, owner = ctx.bags, ctx.owner
        grad_out = grad_out.contiguous()
        grad_psw = None
        if ctx.needs_input_grad[1]:  # never with a resident forward: see TieredEmbeddingBag._run
            grad_psw = bags.psw_grad(grad_out, ctx.weights, ctx.psw_shape)
        if ctx.needs_input_grad[0]:
            if ctx.resident is not None:
                owner._update_resident(bags, ctx.resident, grad_out, ctx.psw)
            else:
                rows, ctx.rows = ctx.rows, None  # a failed or repeated backward re-reads
                owner._update_read(bags, grad_out, ctx.psw, ctx.max_idx, rows, ctx.writes)
        return None, grad_psw, None, None, None, None, None, None


def _row_grads(mode: str, bags: _Bags, rows: _Rows, grad_out: torch.Tensor, psw, max_idx) -> torch.Tensor:
    """Summed gradient of each unique row, [U, dim], in a fixed summation order."""
    U, dim = len(rows.uid), grad_out.shape[1]
    dev = grad_out.device
    if mode == "max":
        # the row that gave each (bag, column) its maximum gets that column's gradient, summed
        # in bag order: a stable sort and a bag sum (index_add_ adds in no fixed order on CUDA)
        nonempty = (bags.sizes > 0).to(dev)
        flat, order = torch.sort((max_idx[nonempty] * dim + torch.arange(dim, device=dev)).reshape(-1), stable=True)
        at, counts = torch.unique_consecutive(flat, return_counts=True)
        g = torch.zeros(U * dim, dtype=grad_out.dtype, device=dev)
        g[at] = _sum_rows(grad_out[nonempty].reshape(-1, 1), order, counts, None).squeeze(1)
        return g.reshape(U, dim)
    # sum/mean: the transpose of the forward, itself a bag sum: row u's bag is the
    # list of bags its entries fall in, in the order of _Rows. That is the order
    # torch's sparse gradients are coalesced in, and the mean is applied as torch
    # applies it, so without per-sample weights the row gradients equal
    # nn.EmbeddingBag(sparse=True)'s bit for bit.
    if mode == "mean":
        grad_out = _mean_grads(grad_out, bags.sizes)
    perm = rows.perm.to(dev)
    w = None if psw is None else psw.index_select(0, perm)
    return _sum_rows(grad_out, bags.bag_of.to(dev).index_select(0, perm), rows.counts, w)


def _mean_grads(grad_out: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The gradient of mean pooling from that of its bags' sums: times the reciprocal of
    the bag's size, as torch does (not a division: that rounds differently)."""
    return grad_out * (1.0 / sizes.clamp(min=1).to(device=grad_out.device, dtype=grad_out.dtype)).unsqueeze(1)


# Entries one CUDA embedding_bag thread adds one after another: a hot row's thousands
# of entries in one bag would make its sum the whole step's critical path.
_RUN = 32


def _sum_rows(src: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """[U, dim]: row u sums ``src[index[j]]`` (times ``weights[j]``) over its run of
    ``counts[u]`` entries of ``index``, in that order (embedding_bag: no atomics).
    On a GPU a run longer than _RUN is summed in pieces of _RUN, then its pieces in
    order: a fixed order still (the same bits whatever the tiers), rounded unlike the
    host's one pass."""
    if src.device.type == "cuda":
        while len(counts) and int(counts.max()) > _RUN:
            pieces = (counts + _RUN - 1) // _RUN  # counts are >= 1: every row has an entry
            sizes = torch.full((int(pieces.sum()),), _RUN, dtype=torch.int64, device=counts.device)
            sizes[torch.cumsum(pieces, 0) - 1] = counts - _RUN * (pieces - 1)
            src = _bag_sums(src, index, sizes, weights)
            index, weights, counts = torch.arange(len(sizes), device=src.device), None, pieces
    return _bag_sums(src, index, counts, weights)


def _bag_sums(src: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    dev = src.device
    row_offsets = torch.zeros(len(counts), dtype=torch.int64, device=dev)
    if len(counts) > 1:
        torch.cumsum(counts.to(dev)[:-1], 0, out=row_offsets[1:])
    g, *_ = torch.embedding_bag(src, index, row_offsets, False, 0, False, weights, False, None)
    return g


def _plan_bags(c: EmbeddingBagConfig, input, offsets, per_sample_weights) -> _Bags:
    """Validate like torch.nn.functional.embedding_bag and map the bags onto unique rows."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor of ids, got {type(input).__name__}")
    if per_sample_weights is not None:
        if not isinstance(per_sample_weights, torch.Tensor):
            raise TypeError(f"per_sample_weights must be a torch.Tensor or None, got {type(per_sample_weights).__name__}")
        if input.size() != per_sample_weights.size():
            raise ValueError(
                f"embedding_bag: If per_sample_weights ({per_sample_weights.shape}) is not None, "
                f"then it must have the same shape as the input ({input.shape})"
            )
    include_last = c.include_last_offset
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError(
                "if input is 2D, then offsets has to be None, as input is treated is a mini-batch of fixed length "
                f"sequences. However, found offsets of type {type(offsets)}"
            )
        nbags, length = input.shape
        starts = torch.arange(nbags, dtype=torch.int64) * length
        include_last = False
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("offsets has to be a 1D Tensor but got None")
        if not isinstance(offsets, torch.Tensor):
            raise TypeError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
        if offsets.dim() != 1:
            raise ValueError("offsets has to be a 1D Tensor")
        starts = None
    else:
        raise ValueError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}")
    if per_sample_weights is not None and c.mode != "sum":
        raise NotImplementedError(
            "embedding_bag: per_sample_weights was not None. per_sample_weights is only supported for "
            f"mode='sum' (got mode='{c.mode}'). Please open a feature request on GitHub."
        )
    if not _is_index_dtype(input):
        raise _index_dtype_error("#1 'indices'", input)
    if per_sample_weights is not None and per_sample_weights.dtype != torch.float32:
        raise BagTypeError(
            f"Expected tensor for argument #1 'weight' to have the same type as tensor for argument #1 "
            f"'per_sample_weights'; but type torch.FloatTensor does not equal {per_sample_weights.type()}"
        )
    for what, t in (("ids", input), ("offsets", offsets), ("per_sample_weights", per_sample_weights)):
        if t is not None:  # the store's error for a tensor with no values, not torch's when it is copied
            check_has_values(t, what, c.table)
    flat = input.detach().reshape(-1).to("cpu", torch.int64)
    n_input = len(flat)
    if starts is None:
        if not _is_index_dtype(offsets):
            raise _index_dtype_error("#2 'offsets'", offsets)
        off = offsets.detach().to("cpu", torch.int64)
        if include_last and len(off) == 0:
            raise BagOffsetsError("include_last_offset: number of offset should be at least 1")
        if len(off):
            if int(off[0]) != 0:
                raise BagOffsetsError(
                    "offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start from "
                    f"position 0. However, got {int(off[0])}"
                )
            if int(off[-1]) > n_input:
                raise BagOffsetsError(
                    f"offsets[-1] can not be greater than input's length {n_input} but got offsets[-1] of {int(off[-1])}"
                )
            down = torch.nonzero(off[1:] < off[:-1])
            if len(down):
                i = int(down[0])
                raise BagOffsetsError(
                    f"offsets must be non-decreasing, but offsets[{i}]={int(off[i])} > offsets[{i + 1}]={int(off[i + 1])}"
                )
        if include_last:
            starts, end = off[:-1], int(off[-1])
        else:
            starts, end = off, (n_input if len(off) else 0)
    else:
        end = n_input
    ids = flat[:end]
    if end:
        lo, hi = torch.aminmax(ids)
        if lo < 0 or (c.num_embeddings is not None and hi >= c.num_embeddings):
            bad = ids < 0
            if c.num_embeddings is not None:
                bad |= ids >= c.num_embeddings
            i = int(torch.nonzero(bad)[0])
            hi = c.num_embeddings if c.num_embeddings is not None else "2**63"
            raise BagIndexError(
                f"Index {i} of input takes value {int(ids[i])} which is not in the valid range [0, {hi}) "
                f"of table {c.table!r}"
            )
    nbags = len(starts)
    sizes = torch.diff(starts, append=torch.tensor([end], dtype=torch.int64))
    bag_of = None
    used = None if end == n_input else torch.arange(end)
    if c.padding_idx is not None:
        keep = ids != c.padding_idx
        if not bool(keep.all()):
            pos = torch.nonzero(keep).squeeze(1)
            bag_of = torch.repeat_interleave(torch.arange(nbags), sizes, output_size=end)[pos]
            ids, used = ids[pos], pos
            sizes = torch.bincount(bag_of, minlength=nbags)
    bag_offsets = torch.zeros(nbags, dtype=torch.int64)
    if nbags > 1:
        torch.cumsum(sizes[:-1], 0, out=bag_offsets[1:])
    return _Bags(ids, sizes, bag_offsets, used, n_input, input.device if input.device.type == "cuda" else None, _bag_of=bag_of)


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
        raise TypeError(f"torch.fx cannot trace a {type(module).__name__} by itself: its rows live in a TieredStore, "
                        "not in tensors. Trace the model that holds it, where it is a leaf (a call_module node)")
    return proxy.tracer.create_proxy("call_module", path, tuple(args), {})


def refuse_export(module: nn.Module) -> None:
    """torch.export captures tensors and ops; a store lookup is neither."""
    if torch.compiler.is_exporting():
        raise RuntimeError(
            f"torch.export cannot capture {type(module).__name__}: its rows live in a TieredStore, outside any graph. "
            "Use torch.compile(model) instead (the dense layers compile; the lookup runs between the graphs), or "
            "export the dense part alone and feed it the pooled embeddings from this module or from "
            "tierstore.ServingEmbeddingBagCollection")


def _check_store_options(path, device, hbm_rows, ddr_rows, policy, memory_budget, record_trace) -> None:
    """A module given store= takes that store as it was opened: options for opening one are refused, not ignored."""
    if path is not None or device is not None or hbm_rows or ddr_rows or policy != "lru" or memory_budget is not None \
            or record_trace is not None:
        raise ValueError("with store= the store's own path, device, tiers, memory budget, policy and trace apply; "
                         "drop path=, device=, hbm_rows=, ddr_rows=, memory_budget=, policy= and record_trace= "
                         "(open the store with TieredStore(..., record_trace=PATH) to record its reads)")


class ScriptRefusal:
    """torch.jit.script would compile forward, which calls into the store (Python, threads, LMDB)."""

    def __prepare_scriptable__(self):
        raise RuntimeError(
            f"torch.jit.script cannot compile {type(self).__name__}: its forward reads rows from a TieredStore in "
            "Python. Use torch.compile(model) (the dense layers compile, the lookup runs eagerly between the graphs); "
            "to script the dense part, script those submodules alone")


class TieredEmbeddingBag(ScriptRefusal, nn.Module):
    """torch.nn.EmbeddingBag over a TieredStore, with a fused row optimizer.

    ``TieredEmbeddingBag(num_embeddings, embedding_dim, mode=..., path=...,
    hbm_rows=..., ddr_rows=..., policy=..., device=..., optimizer=...)`` creates
    (or reopens) a store at ``path`` holding one table; ``store=``/``table=``
    use a table of an open store instead. ``num_embeddings=None`` is an
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
        store: TieredStore | None = None,
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
            raise ValueError(f'kernels must be "torch" or "fbgemm" (FBGEMM\'s fused backward), got {kernels!r}')
        if max_norm is not None or scale_grad_by_freq:
            raise ValueError(
                "max_norm and scale_grad_by_freq are not supported by TieredEmbeddingBag; "
                "leave them at their defaults (None, False)"
            )
        del sparse  # the rows are always updated sparsely, by the fused optimizer
        if optimizer is not None and not isinstance(optimizer, RowOptimizer):
            raise TypeError(
                f"optimizer must be a tierstore.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam), got {type(optimizer).__name__}; "
                "torch.optim optimizers cannot update rows that live in the store"
            )
        self.optimizer = optimizer
        self._frozen = False  # requires_grad_(False)
        self._warned_untrained = False
        self._owns_store = store is None
        if store is None:
            if path is None:
                raise ValueError("pass path= (a directory for a new or existing store) or store= (an open TieredStore)")
            cfg = EmbeddingBagConfig(num_embeddings, embedding_dim, mode, include_last_offset, padding_idx, table,
                                     init if init is not None else RowInit.normal(0.0, 1.0))
            state_dim = optimizer.state_dim(embedding_dim) if optimizer else 0
            spec = TableSpec(table, num_embeddings, embedding_dim, dtype=dtype or "float32", init=cfg.init, state_dim=state_dim)
            store = TieredStore(path, tables=[spec], hbm_rows=hbm_rows, ddr_rows=ddr_rows, policy=policy, device=device,
                                memory_budget=memory_budget, record_trace=record_trace)
        else:
            _check_store_options(path, device, hbm_rows, ddr_rows, policy, memory_budget, record_trace)
            if not isinstance(store, TieredStore):
                raise TypeError(f"store must be a tierstore.TieredStore, got {type(store).__name__}")
            spec = store.tables.get(table)
            if spec is None:
                raise KeyError(
                    f"store {store.path} has no table {table!r} (it has {sorted(store.tables)}); open the store with "
                    f"tables=[TableSpec({table!r}, num_rows, dim, state_dim=optimizer.state_dim(dim))], "
                    "or use TieredEmbeddingBagCollection"
                )
            cfg = EmbeddingBagConfig(num_embeddings, embedding_dim, mode, include_last_offset, padding_idx, table, spec.init)
            _check_spec(spec, num_embeddings, embedding_dim, optimizer)
            if init is not None and init != spec.init:
                raise ValueError(f"init={init!r} contradicts table {table!r}'s stored init {spec.init!r}")
            if dtype is not None and dtype != spec.dtype:
                raise ValueError(f"dtype={dtype!r} contradicts table {table!r}'s dtype {spec.dtype!r}; drop dtype= to use the table's")
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
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        optimizer = kwargs.get("optimizer")
        if freeze is None:
            freeze = optimizer is None
        if freeze and optimizer is not None:
            raise ValueError("freeze=True with an optimizer: drop optimizer= to freeze the rows, or pass freeze=False to train them")
        if not freeze and optimizer is None:
            raise ValueError("freeze=False needs optimizer= (a tierstore.optim optimizer) to update the rows")
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
            raise ValueError("requires_grad_(True) needs an optimizer: create the module with optimizer= "
                             "(a tierstore.optim optimizer) to train its rows")
        self._frozen = not requires_grad
        return self

    @property
    def trains(self) -> bool:
        """Whether a forward with grad enabled trains the rows (an optimizer, not frozen)."""
        return self.optimizer is not None and not self._frozen

    @outside_graphs  # torch.compile: a graph break; the dense layers around it compile
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        leaf = as_leaf(self, (input, offsets, per_sample_weights))
        if leaf is not None:
            return leaf
        refuse_export(self)
        bags = self._plan(input, offsets, per_sample_weights)  # validates before the store is touched
        _warn_untrained([self], self.training)
        return self._run(bags, per_sample_weights)

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

    # -- checkpoints (tierstore.checkpointing) ------------------------------------------------
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
    def _plan(self, input, offsets, per_sample_weights) -> _Bags:
        return _plan_bags(self.config, input, offsets, per_sample_weights)

    def _run(self, bags: _Bags, per_sample_weights) -> torch.Tensor:
        train = self.trains and torch.is_grad_enabled()
        anchor = torch.empty(0, requires_grad=True) if train else None
        # Pool straight from the top tier's weights, once every row is there (the
        # backward then updates them in place). Not for max pooling (its backward
        # indexes the rows read) nor per-sample weights that need a gradient (it
        # reads the rows as the forward saw them).
        psw_grad = per_sample_weights is not None and per_sample_weights.requires_grad and torch.is_grad_enabled()
        if self.config.mode != "max" and not psw_grad:
            with self.store._resident(self.table, bags.ids, admit=True) as hit:
                if hit is not None:
                    bags.admitted = self._admitted(bags) if train else None
                    weights, index = hit.tier.weights, hit.slots
                    # pool in float32, as from rows read: FBGEMM sums float16 rows so in place;
                    # else the batch's rows are gathered once and upcast
                    fbgemm_sums = weights.dtype == torch.float16 and self.config.mode == "sum" and \
                        weights.device.type == "cpu" and fbgemm.installed()
                    if weights.dtype != torch.float32 and not fbgemm_sums:
                        weights = weights.index_select(0, hit.slots.index_select(0, bags.rows.firsts().to(hit.slots.device))).to(torch.float32)
                        index = bags.rows.positions()
                    return _TieredBagFunction.apply(anchor, per_sample_weights, weights, index, None,
                                                    hit if train else None, bags, self)
        rows = self.store.read(self.table, bags.rows.uid, with_state=train)
        bags.admitted = self._admitted(bags) if train else None
        dim = self.config.embedding_dim
        weights = rows if rows.shape[1] == dim else rows[:, :dim].contiguous()
        if weights is rows and train and psw_grad:
            weights = rows.clone()  # the update must not alter what the per-sample-weight gradient reads
        return _TieredBagFunction.apply(anchor, per_sample_weights, weights, bags.rows.positions(), rows if train else None,
                                        None, bags, self)

    def _admitted(self, bags: _Bags) -> torch.Tensor | None:
        """After the forward's read: which rows its backward may update (admit_after)."""
        if self.store.tables[self.table].admit_after == 1:
            return None
        mask = self.store._admitted(self.table, bags.rows.uid)
        return None if mask is None or bool(mask.all()) else mask

    def _update_resident(self, bags: _Bags, hit, grad_out: torch.Tensor, psw) -> None:
        """The backward of a resident forward: the update runs on the tier's rows in
        place, unless a slot changed owner since the forward (then by id, as
        _update_read does). The same update either way."""
        key = self.store._update_key(self.table)
        # one slot per row (the entries grouped by row: a sort) only where needed; FBGEMM's kernel takes the entries' slots
        row_slots = None if self.kernels == "fbgemm" and bags.admitted is None else \
            hit.slots.index_select(0, bags.rows.firsts().to(hit.slots.device))
        if self.kernels == "fbgemm":
            slots = hit.slots if bags.admitted is None else row_slots[bags.admitted.to(row_slots.device)]

            def update(top) -> None:
                # rows not admitted take the step too, then get their values back
                held = _Held(top, row_slots, bags.admitted)
                fbgemm.fused_step(self.optimizer, top.weights, top.state, hit.slots, bags.ends(), grad_out, psw, self.config.mode)
                held.restore()
        else:
            grads = _row_grads(self.config.mode, bags, bags.rows, grad_out, psw, None)
            slots = row_slots
            if bags.admitted is not None:
                slots, grads = slots[bags.admitted.to(slots.device)], grads[bags.admitted.to(grads.device)]

            def update(top) -> None:
                state = top.state.index_select(0, slots)
                step = self.optimizer.direction(state, grads.to(top.device))
                if state.shape[1]:
                    top.state.index_copy_(0, slots, state)
                if top.weights.dtype == torch.float32:
                    top.weights.index_add_(0, slots, step)  # w + 1 * x rounds as the read path's w.add_(x)
                else:
                    weights = top.weights.index_select(0, slots).to(torch.float32).add_(step)
                    weights = round_stochastic(weights, self.dtype, top.ids.index_select(0, slots), key)
                    top.weights.index_copy_(0, slots, weights.to(top.weights.dtype))
        if self.store._update_resident(self.table, slots, hit.generation, update):
            counts = _WRITES.setdefault(self.store, {})
            counts[self.table] = counts.get(self.table, 0) + 1
        else:
            self._update_read(bags, grad_out, psw, None, None, 0, key)

    def _update_read(self, bags: _Bags, grad_out: torch.Tensor, psw, max_idx, rows: torch.Tensor | None, writes: int,
                     key: int | None = None) -> None:
        """The backward of a forward that read its rows (``rows``, with state):
        update them and write them back."""
        uid, dim = bags.rows.uid, self.config.embedding_dim
        if key is None:
            key = self.store._update_key(self.table)
        counts = _WRITES.setdefault(self.store, {})
        if rows is None or counts.get(self.table, 0) != writes:
            # another backward wrote rows since this forward read them: update the current values
            # with admission or TTL, not a step: they count steps, and whether this happens depends on the tiers
            rows = self.store._reread(self.table, uid) if self.store.tables[self.table].lived else self.store.read(self.table, uid, with_state=True)
        if self.kernels == "fbgemm":
            weights, state = rows[:, :dim].contiguous(), rows[:, dim:].contiguous()
            fbgemm.fused_step(self.optimizer, weights, state, bags.rows.positions(), bags.ends(), grad_out, psw, self.config.mode)
            rows = torch.cat([weights, state], dim=1)
        else:
            grads = _row_grads(self.config.mode, bags, bags.rows, grad_out, psw, max_idx)
            self.optimizer.step(rows[:, :dim], rows[:, dim:], grads.to(rows.device))
            if self.dtype != "float32":
                rows[:, :dim] = round_stochastic(rows[:, :dim], self.dtype, uid, key)
        if bags.admitted is not None:  # rows not admitted keep no update
            uid, rows = uid[bags.admitted], rows[bags.admitted.to(rows.device)]
        self.store.write(self.table, uid, rows, with_state=True)
        counts[self.table] = counts.get(self.table, 0) + 1


class _Held:
    """Rows of a tier (at ``slots`` where not ``admitted``) saved, to be put back after an in-place update."""

    def __init__(self, top, slots: torch.Tensor, admitted: torch.Tensor | None):
        self.top = top
        self.slots = None if admitted is None else slots[~admitted.to(slots.device)]
        if self.slots is not None:
            self.weights = top.weights.index_select(0, self.slots)
            self.state = top.state.index_select(0, self.slots)

    def restore(self) -> None:
        if self.slots is not None:
            self.top.weights.index_copy_(0, self.slots, self.weights)
            self.top.state.index_copy_(0, self.slots, self.state)


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
        raise ValueError(
            f"table {spec.name!r} has num_rows={spec.num_rows}, dim={spec.dim}; the module asks for "
            f"num_embeddings={num_embeddings}, embedding_dim={embedding_dim}"
        )
    if optimizer is not None and spec.state_dim != optimizer.state_dim(spec.dim):
        raise ValueError(
            f"table {spec.name!r} stores state_dim={spec.state_dim} per row but {optimizer!r} needs "
            f"{optimizer.state_dim(spec.dim)}; create the table with state_dim=optimizer.state_dim(dim)"
        )


def feature_parts(name: str, feature) -> tuple:
    """(values, offsets, per_sample_weights) of one table's feature in a collection's batch."""
    if isinstance(feature, torch.Tensor):
        return feature, None, None
    if isinstance(feature, (tuple, list)) and len(feature) in (2, 3):
        return (*feature, None)[:3]
    raise TypeError(f"feature {name!r} must be (values, offsets), (values, offsets, per_sample_weights) or a 2-D tensor")


class TieredEmbeddingBagCollection(ScriptRefusal, nn.Module):
    """Several TieredEmbeddingBags over the tables of one store.

    ``ebc = TieredEmbeddingBagCollection(tables=[TableSpec(...), ...], path=..., optimizer=...)``;
    ``ebc({"user": (values, offsets), "item": (values, offsets)})`` returns
    ``{"user": pooled [B, dim], "item": ...}``. A feature may also be
    ``(values, offsets, per_sample_weights)`` or a 2-D tensor of fixed-length bags.
    Each table's ``state_dim`` is set to what the optimizer needs. ``record_trace=PATH``
    records the store's reads as a trace for ``tierstore capacity`` (TieredStore's option).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        *,
        path: str | Path | None = None,
        store: TieredStore | None = None,
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
            raise TypeError("tables must be a non-empty list of tierstore.TableSpec")
        specs = []
        for spec in tables:
            if optimizer is not None:
                need = optimizer.state_dim(spec.dim)
                if spec.state_dim not in (0, need):
                    raise ValueError(f"table {spec.name!r}: state_dim={spec.state_dim} but {optimizer!r} needs {need}; leave state_dim=0")
                spec = dataclasses.replace(spec, state_dim=need)
            specs.append(spec)
        self._owns_store = store is None
        if store is None:
            if path is None:
                raise ValueError("pass path= (a directory for a new or existing store) or store= (an open TieredStore)")
            store = TieredStore(path, tables=specs, hbm_rows=hbm_rows, ddr_rows=ddr_rows, policy=policy, device=device,
                                memory_budget=memory_budget, record_trace=record_trace)
        else:
            _check_store_options(path, device, hbm_rows, ddr_rows, policy, memory_budget, record_trace)
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
            raise KeyError(f"unknown table {name!r}; the collection has tables {sorted(self._bags)}")
        return name

    @outside_graphs  # torch.compile: a graph break; the dense layers around it compile
    def forward(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        leaf = as_leaf(self, (features,))
        if leaf is not None:
            return leaf
        refuse_export(self)
        if not isinstance(features, Mapping):
            raise TypeError("features must be a mapping {table: (values, offsets)}")
        plans = {}
        for name, feature in features.items():  # validate every table before touching the store
            bag = self._bags[self._known(name)]
            values, offsets, psw = feature_parts(name, feature)
            plans[name] = (bag, bag._plan(values, offsets, psw), psw)
        _warn_untrained([bag for bag, _, _ in plans.values()], self.training)  # its bags are not submodules
        return {name: bag._run(bags, psw) for name, (bag, bags, psw) in plans.items()}

    def batch_reads(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """The ids a forward of ``features`` reads, by table."""
        return {table: ids for name, f in features.items() for table, ids in self[name].batch_reads(f).items()}

    def prefetch(self, features: Mapping[str, object]):
        """Start bringing up the rows of a later ``forward(features)``; returns at once
        with a tierstore.prefetch.PrefetchGroup of one ticket per table."""
        from .prefetch import PrefetchGroup

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
