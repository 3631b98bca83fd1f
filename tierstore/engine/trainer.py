"""The store's side of training one table: ``store.trainer(table)``, a TableTrainer.

The training modules (tierstore.nn's TieredEmbeddingBag, the shard owners of
tierstore.distributed) read and write rows through a store's public calls
(tierstore.engine.interface.EmbeddingStore). What else a training step needs of the
store is declared here, so that no module reaches into a store's internals:

- a forward that pools straight from the top tier's rows, held steady meanwhile
  (``resident``), and its backward's update of those rows in place
  (``update_resident``);
- the key of each update's stochastic rounding (``update_key``);
- which rows' updates admission keeps (``admitted``), and the rows as they are
  now, without a step, for a backward whose forward's copy is stale (``reread``);
- how many updates the modules' backwards have written (``written``, counted by
  ``write_update`` and ``update_resident``): a backward whose forward read its
  rows before another backward wrote re-reads them rather than overwrite that
  update with its stale copy;
- every row of a table held in its top tier for the device step (``hold_resident``,
  ``DeviceRows``: tierstore.training.devstep), which then needs nothing of the host;
  or a batch's rows brought there ahead of its device step and pinned until it is done
  (``resolve``, ``release``).

A store keeps one TableTrainer per table for its life, so every module training
a table sees the same count. The embedded TieredStore (tierstore.store) and the
daemon client (tierstore.daemon.client, whose forwards always read) each implement it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, NamedTuple

import torch

from tierstore.errors import UnsupportedError
from tierstore.precision import update_key

if TYPE_CHECKING:
    from tierstore.engine.interface import EmbeddingStore
    from tierstore.engine.table import Resident
    from tierstore.engine.tiers import CacheTier


class DeviceRows(NamedTuple):
    """A table's rows as the device step uses them: every row of the table in one tier,
    which keeps them in place while ``valid()`` (no slot changed owner since)."""
    tier: "CacheTier"
    generation: int  # the tier's, when every row was there
    weights: torch.Tensor  # [capacity, dim]: the tier's own tensors, updated in place
    state: torch.Tensor  # [capacity, state_dim]
    dirty: torch.Tensor  # [capacity] bool
    slot_map: torch.Tensor | None  # [num_rows] the slot of each id, on the tier's device (None: slots come resolved)
    counters: int = -1  # devstep.counting's key of the tier's counters, where a held step's lookups count (-1: counted at resolve)

    def valid(self) -> bool:
        return self.tier.generation == self.generation


class TableTrainer(ABC):
    """What a training module uses of a store for one table, beside read() and write()."""

    def __init__(self, store: "EmbeddingStore", table: str, updates: dict[str, int]):
        """``updates``: the store's count of each table's updates, which update_key advances
        (an embedded store makes it durable at flush; a daemon client keeps its own)."""
        self.store = store
        self.table = table
        self.written = 0  # updates the modules' backwards have written to the table
        self._updates = updates

    @abstractmethod
    def resident(self, ids: torch.Tensor, admit: bool = False) -> AbstractContextManager["Resident | None"]:
        """A forward's rows pinned in place: when every id (int64, in range) is in the top
        tier, or, with ``admit``, once this use has brought them all there (unless it has
        more rows than the tier holds), the use is counted exactly as
        ``store.read(table, ids)`` counts it and the context yields where the rows are
        (``hit.tier``, ``hit.slots``, ``hit.generation``), held steady while the caller
        computes from ``hit.tier.weights``; else it yields None, having changed nothing,
        and the caller reads."""

    @abstractmethod
    def update_resident(self, slots: torch.Tensor, generation: int, update: Callable[["CacheTier"], None]) -> bool:
        """A resident forward's backward: ``update(top tier)`` changes the rows at ``slots``
        in place (weights and state), which are then dirty as after a
        ``write(..., with_state=True)``, and the update is counted in ``written``, if no slot
        of the tier changed owner since ``generation``. Returns False, having changed
        nothing, if one did (the caller then updates rows it reads)."""

    def hold_resident(self) -> DeviceRows:
        """Bring every row of the table into its top tier and return them as the device
        step uses them. An UnsupportedError where the store cannot (a daemon's rows, an
        unbounded id space, admission or TTL, a top tier smaller than the table)."""
        raise UnsupportedError(f"{type(self.store).__name__} keeps table {self.table!r}'s rows out of this process: "
                               "the device step needs an embedded TieredStore")

    def resolve(self, ids: torch.Tensor) -> tuple["Resident", object]:
        """A step ahead: every row of ``ids`` brought into the top tier (a read's step, its
        use counted) and pinned there until ``release(pins)``; returns where the rows are
        (``hit.slots``: each id's slot, on the tier's device) and the pins."""
        raise UnsupportedError(f"{type(self.store).__name__} keeps table {self.table!r}'s rows out of this process: "
                               "the device step needs an embedded TieredStore")

    def release(self, pins) -> None:
        """A resolved step is done: its rows may leave the top tier again."""

    def update_key(self) -> int:
        """The stochastic-rounding key of the table's next update (tierstore.precision):
        each call counts one update."""
        count = self._updates.get(self.table, 0)
        self._updates[self.table] = count + 1
        return update_key(self.table, count)

    @abstractmethod
    def admitted(self, uid: torch.Tensor) -> torch.Tensor | None:
        """Which of the sorted unique ids an update may change now, the step's read done
        (admit_after); None when all may."""

    @abstractmethod
    def reread(self, uid: torch.Tensor) -> torch.Tensor:
        """The rows, with state, of sorted unique ids as they are now, for a backward whose
        forward's copy is stale: not a step, no use, nothing moves between tiers."""

    def write_update(self, uid: torch.Tensor, rows: torch.Tensor) -> None:
        """Write a backward's updated rows (with state) and count the update in ``written``."""
        self.store.write(self.table, uid, rows, with_state=True)
        self.written += 1
