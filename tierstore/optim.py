"""Row optimizers fused into TieredEmbeddingBag's backward.

Each optimizer keeps its per-row state in the row record itself (the store's
``state_dim`` columns after the weights), so state follows the row through
HBM, DDR and LMDB and survives eviction, flush and reopen. An optimizer says
how many state floats a row of ``dim`` weights needs (``state_dim(dim)``) and
updates ``[n, dim + state_dim]`` rows in place from ``[n, dim]`` summed
gradients, one vectorized step for every row a backward touched.

A row counts as touched when its id appeared in the forward's input (padding
entries excepted), even if its gradient is zero: it gets one optimizer step,
as torch.optim does for the rows of a sparse gradient.

``lr`` is a plain attribute read at each backward, so a schedule is
``opt.lr = base_lr * schedule(step)`` between steps.
"""
from __future__ import annotations

import math

import torch

from tierstore.errors import BadValuesError, SettingError

__all__ = ["Adagrad", "Adam", "RowOptimizer", "RowWiseAdagrad", "SGD"]


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SettingError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class RowOptimizer:
    """Base class: a learning rate, a state size per row, a vectorized update."""

    # whether a step couples a row's columns (its state is per row, not per column): a
    # column shard then needs the whole row's gradient to step its columns as the whole row would
    row_coupled: bool = False
    # whether a step is "state += increment(g); weights += step(state, g)" with a zero
    # gradient leaving both exactly as they were: then a device step may apply it with
    # index_add_ at every entry of a batch, zeros at all but one entry of each row
    # (tierstore.training.devstep), in any order, to the same bits
    additive: bool = True

    def __init__(self, lr: float):
        self.lr = lr

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        # 0 is what a warm-up schedule's first step gives, and torch.optim accepts it
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise SettingError(f"lr must be a finite number >= 0, got {value!r}")
        self._lr = float(value)

    def state_dim(self, dim: int) -> int:
        """float32 state values stored after the ``dim`` weights of each row."""
        raise NotImplementedError

    def update(self, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply one step in place to ``rows`` [n, dim + state_dim] given ``grad`` [n, dim]."""
        if rows.dim() != 2 or grad.dim() != 2 or rows.shape[0] != grad.shape[0]:
            raise BadValuesError(f"rows must be [n, dim + state_dim] and grad [n, dim]; got {tuple(rows.shape)} and {tuple(grad.shape)}")
        dim = grad.shape[1]
        if rows.shape[1] != dim + self.state_dim(dim):
            raise BadValuesError(
                f"{type(self).__name__} needs rows of width dim + state_dim = {dim} + {self.state_dim(dim)}, "
                f"got width {rows.shape[1]}; create the table with state_dim=optimizer.state_dim(dim)"
            )
        if len(rows):
            self.step(rows[:, :dim], rows[:, dim:], grad.clone())

    def step(self, weights: torch.Tensor, state: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply one step in place to ``weights`` [n, dim] and ``state`` [n, state_dim]
        (views of stored rows); ``grad`` [n, dim] is overwritten."""
        weights.add_(self.direction(state, grad))

    def direction(self, state: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Update ``state`` in place and return the step x: weights += x. Added as
        one ``add_`` here, or by ``index_add_`` to a tier's rows in place (the same
        rounding, at a third of the cost of gathering, adding and copying back).
        Element-wise ops on ``state`` only (and reductions over ``grad``, which may
        be overwritten), so the result does not depend on either's layout."""
        increment = self.increment(grad)
        if increment is not None:
            state.add_(increment)
        return self.step_from(state, grad)

    def increment(self, grad: torch.Tensor) -> torch.Tensor | None:
        """What a step adds to the state (None: no state), for an ``additive`` optimizer."""
        return self.increment_with(self.hyper(), grad, self.reduce(grad))

    def step_from(self, state: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The step x (weights += x) from the state after its increment; ``grad`` may be overwritten."""
        return self.step_with(self.hyper(), self.root(state), grad)

    # An additive step in four parts, so that the device step (tierstore.training.kernels)
    # fuses the element-wise ones into compiled kernels and leaves the others to aten,
    # whose rounding a compiled kernel would not repeat: a reduction over a row (aten's
    # summation order) and the state's square root (aten's on the CPU is not correctly
    # rounded, a compiled kernel's is). The element-wise parts are static functions of ``hyper()``, so a
    # kernel compiled from them takes the numbers as inputs and a new lr recompiles nothing.
    @staticmethod
    def reduce(grad: torch.Tensor) -> torch.Tensor | None:
        """Row reductions of the gradient the increment needs (aten), or None."""
        return None

    @staticmethod
    def increment_with(hyper: list[float], grad: torch.Tensor, reduced: torch.Tensor | None) -> torch.Tensor | None:
        """The increment, element-wise from ``grad`` and ``reduce(grad)``; ``reduced`` may be overwritten."""
        return None

    @staticmethod
    def root(state: torch.Tensor) -> torch.Tensor | None:
        """What the step needs of the state (aten), or None (no state)."""
        return None

    @staticmethod
    def step_with(hyper: list[float], root: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
        """The step x, element-wise from ``root`` and ``grad``; either may be overwritten."""
        raise NotImplementedError

    def hyper(self) -> list[float]:
        """The numbers that define a step, as :meth:`of` takes them back (a custom op's arguments)."""
        return list(self._hyper().values())

    @staticmethod
    def of(kind: str, hyper: list[float]) -> "RowOptimizer":
        """The optimizer of class name ``kind`` with the numbers ``hyper()`` gave."""
        cls = RowOptimizer.of_class(kind)
        return cls(hyper[0], (hyper[1], hyper[2]), hyper[3]) if cls is Adam else cls(*hyper)

    @staticmethod
    def of_class(kind: str) -> type["RowOptimizer"]:
        """The optimizer class of name ``kind``."""
        return {c.__name__: c for c in (SGD, Adagrad, RowWiseAdagrad, Adam)}[kind]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._hyper().items())})"

    def _hyper(self) -> dict:
        return {"lr": self.lr}


class SGD(RowOptimizer):
    """w -= lr * g. No state; matches torch.optim.SGD on sparse gradients."""

    def __init__(self, lr: float = 0.01):
        super().__init__(lr)

    def state_dim(self, dim: int) -> int:
        return 0

    @staticmethod
    def step_with(hyper, root, grad):
        return grad.mul_(-hyper[0])


class Adagrad(RowOptimizer):
    """Element-wise Adagrad, as torch.optim.Adagrad on sparse gradients
    (lr_decay=0, weight_decay=0, initial_accumulator_value=0): the same state bit
    for bit on CPU, weights within one rounding of the step (see direction).

    State: one accumulator per weight. s += g*g; w -= lr * g / (sqrt(s) + eps).
    """

    def __init__(self, lr: float = 0.01, eps: float = 1e-10):
        super().__init__(lr)
        self.eps = _positive("eps", eps)

    def state_dim(self, dim: int) -> int:
        return dim

    # torch.optim.Adagrad's op sequence, except that its weights.add_(g / d, alpha=-lr)
    # rounds once (fused) where -lr * (g / d) is rounded before the add
    @staticmethod
    def increment_with(hyper, grad, reduced):
        return grad.pow(2)

    @staticmethod
    def root(state):
        return state.sqrt()

    @staticmethod
    def step_with(hyper, root, grad):
        return grad.div_(root.add_(hyper[1])).mul_(-hyper[0])

    def _hyper(self):
        return {"lr": self.lr, "eps": self.eps}


class RowWiseAdagrad(RowOptimizer):
    """Row-wise Adagrad as DLRM trainers (FBGEMM) use it: one accumulator per row.

    s += mean(g*g over the row); w -= lr * g / (sqrt(s) + eps).
    """

    row_coupled = True

    def __init__(self, lr: float = 0.01, eps: float = 1e-8):
        super().__init__(lr)
        self.eps = _positive("eps", eps)

    def state_dim(self, dim: int) -> int:
        return 1

    # mean(g*g) as |g|^2 / dim: no [n, dim] temporary, and 10x faster than vecdot here
    @staticmethod
    def reduce(grad):
        return torch.linalg.vector_norm(grad, dim=1, keepdim=True)

    @staticmethod
    def increment_with(hyper, grad, reduced):
        return reduced.square_().div_(grad.shape[1])

    root = staticmethod(Adagrad.root)
    step_with = staticmethod(Adagrad.step_with)

    def _hyper(self):
        return {"lr": self.lr, "eps": self.eps}


class Adam(RowOptimizer):
    """Adam with a step counter per row ("lazy" Adam, the usual choice for embeddings).

    State per row: first moment m [dim], second moment v [dim], step count t [1].
    Only touched rows are updated, each with its own t, so a row's trajectory
    equals torch.optim.Adam run on that row alone over the steps that touched it:
    t += 1; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
    w -= lr/(1-b1**t) * m / (sqrt(v)/sqrt(1-b2**t) + eps).
    Bit for bit on CPU what torch.optim.Adam (amsgrad=False, weight_decay=0) computes
    for that row. t is a float32, exact up to 2**24 steps of one row.
    """

    additive = False  # a zero gradient still moves m, v and t

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(lr)
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
            raise SettingError(f"betas must be two numbers in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = _positive("eps", eps)

    def state_dim(self, dim: int) -> int:
        return 2 * dim + 1

    def direction(self, state, grad):
        b1, b2 = self.betas
        dim = grad.shape[1]
        m, v, t = state[:, :dim], state[:, dim : 2 * dim], state[:, 2 * dim :]
        t.add_(1.0)
        m.lerp_(grad, 1.0 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        # the op sequence of torch.optim.Adam (single-tensor path): bias corrections
        # in float64 from the step count, then w + (-step_size * m) / denom
        t64 = t.double()
        step_size = (self.lr / (1.0 - torch.pow(b1, t64))).float()
        bc2_sqrt = torch.pow(1.0 - torch.pow(b2, t64), 0.5).float()
        denom = v.sqrt().div_(bc2_sqrt).add_(self.eps)
        return m.mul(-step_size).div_(denom)

    def _hyper(self):
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps}

    def hyper(self) -> list[float]:
        return [self.lr, *self.betas, self.eps]
