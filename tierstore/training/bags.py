"""A forward's bags: the input of an EmbeddingBag forward checked as torch checks it,
mapped onto unique rows, and the sums of its backward.

The public internal API that tierstore.nn (TieredEmbeddingBag) and
tierstore.distributed (the sharded collection) share: ``plan_bags`` validates an
input like torch.nn.functional.embedding_bag and returns its ``Bags``; ``Rows``
groups the entries by row in torch.sort's order; ``row_grads``, ``mean_grads``
and ``sum_rows`` sum each row's gradient in that fixed order (no atomics), so
training is bit-identical whatever the tiers and, without per-sample weights,
equal to nn.EmbeddingBag(sparse=True)'s on CPU.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from tierstore.training import fbgemm
from tierstore.errors import ArgumentTypeError, BadValuesError, SettingError, TierstoreError
from tierstore.spec import MAX_ID, RowInit
from tierstore.engine.tensors import check_has_values

__all__ = ["MODES", "RUN", "BagIndexError", "BagOffsetsError", "BagTypeError", "Bags", "EmbeddingBagConfig", "Rows",
           "mean_grads", "plan_bags", "row_grads", "sort_is_stable", "sum_rows"]

MODES = {"sum": 0, "mean": 1, "max": 2}


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
            raise SettingError(f"num_embeddings must be a positive int (or None for an unbounded id space), got {n!r}")
        if not _is_int(self.embedding_dim) or self.embedding_dim <= 0:
            raise SettingError(f"embedding_dim must be a positive int, got {self.embedding_dim!r}")
        if self.mode not in MODES:
            raise SettingError(f"mode has to be one of sum, mean or max, got {self.mode!r}")
        if not isinstance(self.include_last_offset, bool):
            raise ArgumentTypeError(f"include_last_offset must be a bool, got {self.include_last_offset!r}")
        if self.padding_idx is not None:
            p = self.padding_idx
            if not _is_int(p):
                raise ArgumentTypeError(f"padding_idx must be an int or None, got {p!r}")
            if n is None:
                if p < 0:
                    raise SettingError(f"padding_idx must be >= 0 for an unbounded table (num_embeddings=None), got {p}")
            elif not -n <= p < n:
                raise SettingError(f"padding_idx must be within num_embeddings: got {p} for num_embeddings={n}")
            elif p < 0:
                self.padding_idx = p + n  # as torch does
        if not isinstance(self.init, RowInit):
            raise ArgumentTypeError("init must be a tierstore.RowInit, e.g. RowInit.normal(0, 1)")


def _index_dtype_error(what: str, t: torch.Tensor) -> BagTypeError:
    return BagTypeError(
        f"Expected tensor for argument {what} to have one of the following scalar types: Long, Int; "
        f"but got {t.type()} instead"
    )


def _is_index_dtype(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


@dataclass
class Bags:
    """One forward's bags over the used entries of its input (all CPU tensors)."""

    ids: torch.Tensor  # [M] id of each used input entry
    sizes: torch.Tensor  # [B] used entries per bag
    offsets: torch.Tensor  # [B] start of each bag among the used entries
    used: torch.Tensor | None  # [M] positions in the flat input of the used entries; None = all, in order
    n_input: int  # entries in the flat input
    sort_on: torch.device | None = None  # the GPU the ids came from: it groups them (rows), the host takes milliseconds
    admitted: torch.Tensor | None = None  # [U] rows whose update is kept (admit_after); None = all
    _bag_of: torch.Tensor | None = None
    _rows: "Rows | None" = None
    _ends: torch.Tensor | None = None

    @property
    def bag_of(self) -> torch.Tensor:
        """[M] bag of each used entry; only backward needs it, so it is made on first use."""
        if self._bag_of is None:
            self._bag_of = torch.repeat_interleave(torch.arange(len(self.sizes)), self.sizes, output_size=len(self.ids))
        return self._bag_of

    @property
    def rows(self) -> "Rows":
        """The entries grouped by row."""
        if self._rows is None:
            self._rows = Rows.group(self.ids, sort_on=self.sort_on)
        return self._rows

    def ends(self) -> torch.Tensor:
        """[B + 1] bag offsets ending with the number of entries (FBGEMM's form)."""
        if self._ends is None:
            self._ends = torch.cat([self.offsets, torch.tensor([len(self.ids)])])
        return self._ends

    def select(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-entry values of the flat input restricted to the used entries."""
        return flat if self.used is None else flat.index_select(0, self.used.to(flat.device))

    def pool(self, weights: torch.Tensor, index: torch.Tensor, mode: int,
             psw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pooled bags, max_idx) from ``weights``, entry j being row ``index[j]``;
        float16 weights only where FBGEMM sums them (tierstore.nn's forward from the top tier)."""
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
class Rows:
    """A forward's entries grouped by row: sorted by id with torch.sort's default
    (not stable=True), which orders equal ids as torch's sparse coalesce does,
    so a row's summed gradient equals torch's (see row_grads)."""

    uid: torch.Tensor  # [U] sorted unique ids
    perm: torch.Tensor  # [M] entries in id order
    counts: torch.Tensor  # [U] entries per row
    _local: torch.Tensor | None = None

    @classmethod
    def group(cls, ids: torch.Tensor, keep: torch.Tensor | None = None, sort_on: torch.device | None = None,
              stable: bool = False) -> "Rows":
        """``keep`` [M] (bool) leaves entries out after the sort, so the kept ones stay
        in the order the sort of all ``ids`` gives them (a sharded owner's rows).
        ``sort_on``: a device that sorts; the result is on ``ids``' device either way.
        The sort is torch's default, as its sparse gradients' coalesce uses: a row's
        entries are in the order that sums them as nn.EmbeddingBag does. ``stable``:
        equal ids in input order, which is that order for a subset of a batch whose
        whole sort is stable (``sort_is_stable``): a sharded owner given only its ids."""
        on = ids if sort_on is None else ids.to(sort_on)
        sorted_ids, perm = torch.sort(on, stable=stable)
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



_PROBE_UP_TO = 1 << 20


@functools.cache
def _stable_from() -> int | None:
    """The fewest int64 ids from which torch.sort's default on the CPU keeps equal ids in
    input order (its radix sort, 32,768 in torch 2.x builds with OpenMP), probed once: equal
    keys come out in input order only from a stable algorithm (the introsort below it swaps
    them). None when not even at _PROBE_UP_TO."""
    def stable(n: int) -> bool:
        return torch.equal(torch.sort(torch.zeros(n, dtype=torch.int64)).indices, torch.arange(n))

    lo, hi = 17, _PROBE_UP_TO
    if not stable(hi):
        return None
    while lo < hi:  # the algorithm depends on the length alone, above a threshold
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stable(mid) else (mid + 1, hi)
    return lo


def sort_is_stable(n: int) -> bool:
    """Whether torch.sort's default orders n int64 ids on the CPU as stable=True does:
    up to 16 (an insertion sort) and from the radix sort's threshold on."""
    start = _stable_from()
    return n <= 16 or (start is not None and n >= start)


def row_grads(mode: str, bags: Bags, rows: Rows, grad_out: torch.Tensor, psw, max_idx) -> torch.Tensor:
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
        g[at] = sum_rows(grad_out[nonempty].reshape(-1, 1), order, counts, None).squeeze(1)
        return g.reshape(U, dim)
    # sum/mean: the transpose of the forward, itself a bag sum: row u's bag is the
    # list of bags its entries fall in, in the order of Rows. That is the order
    # torch's sparse gradients are coalesced in, and the mean is applied as torch
    # applies it, so without per-sample weights the row gradients equal
    # nn.EmbeddingBag(sparse=True)'s bit for bit.
    if mode == "mean":
        grad_out = mean_grads(grad_out, bags.sizes)
    perm = rows.perm.to(dev)
    w = None if psw is None else psw.index_select(0, perm)
    return sum_rows(grad_out, bags.bag_of.to(dev).index_select(0, perm), rows.counts, w)


def mean_grads(grad_out: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The gradient of mean pooling from that of its bags' sums: times the reciprocal of
    the bag's size, as torch does (not a division: that rounds differently)."""
    return grad_out * (1.0 / sizes.clamp(min=1).to(device=grad_out.device, dtype=grad_out.dtype)).unsqueeze(1)


# Entries one CUDA embedding_bag thread adds one after another: a hot row's thousands
# of entries in one bag would make its sum the whole step's critical path.
RUN = 32


def sum_rows(src: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor | None,
             pieces: bool | None = None) -> torch.Tensor:
    """[U, dim]: row u sums ``src[index[j]]`` (times ``weights[j]``) over its run of
    ``counts[u]`` entries of ``index``, in that order (embedding_bag: no atomics).
    On a GPU (or with ``pieces``) a run longer than RUN is summed in pieces of RUN, then
    its pieces in order: a fixed order still (the same bits whatever the tiers), rounded
    unlike the host's one pass."""
    if src.device.type == "cuda" if pieces is None else pieces:
        while len(counts) and int(counts.max()) > RUN:
            pieces = (counts + RUN - 1) // RUN  # counts are >= 1: every row has an entry
            sizes = torch.full((int(pieces.sum()),), RUN, dtype=torch.int64, device=counts.device)
            sizes[torch.cumsum(pieces, 0) - 1] = counts - RUN * (pieces - 1)
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


def plan_bags(c: EmbeddingBagConfig, input, offsets, per_sample_weights) -> Bags:
    """Validate like torch.nn.functional.embedding_bag and map the bags onto unique rows."""
    if not isinstance(input, torch.Tensor):
        raise ArgumentTypeError(f"input must be a torch.Tensor of ids, got {type(input).__name__}")
    if per_sample_weights is not None:
        if not isinstance(per_sample_weights, torch.Tensor):
            raise ArgumentTypeError(f"per_sample_weights must be a torch.Tensor or None, got {type(per_sample_weights).__name__}")
        if input.size() != per_sample_weights.size():
            raise BadValuesError(
                f"embedding_bag: If per_sample_weights ({per_sample_weights.shape}) is not None, "
                f"then it must have the same shape as the input ({input.shape})"
            )
    include_last = c.include_last_offset
    if input.dim() == 2:
        if offsets is not None:
            raise BadValuesError(
                "if input is 2D, then offsets has to be None, as input is treated is a mini-batch of fixed length "
                f"sequences. However, found offsets of type {type(offsets)}"
            )
        nbags, length = input.shape
        starts = torch.arange(nbags, dtype=torch.int64) * length
        include_last = False
    elif input.dim() == 1:
        if offsets is None:
            raise BadValuesError("offsets has to be a 1D Tensor but got None")
        if not isinstance(offsets, torch.Tensor):
            raise ArgumentTypeError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
        if offsets.dim() != 1:
            raise BadValuesError("offsets has to be a 1D Tensor")
        starts = None
    else:
        raise BadValuesError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}")
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
    _check_range(c, ids)
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
    return Bags(ids, sizes, bag_offsets, used, n_input, input.device if input.device.type == "cuda" else None, _bag_of=bag_of)


def _check_range(c: EmbeddingBagConfig, ids: torch.Tensor) -> None:
    if len(ids):
        host = ids.numpy()  # (CPU int64) numpy's two reductions: a third of aminmax's dispatch and reads
        lo, hi = int(host.min()), int(host.max())
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


def jagged_bags(c: EmbeddingBagConfig, ids: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor | None = None) -> Bags:
    """plan_bags for bags a jagged tensor made (TorchRec's KeyedJaggedTensor: ``offsets``
    [B + 1] from 0 to len(ids), non-decreasing, as its lengths give them), when the table has
    no padding_idx: only the ids' range is checked, as the batch's layout is. ``sizes``: the
    bags' sizes (int64, the offsets' differences) where the caller has them already."""
    ids, offsets = ids.to("cpu", torch.int64), offsets.to("cpu", torch.int64)
    _check_range(c, ids)
    sizes = torch.diff(offsets) if sizes is None else sizes.to("cpu", torch.int64)
    return Bags(ids, sizes, offsets[:-1], None, len(ids), _ends=offsets)
