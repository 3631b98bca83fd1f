"""Counting what a piece of PyTorch code dispatches: every op, the ops that make the
host wait for the device, and the ops whose output size depends on the data.

A step that is to run without host syncs, or be captured whole by CUDA graphs or
``torch.compile(fullgraph=True)``, must dispatch none of the last two kinds. The
counts hold on the CPU too, where nothing waits: an ``.item()`` is still an
``aten._local_scalar_dense`` there, so a CPU run shows what a GPU would wait on."""
from __future__ import annotations

from collections import Counter

import torch
from torch._library import custom_ops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# ops that return a Python value read from a tensor: on a GPU the host waits for the device
HOST_SYNCS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})
# ops whose output size depends on the values of their input: their result's shape is only
# known once the device has computed it, so they sync too and no static graph can hold them
DATA_DEPENDENT = frozenset({"nonzero", "masked_select", "_unique", "_unique2", "unique_consecutive",
                            "unique_dim", "unique_dim_consecutive", "bincount", "histc"})


class OpCounter(TorchDispatchMode):
    """While active, counts the ops dispatched by this thread (and by autograd's threads
    on its behalf), by name (``aten.nonzero``, ``tierstore.bag_lookup``, ...). A custom op
    counts once, as a leaf: what its kernel runs is not seen, but for the custom ops
    of the namespaces in ``inside`` (e.g. ("tierstore",)), whose Python bodies run
    under the counter, their ops counted too."""

    def __init__(self, inside: tuple[str, ...] = ()):
        super().__init__()
        self.inside = inside
        self.ops: Counter[str] = Counter()
        self.dispatched: set = set()  # the ops themselves (OpOverloads), whose tags say what they do
        self.device_to_host = 0  # ops with an input on an accelerator and an output in host memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in self.inside:
            with self:
                out = custom_ops.OPDEFS[func.name()]._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        self.ops[f"{func.namespace}.{func.overloadpacket.__name__}"] += 1
        self.dispatched.add(func)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.device.type != "cpu" for t in ins) and any(t.device.type == "cpu" for t in outs):
            self.device_to_host += 1
        return out

    def of(self, names) -> int:
        return sum(n for op, n in self.ops.items() if op.split(".", 1)[1] in names)

    def summary(self) -> dict:
        """The counts as plain values: aten ops, other ops (custom ops), the ops that ran
        as one piece (``leaf_ops``: aten ops and the custom ops whose insides were not
        counted, such as compiled kernels: what a step launches), host syncs,
        data-dependent ops and device-to-host copies, and every op by name."""
        aten = sum(n for op, n in self.ops.items() if op.startswith("aten."))
        leaf = sum(n for op, n in self.ops.items() if op.split(".", 1)[0] not in self.inside)
        return {"aten_ops": aten, "other_ops": sum(self.ops.values()) - aten, "leaf_ops": leaf,
                "host_syncs": self.of(HOST_SYNCS), "data_dependent": self.of(DATA_DEPENDENT),
                "device_to_host": self.device_to_host, "ops": dict(sorted(self.ops.items()))}
