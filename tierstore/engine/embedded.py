"""The embedded store's TableTrainer (``TieredStore.trainer(table)``): the rows are the store's own,
so a forward pools straight from its top tier, under the store's lock."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierstore.engine.table import Resident
from tierstore.engine.tiers import CacheTier
from tierstore.engine.trainer import DeviceRows, TableTrainer

if TYPE_CHECKING:
    from tierstore.store import TieredStore


class EmbeddedTableTrainer(TableTrainer):
    """An embedded store's TableTrainer (``store.trainer(table)``): the rows are the
    store's own, so a forward may pool straight from its top tier."""

    store: TieredStore

    @contextlib.contextmanager
    def resident(self, ids: torch.Tensor, admit: bool = False) -> Iterator[Resident | None]:
        # held steady: calls that would overwrite tier rows wait, as for a read gathering outside the lock
        s = self.store
        with s._lock:
            t = s._table_to_read(self.table)
            s._prefetcher.check(self.table)
            hit, top = None, t.hbm or t.ddr
            # a module computes on the store's device, whatever tier holds the rows: a table
            # with no HBM tier on a CUDA store is read (its rows go up), so its output and its
            # update do not move between the GPU and the host with the tier sizes
            if len(ids) and top is not None and top.device == s.device:
                hit = t.use_top_tier(ids) or (t.admit(ids) if admit else None)
            if hit is not None:
                s._gathers += 1
        if hit is None:
            yield None
            return
        try:
            yield hit
        finally:
            s._gather_done()

    def update_resident(self, slots: torch.Tensor, generation: int, update: Callable[[CacheTier], None]) -> bool:
        with self.store._lock:
            if not self.store._table_to_write(self.table).update_resident(slots, generation, update):
                return False
        self.written += 1
        return True

    def hold_resident(self) -> DeviceRows:
        s = self.store
        with s._lock:
            return s._table_to_read(self.table).hold_resident(s.device)

    def resolve(self, ids: torch.Tensor) -> tuple[Resident, np.ndarray]:
        s = self.store
        with s._lock:
            return s._table_to_write(self.table).resolve(ids.cpu())

    def release(self, pins: np.ndarray) -> None:
        with self.store._lock:
            table = self.store._tables.get(self.table)
            if table is not None and table.in_flight is not None:
                table.in_flight.release(pins)

    def admitted(self, uid: torch.Tensor) -> torch.Tensor | None:
        with self.store._lock:
            life = self.store._table(self.table).life
            if life.sketch is None:
                return None
            return torch.from_numpy(life.admitted(uid.cpu().numpy()))

    def reread(self, uid: torch.Tensor) -> torch.Tensor:
        # whether a backward re-reads depends on the tiers' sizes: so it is no step
        s = self.store
        with s._lock:
            return s._table_to_read(self.table).reread(uid.cpu()).to(s.device)
