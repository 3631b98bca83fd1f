"""The backward's fused update of a TieredEmbeddingBag (tierstore.nn.bag): in place on the
top tier's rows after a resident forward, else on the rows the forward read, written back.
Both give the same bits (the module's docstring: determinism)."""
from __future__ import annotations

import torch

from tierstore.training import fbgemm
from tierstore.training.bags import Bags, row_grads
from tierstore.precision import round_stochastic


class BagUpdates:
    """TieredEmbeddingBag's backward: it uses the module's store, table, config, optimizer,
    kernels and dtype."""

    def _backward_in_place(self, bags: Bags, hit, grad_out: torch.Tensor, psw) -> None:
        """The backward of a resident forward: the update runs on the tier's rows in
        place, unless a slot changed owner since the forward (then by id, as
        _backward_from_rows does). The same update either way."""
        trainer = self.store.trainer(self.table)
        key = trainer.update_key()
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
            grads = row_grads(self.config.mode, bags, bags.rows, grad_out, psw, None)
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
        if not trainer.update_resident(slots, hit.generation, update):
            self._backward_from_rows(bags, grad_out, psw, None, None, 0, key)

    def _backward_from_rows(self, bags: Bags, grad_out: torch.Tensor, psw, max_idx, rows: torch.Tensor | None, writes: int,
                            key: int | None = None) -> None:
        """The backward of a forward that read its rows (``rows``, with state, when
        ``writes`` was the table's count of backwards written): update them and write
        them back."""
        uid, dim = bags.rows.uid, self.config.embedding_dim
        trainer = self.store.trainer(self.table)
        if key is None:
            key = trainer.update_key()
        if rows is None or trainer.written != writes:
            # another backward wrote rows since this forward read them: update the current values
            # with admission or TTL, not a step: they count steps, and whether this happens depends on the tiers
            rows = trainer.reread(uid) if self.store.spec(self.table).lived else self.store.read(self.table, uid, with_state=True)
        if self.kernels == "fbgemm":
            weights, state = rows[:, :dim].contiguous(), rows[:, dim:].contiguous()
            fbgemm.fused_step(self.optimizer, weights, state, bags.rows.positions(), bags.ends(), grad_out, psw, self.config.mode)
            rows = torch.cat([weights, state], dim=1)
        else:
            grads = row_grads(self.config.mode, bags, bags.rows, grad_out, psw, max_idx)
            self.optimizer.step(rows[:, :dim], rows[:, dim:], grads.to(rows.device))
            if self.dtype != "float32":
                rows[:, :dim] = round_stochastic(rows[:, :dim], self.dtype, uid, key)
        if bags.admitted is not None:  # rows not admitted keep no update
            uid, rows = uid[bags.admitted], rows[bags.admitted.to(rows.device)]
        trainer.write_update(uid, rows)


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
