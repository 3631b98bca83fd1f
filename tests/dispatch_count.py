"""Counting the ops a step dispatches: what the sync-free goals of the device step are checked with.

``with DispatchCount() as ops: step()`` records every aten op the step runs, those inside
tierstore's custom ops included (their kernels run under the mode again), and sorts out
the ones that make a device wait or the host wait for it: ops tagged as having a
data-dependent output (``.item()``: aten._local_scalar_dense) or an output whose size
depends on the data (nonzero, unique*, masked_select, ...), and copies from a device to
the host.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch._library import custom_ops
from torch.utils._python_dispatch import TorchDispatchMode

_WAITS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)


def _device_of(x) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


class DispatchCount(TorchDispatchMode):
    def __init__(self, inner: tuple[str, ...] = ("tierstore",)):
        super().__init__()
        self.inner = inner  # namespaces of custom ops whose own ops are counted
        self.ops: Counter[str] = Counter()
        self.waits: list[str] = []  # data-dependent output values or sizes
        self.to_host: list[str] = []  # copies from a device to the host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if func.namespace in self.inner:
            kernel = custom_ops.OPDEFS[func.name()]._init_fn  # the op's Python body: its aten ops run under the mode
            with self:
                return kernel(*args, **kwargs)
        self.ops[name] += 1
        if any(tag in func.tags for tag in _WAITS):
            self.waits.append(name)
        src = _device_of(args[0]) if args else None
        if name in ("aten._to_copy", "aten.to") and src is not None and src.type != "cpu":
            if torch.device(kwargs.get("device") or src).type == "cpu":
                self.to_host.append(name)
        if name == "aten.copy_" and len(args) > 1:
            dst, frm = _device_of(args[0]), _device_of(args[1])
            if dst is not None and frm is not None and dst.type == "cpu" and frm.type != "cpu":
                self.to_host.append(name)
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.ops.values())
