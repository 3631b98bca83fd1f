"""The device step's optimizer update as two compiled kernels, each one op.

tierstore::bag_update_ (tierstore.training.devstep) applies the optimizer at every entry
of the batch in the order of its sorted ids. As aten ops that is a gather of the slots,
the increment, an ``index_add_`` into the state, a gather of the state, the step's
element-wise ops, an ``index_add_`` into the weights and an ``index_fill_`` of the dirty
bits: 9 ops for Adagrad, each a pass over [ids, dim] (a kernel launch on a GPU). Here the
element-wise parts, the gathers and the scatters are two custom ops, each compiled by
inductor (a C++ loop nest on the CPU, Triton on a GPU):

- ``tierstore_kernels::state_step_``: each entry's slot, the state's increment added
  there, the state gathered back (the increment of a zero gradient is an exact zero);
- ``tierstore_kernels::weights_step_``: each entry's slot, the step added to the
  weights there, the slots marked dirty.

Between them only what a compiled kernel would round otherwise stays aten: a row
reduction of the gradient (RowWiseAdagrad's norm: aten's summation order) and the state's
square root (aten's on the CPU is not correctly rounded; a compiled kernel's is). The compiled
kernels are built to round as eager does: no FMA contraction (C++ and Triton), IEEE
division and no flush of denormals on a GPU, so the rows are the host step's bits. A
zero gradient leaves a row and its state exactly as they were, so the adds of every
entry of a row land in any order (the kernels' atomic adds) to the same bits.

Each kernel is compiled on first use (a few seconds, once per optimizer and process;
inductor's cache keeps the code between processes), with dynamic shapes and the
optimizer's numbers as inputs, so neither a new batch size nor a new lr recompiles. Where
inductor cannot compile (no C++ compiler on a CPU-only machine, no Triton), the same
functions run as aten ops, with a warning: the same rows, more ops.
"""
from __future__ import annotations

import threading
import warnings

import torch

from tierstore.optim import RowOptimizer

__all__ = ["state_step_", "warm", "weights_step_"]

# inductor's settings that make a kernel round each op as eager's aten op does
_EAGER_ROUNDING = {
    "cpp.enable_floating_point_contract_flag": "off",  # a * b + c stays two roundings
    "emulate_precision_casts": True,  # Triton: no fp fusion (FMA)
    "eager_numerics.division_rounding": True,  # Triton: div_rn, as eager CUDA divides
    "eager_numerics.disable_ftz": True,  # Triton: denormals kept, as eager CUDA keeps them
    "triton.autotune_pointwise": False,  # one config: no benchmarking, which syncs, at a step's first run
}


def _state(state, slots, perm, grads, reduced, kind, hyper):
    order = slots.index_select(0, perm)
    opt = RowOptimizer.of_class(kind)
    state.index_add_(0, order, opt.increment_with(hyper, grads, None if reduced is None else reduced.clone()))
    return state.index_select(0, order)


def _weights(weights, dirty, slots, perm, grads, root, kind, hyper):
    order = slots.index_select(0, perm)
    opt = RowOptimizer.of_class(kind)
    weights.index_add_(0, order, opt.step_with(hyper, None if root is None else root.clone(), grads.clone()))
    dirty.index_fill_(0, order, True)


class _Compiled:
    """``fn`` compiled by inductor on first use, or run as it is where that fails."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None
        self.failed: str | None = None
        self._lock = threading.Lock()

    def __call__(self, *args):
        if self.failed is None:
            with self._lock:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True, options=_EAGER_ROUNDING)
            try:
                # one dispatch state and grad mode for every call (a backward's, the warm-up's, an
                # OpCounter's): dynamo guards on them, and a change would recompile
                with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
                    return self.compiled(*args)
            except _compile_errors() as e:  # raised before the kernel runs: nothing has changed
                cause = getattr(e, "inner_exception", None) or e  # BackendCompilerFailed wraps the failure
                self.failed = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
                warnings.warn(f"tierstore's device step runs its optimizer update as aten ops (more ops a step, the same "
                              f"rows): inductor could not compile it ({self.failed})", RuntimeWarning, stacklevel=2)
        return self.fn(*args)


def _compile_errors() -> tuple[type[BaseException], ...]:
    # dynamo's (BackendCompilerFailed, a recompile limit hit...) and inductor's: raised while
    # compiling, before the kernel runs
    from torch._dynamo.exc import TorchDynamoException
    errors: list[type[BaseException]] = [TorchDynamoException]
    try:
        from torch._inductor.exc import InductorError
        errors.append(InductorError)
    except ImportError:  # older torch: BackendCompilerFailed wraps every inductor failure
        pass
    return tuple(errors)


_state_kernel = _Compiled(_state)
_weights_kernel = _Compiled(_weights)


@torch.library.custom_op("tierstore_kernels::state_step_", mutates_args=("state",))
def state_step_(state: torch.Tensor, slots: torch.Tensor, perm: torch.Tensor, grads: torch.Tensor,
                reduced: torch.Tensor | None, kind: str, hyper: list[float]) -> torch.Tensor:
    """The state of ``slots[perm]`` after the increment of ``grads`` (each entry's
    gradient, the row's sum at its last entry, zeros at the others), gathered per entry."""
    return _state_kernel(state, slots, perm, grads, reduced, kind, hyper)


@state_step_.register_fake
def _(state, slots, perm, grads, reduced, kind, hyper):
    return state.new_empty((perm.shape[0], state.shape[1]))


@torch.library.custom_op("tierstore_kernels::weights_step_", mutates_args=("weights", "dirty"))
def weights_step_(weights: torch.Tensor, dirty: torch.Tensor, slots: torch.Tensor, perm: torch.Tensor, grads: torch.Tensor,
                  root: torch.Tensor | None, kind: str, hyper: list[float]) -> None:
    """The step of each entry's gradient added to the weights at ``slots[perm]``, which are dirty then."""
    _weights_kernel(weights, dirty, slots, perm, grads, root, kind, hyper)


@weights_step_.register_fake
def _(weights, dirty, slots, perm, grads, root, kind, hyper):
    return None


def warm(dim: int, state_dim: int, device: torch.device, kind: str, hyper: list[float]) -> None:
    """Compile the update's kernels for rows of ``dim`` weights and ``state_dim`` state now,
    on scratch rows (nothing of the table changes): what a module calls as it opts in to the
    device step, so that a step's first run (timed, captured by CUDA graphs, or under
    ``torch.cuda.set_sync_debug_mode``) only runs them. Sizes that duck-size apart from
    the table's: the compiled shapes stay symbolic."""
    rows, n = 7, 5
    weights = torch.zeros((rows, dim), device=device)
    state = torch.zeros((rows, state_dim), device=device)
    dirty = torch.zeros(rows, dtype=torch.bool, device=device)
    slots, perm = torch.arange(n, device=device), torch.arange(n, device=device)
    grads = torch.zeros((n, dim), device=device)
    opt = RowOptimizer.of_class(kind)
    root = None
    with torch.no_grad():
        if state_dim:
            root = opt.root(state_step_(state, slots, perm, grads, opt.reduce(grads), kind, hyper))
        weights_step_(weights, dirty, slots, perm, grads, root, kind, hyper)
