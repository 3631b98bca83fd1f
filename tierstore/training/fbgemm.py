"""FBGEMM's fused backward as the compute of ``TieredEmbeddingBag(kernels="fbgemm")``.

FBGEMM's table-batched backward computes each row's gradient and applies the
optimizer to the row in one pass over the batch's entries, where the torch path
(tierstore.nn) materializes the row gradients, then steps the rows. Here the
kernel runs on tierstore's own tensors: the top tier's weight and state matrices
are the kernel's table (a slot is the kernel's row index), or, for a step whose
rows are not all in that tier, the rows the step read (a row's position is its
index). FBGEMM sorts a batch's entries stably by index and adds each row's
gradients in entry order, so both give the same bits: rows stay bit-identical
whatever the tier sizes, policy or prefetch depth. They differ from the torch
path by the order the kernel rounds in (see the README).

Needs fbgemm_gpu (``pip install "tierstore[fbgemm]"``); CPU tiers, float32 rows,
SGD, Adagrad and row-wise Adagrad, sum and mean pooling.

Where FBGEMM is installed, whatever the kernels, a resident forward of float16 rows
with sum pooling also pools with FBGEMM's forward (``pool_half_sum``): it reads the
half rows in place and adds them in float32 in entry order, the same bits as
upcasting the batch's rows and pooling them, without the sort and the copies.
"""
from __future__ import annotations

import functools

import torch

from tierstore.optim import SGD, Adagrad, RowOptimizer, RowWiseAdagrad
from tierstore.errors import MissingDependencyError, SettingError

INSTALL = 'pip install "tierstore[fbgemm]" (fbgemm-gpu-cpu 1.8.0 goes with torch 2.13)'
_KERNELS = {SGD: "sgd", Adagrad: "adagrad", RowWiseAdagrad: "rowwise_adagrad"}
_POOLING = {"sum": 0, "mean": 1}
_HOST = 3  # FBGEMM's EmbeddingLocation.HOST: the table lives in host memory
_UNWEIGHTED = torch.empty(0)  # the kernels' per-sample weights when there are none (only read)


def _ops():
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except ImportError as e:
        raise MissingDependencyError(f'kernels="fbgemm" needs FBGEMM: {INSTALL}') from e
    return torch.ops.fbgemm


@functools.cache
def installed() -> bool:
    try:
        _ops()
    except ImportError:
        return False
    return True


def pool_half_sum(weights: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                  per_sample_weights: torch.Tensor | None) -> torch.Tensor:
    """Float32 sums of bags ``offsets`` (B + 1 of them, the last the number of entries)
    over rows ``index`` of float16 ``weights`` [n, dim] (contiguous, on the CPU)."""
    n, dim = weights.shape
    if per_sample_weights is None:  # an empty tensor here crashes the kernel; x * 1 is exact
        per_sample_weights = torch.ones(len(index))
    return _ops().split_embedding_codegen_forward_cpu(
        weights.view(-1), torch.zeros(1, dtype=torch.int64), torch.tensor([0, dim], dtype=torch.int32), dim,
        torch.tensor([0, n], dtype=torch.int64), index, offsets, _POOLING["sum"], per_sample_weights, 0,
    ).view(-1, dim)


def check(optimizer: RowOptimizer | None, mode: str, dtype: str, device: torch.device) -> None:
    """Raise, naming the fix, unless FBGEMM's kernels can train this module."""
    _ops()
    if optimizer is not None and type(optimizer) not in _KERNELS:
        names = ", ".join(k.__name__ for k in _KERNELS)
        raise SettingError(f'kernels="fbgemm" supports the optimizers {names}, not {type(optimizer).__name__}; use kernels="torch"')
    if mode not in _POOLING:
        raise SettingError(f'kernels="fbgemm" supports mode "sum" and "mean", not {mode!r}; use kernels="torch"')
    if dtype != "float32":
        raise SettingError(f'kernels="fbgemm" trains float32 rows, not {dtype}; use kernels="torch"')
    if device.type != "cpu":
        raise SettingError(f'kernels="fbgemm" runs on CPU tiers, not {device}; use kernels="torch"')


@functools.lru_cache(maxsize=16)
def _layout(n: int, dim: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The kernel's description of one table of ``n`` rows of ``dim`` in host memory: (placement,
    offset), column offsets, row offsets. Made once per shape (the kernel only reads them): making
    them took ~0.07 ms a step, of a resident step's ~20 ms (1M x 128, 1 thread)."""
    long = dict(dtype=torch.int64)
    return ((torch.tensor([_HOST], dtype=torch.int32), torch.zeros(1, **long)), torch.tensor([0, dim], dtype=torch.int32),
            torch.tensor([0, n], **long))


@functools.lru_cache(maxsize=16)
def _scalar(value: float) -> torch.Tensor:
    """The kernel's learning rate as a tensor, made once per value (the kernel only reads it):
    making one took 4 us of a small table's ~30 us call (1,024 entries, 1 thread)."""
    return torch.tensor(value, dtype=torch.float32)


def fused_step(optimizer: RowOptimizer, weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor,
               offsets: torch.Tensor, grad_out: torch.Tensor, per_sample_weights: torch.Tensor | None, mode: str) -> None:
    """Backward and optimizer step of bags ``offsets`` (B + 1 of them, the last the
    number of entries) over rows ``index`` of ``weights`` [n, dim] and ``state``
    [n, state_dim] (contiguous; updated in place), given the pooled gradient ``grad_out``."""
    n, dim = weights.shape
    table, dims, rows = _layout(n, dim)
    args = [
        grad_out.contiguous(), weights.view(-1), *table, dims, dim, rows, max(n, 1).bit_length(), index, offsets,
        _POOLING[mode], _UNWEIGHTED if per_sample_weights is None else per_sample_weights, False,
    ]
    if state.shape[1]:
        args += [state.view(-1), *table]
    args.append(_scalar(optimizer.lr))
    if not isinstance(optimizer, SGD):
        args.append(optimizer.eps)
    getattr(_ops(), f"split_embedding_backward_codegen_{_KERNELS[type(optimizer)]}_cpu")(*args)
