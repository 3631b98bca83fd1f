"""The rows of the steps in flight: resolved ahead into a table's top tier, not yet done.

A device step over a cache (tierstore.training.devstep) gets its batch's slots from the
host a few batches ahead: the rows are brought into the top tier then, by a read's step
(tierstore.engine.step plans it), and must stay at those slots until the step is done,
whatever the steps resolved meanwhile need. ``InFlight`` counts, per slot of the top
tier, the steps in flight that use its row, and gives the planner what it reads: those
rows as used next (``next_use``, ``in_window``), so that it evicts them only when nothing
else is left, and then ``check`` refuses the plan before anything changes (the bug class
of FBGEMM#1201 and TorchRec#4191: a row evicted under a step still using it).
"""
from __future__ import annotations

import numpy as np
import torch

from tierstore.errors import UnsupportedError
from tierstore.engine.step import NOT_IN_WINDOW
from tierstore.engine.tiers import CacheTier


class InFlight:
    def __init__(self, table: str, tier: CacheTier):
        self.table = table
        self.tier = tier
        self.pins = np.zeros(tier.capacity, dtype=np.int32)
        self.rows = 0  # slots pinned by at least one step
        self._owner = np.zeros(tier.capacity, dtype=np.int32)  # pin's scratch: an entry per slot

    def pin(self, slots: torch.Tensor) -> np.ndarray:
        """Pin a step's rows (its entries' ``slots``); returns the slots to ``release``,
        each once. The distinct slots are the entries that own their slot after each wrote
        its position there: one entry per slot whichever write wins, in a pass over the
        batch (np.unique sorted it: 10x the time for 64k entries)."""
        s = slots.cpu().numpy()
        at = np.arange(len(s), dtype=np.int32)
        self._owner[s] = at
        pins = s[self._owner[s] == at]
        self.rows += int(np.count_nonzero(self.pins[pins] == 0))
        self.pins[pins] += 1
        return pins

    def release(self, pins: np.ndarray) -> None:
        self.pins[pins] -= 1
        self.rows -= int(np.count_nonzero(self.pins[pins] == 0))

    def next_use(self, tier: CacheTier, use: np.ndarray | None) -> np.ndarray | None:
        """The planner's next use of each slot of ``tier``: the pinned rows' first of all."""
        if not self.rows or tier is not self.tier:
            return use
        return np.where(self.pins > 0, 0, NOT_IN_WINDOW if use is None else use)

    def in_window(self, ids: np.ndarray, named: np.ndarray | None) -> np.ndarray | None:
        """Which of the planner's candidate victims ``ids`` are used next: ``named``, or pinned."""
        if not self.rows:
            return named
        slots = self.tier.lookup(torch.from_numpy(ids)).cpu().numpy()
        pinned = np.zeros(len(ids), dtype=bool)
        pinned[slots >= 0] = self.pins[slots[slots >= 0]] > 0
        return pinned if named is None else named | pinned

    def check(self, evict: np.ndarray) -> None:
        """Refuse a plan that evicts (``evict``: slots of the tier) a row of a step in flight."""
        taken = int(np.count_nonzero(self.pins[evict])) if self.rows else 0
        if taken:
            raise UnsupportedError(
                f"table {self.table!r}: this step needs {taken} of the {self.rows} rows that steps in flight use in the "
                f"{self.tier.name} tier ({self.tier.capacity} rows); resolve fewer batches ahead (a smaller depth) or "
                "give the tier more rows")
