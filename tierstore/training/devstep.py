"""The training step of a table held in its top tier, as device ops with static shapes.

When every row of a table is in its top tier (``store.trainer(table).hold_resident()``:
tierstore.engine.trainer.DeviceRows), a step needs nothing of the host: the
tier's id -> slot map is a tensor on the device (the dense map: one int32 per id),
and the step is two custom ops, so torch.compile and torch.export see each as one
node and neither waits for the device:

- each id's slot: a gather from the map (held rows), or the slots the host resolved
  ahead (a cache: tierstore.engine.inflight keeps them in place until the step is done);
- ``tierstore::bag_lookup``: the bags pooled from the tier's weights by slot (embedding_bag);
- ``tierstore::bag_update_`` (its backward, registered with register_autograd): the
  duplicate ids of the batch combined and the fused optimizer's step applied to the
  tier's rows in place (declared in mutates_args), the rows marked dirty.

No op has an output whose size depends on the data, and no value goes to the host:
duplicates are combined without unique(). The batch's ids are sorted (torch.sort, whose
order among equal ids is the host step's and torch's sparse gradients'); each entry's
run start is a searchsorted of the sorted ids into themselves; one embedding_bag over
the output gradient, with those starts as offsets, sums each row's entries in that order
(no atomics: the same bits on any device) into the last position of its run, zeros elsewhere. The optimizer
is applied at every position with index_add_: a zero gradient leaves a row and its
state exactly as they were (RowOptimizer.additive), so the update is the row's one
step whatever the order the duplicates land in. The sums are those of
tierstore.training.bags (the host step's), so the rows are the same bits either way.

Ids out of range fail as torch.nn.EmbeddingBag's do on the device (an IndexError on the
CPU, a device-side assert on CUDA): checking them first would wait for the device.
"""
from __future__ import annotations

import torch

from tierstore.engine.counters import count_hits
from tierstore.optim import RowOptimizer
from tierstore.training.bags import MODES, RUN, mean_grads
from tierstore.training import kernels
from tierstore.training.kernels import state_step_, weights_step_

__all__ = ["bag_lookup", "bag_update_", "device_step", "run_sums", "warm"]


@torch.library.custom_op("tierstore::bag_lookup", mutates_args=())
def bag_lookup(weights: torch.Tensor, state: torch.Tensor, dirty: torch.Tensor, slots: torch.Tensor,
               ids: torch.Tensor, offsets: torch.Tensor, anchor: torch.Tensor, pooling: int, include_last: bool,
               kind: str, hyper: list[float], counter: int) -> torch.Tensor:
    """The bags [B, dim] pooled from the rows at ``slots`` (of ``ids``), each id counted a hit
    in ``counter``'s TierCounters (tierstore.engine.counters.counting; -1: none): from the
    shape, on the host, so a repeated id counts each time (its distinct rows would wait for
    the device). ``state``, ``dirty``, ``anchor``, ``kind`` and ``hyper`` are the backward's
    (an empty ``anchor`` requiring grad puts the op in the graph)."""
    count_hits(counter, slots.shape[0])
    return torch.embedding_bag(weights, slots, offsets, False, pooling, False, None, include_last)[0]


@bag_lookup.register_fake
def _(weights, state, dirty, slots, ids, offsets, anchor, pooling, include_last, kind, hyper, counter):
    bags = offsets.shape[0] - 1 if include_last else offsets.shape[0]
    return weights.new_empty((bags, weights.shape[1]))


@torch.library.custom_op("tierstore::bag_update_", mutates_args=("weights", "state", "dirty"))
def bag_update_(weights: torch.Tensor, state: torch.Tensor, dirty: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
                offsets: torch.Tensor, grad_out: torch.Tensor, pooling: int, include_last: bool, kind: str,
                hyper: list[float]) -> None:
    """One fused optimizer step (``RowOptimizer.of(kind, hyper)``) of the rows of ``ids``, at
    ``slots``, from the gradient of the bags they were pooled into, in place."""
    n = slots.shape[0]
    if pooling == MODES["mean"]:
        ends = offsets[1:] if include_last else torch.cat([offsets[1:], offsets.new_full((1,), n)])
        grad_out = mean_grads(grad_out, ends - offsets[: ends.shape[0]])
    # the entries by id in torch.sort's order, as tierstore.training.bags.Rows groups them (and
    # torch's sparse gradients are coalesced): each row's entries are summed in the host step's order
    by_id, perm = torch.sort(ids)
    bag = torch.searchsorted(offsets, perm, right=True) - 1  # the bag of each sorted entry
    starts = torch.searchsorted(by_id, by_id)  # where each entry's run of equal ids starts
    grads = run_sums(grad_out, bag, starts)
    # the update: the compiled kernels of tierstore.training.kernels, with aten's row
    # reduction and square root between them (what a kernel would round otherwise)
    optimizer = RowOptimizer.of_class(kind)
    root = None
    if state.shape[1]:
        rows = state_step_(state, slots, perm, grads, optimizer.reduce(grads), kind, hyper)
        root = optimizer.root(rows)
    weights_step_(weights, dirty, slots, perm, grads, root, kind, hyper)


@bag_update_.register_fake
def _(weights, state, dirty, ids, slots, offsets, grad_out, pooling, include_last, kind, hyper):
    return None


def run_sums(src: torch.Tensor, index: torch.Tensor, starts: torch.Tensor, pieces: bool | None = None) -> torch.Tensor:
    """[n, dim]: at the last position of each run of entries (``starts``: where each
    position's run starts), the sum of ``src[index]`` over the run in order; zeros elsewhere.
    Bag i of offsets ``starts`` is [starts[i], starts[i + 1]): empty but at a run's last entry.
    On a GPU (or with ``pieces``), as tierstore.training.bags.sum_rows sums there: in pieces of RUN entries, then
    pieces of RUN pieces...; here the levels are as many as the batch's length needs (static),
    each summing the previous one's pieces (and its exact zeros) in order: the same bits."""
    if src.device.type == "cuda" if pieces is None else pieces:
        n = index.shape[0]
        at = torch.arange(n, device=index.device)
        span = RUN
        while span < n:  # the pieces of ``span`` entries of each run, summed at their last entries
            src = torch.embedding_bag(src, index, starts + (at - starts) // span * span, False, 0, False, None, False)[0]
            index, span = at, span * RUN
    return torch.embedding_bag(src, index, starts, False, 0, False, None, False)[0]


def _setup(ctx, inputs, output):
    weights, state, dirty, slots, ids, offsets, _, pooling, include_last, kind, hyper, _ = inputs
    ctx.save_for_backward(ids, slots, offsets)
    # the rows and state are what the backward updates, not values it reads back: kept by
    # reference, without save_for_backward's version check, so that two lookups of one table
    # in a step (a table shared by two features) each update the rows the other left
    ctx.table = (weights, state, dirty)
    ctx.args = (pooling, include_last, kind, hyper)


def _backward(ctx, grad_out):
    ids, slots, offsets = ctx.saved_tensors
    bag_update_(*ctx.table, ids, slots, offsets, grad_out.contiguous(), *ctx.args)
    return None, None, None, None, None, None, None, None, None, None, None, None


bag_lookup.register_autograd(_backward, setup_context=_setup)


def device_step(rows, ids: torch.Tensor, slots: torch.Tensor | None, offsets: torch.Tensor, mode: str,
                include_last: bool, optimizer: RowOptimizer | None, anchor: torch.Tensor | None) -> torch.Tensor:
    """The bags of ``ids`` pooled from ``rows`` (DeviceRows) at ``slots`` (each id's, int64; None:
    looked up in ``rows.slot_map``); with ``anchor`` (an empty tensor requiring grad), its
    backward updates them with ``optimizer``."""
    kind, hyper = ("SGD", [0.0]) if optimizer is None else (type(optimizer).__name__, optimizer.hyper())
    if anchor is None:
        anchor = rows.weights.new_empty(0)
    if slots is None:
        slots = rows.slot_map.index_select(0, ids).long()  # int64, as index_fill_ takes them
    return bag_lookup(rows.weights, rows.state, rows.dirty, slots, ids, offsets, anchor, MODES[mode],
                      include_last, kind, hyper, rows.counters)


def warm(optimizer: RowOptimizer | None, dim: int, device: torch.device) -> None:
    """Compile the update's kernels (tierstore.training.kernels) for a table of ``dim`` now, as
    a module opts in to the device step: its first step then compiles nothing."""
    if optimizer is not None:
        kernels.warm(dim, optimizer.state_dim(dim), device, type(optimizer).__name__, optimizer.hyper())
