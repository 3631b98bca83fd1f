"""A table's row life in its step (docs/admission.md): admission and TTL wrap the step of
tierstore.engine.table (_lived_access), expire idle or too-small rows wherever they are, and
give each row on its way to LMDB its last-use step. The counts themselves are
tierstore.engine.admission's (RowLife); this is what a TableStore does with them."""
from __future__ import annotations

import numpy as np
import torch

from tierstore.io import find_sorted
from tierstore.spec import initial_rows
from tierstore.engine.counters import restored_on_error
from tierstore.engine.tiers import CacheTier


class LivedRows:
    """TableStore's part for unbounded id spaces: admission and TTL. It uses the table's
    life, counters, shared parts, _backend_rows, _cached and _access."""

    def _lived_access(self, uid: torch.Tensor, use_clock: torch.Tensor):
        """_access for a table with admission or TTL: the step is counted (the sketch,
        the step number), rows idle too long read as initial, and with TTL the rows
        the step may keep are marked dirty, so that their last-use step reaches
        LMDB. A failure takes the count back."""
        life, c = self.life, self.counters
        uid_np = uid.numpy()
        admitted = life.begin_step(uid_np, self._shared.use_clock)
        # a readonly store writes nothing: its reads follow the rule but keep no last-use steps
        refresh = torch.from_numpy(admitted) if life.ttl_steps is not None and not self._shared.readonly else None
        try:
            with restored_on_error([c]):
                if life.resets:
                    for tier, slots, _ in self._cached(uid)[0]:
                        self._expire_cached(tier, slots.to(tier.device))
                result = self._access(uid, use_clock, refresh)
                if refresh is not None:
                    self._mark_dirty(uid[refresh])
        except BaseException:
            life.abort_step()
            raise
        life.end_step()
        if life.sketch is not None:
            c.life.admitted += int(admitted.sum())
            c.life.rejected += len(uid_np) - int(admitted.sum())
        cutoff = life.sweep_cutoff()
        if not self._shared.readonly and ((cutoff is not None and cutoff >= 0) or life.l2_below is not None):
            self._backend_rows.writeback.sweeps[self.spec.name] = (cutoff, life.l2_below)
        return result

    def _mark_dirty(self, ids: torch.Tensor) -> None:
        for tier, slots, _ in self._cached(ids)[0]:
            tier.dirty[slots.to(tier.device)] = True

    def _expire_cached(self, tier: CacheTier, slots: torch.Tensor) -> torch.Tensor:
        """Cached rows at ``slots`` idle ttl_steps or more, or below evict_l2_below, get
        their initial values (they read as such wherever they are); returns the mask of those."""
        life = self.life
        dead = life.too_small(tier.gather(slots, tier.dim).cpu().numpy())
        if life.ttl_steps is None:
            pass
        elif self._shared.readonly:  # its reads record no use: the last-use steps on disk hold, cached or not
            ids = tier.ids[slots].cpu().numpy()
            order = np.argsort(ids)
            last = np.empty(len(ids), dtype=np.int64)
            last[order] = self._stored_last_use(ids[order])
            dead |= life.expired(last)
        else:
            dead |= life.expired(life.steps_of(tier.last[slots].cpu().numpy()))
        dead = torch.from_numpy(dead)
        if bool(dead.any()):
            gone = slots[dead.to(slots.device)]
            self._shared.await_gathers()  # a gather outside the lock may be reading these rows
            tier.put(gone, torch.from_numpy(initial_rows(self.spec, tier.ids[gone].cpu().numpy())))
            self.counters.life.expired += len(gone)
        return dead

    def _revive_cached(self, tier: CacheTier, slots: torch.Tensor) -> None:
        """A write to cached rows: those idle too long start over from their initial
        values, used at the latest step, as a write to a row not cached does."""
        dead = self._expire_cached(tier, slots)
        start = self.life.step_start_clock()
        if bool(dead.any()) and start is not None and self.life.ttl_steps is not None:
            tier.last[slots[dead.to(slots.device)]] = start

    def _stored_last_use(self, ids: np.ndarray) -> np.ndarray:
        """Last-use step of rows not cached (sorted ids): the queue's, else LMDB's; -1 for none."""
        queued, steps = self._backend_rows.writeback.lookup_last(self.spec.name, ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        out[queued] = steps
        if not queued.all():
            out[~queued] = self._backend_rows.backend.get_last_use(self.spec.name, ids[~queued])
        return out

    def _expire_fetched(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Rows fetched from staging, the queue or LMDB that are idle too long (or were
        swept), or below evict_l2_below, read as initial."""
        dead = self.life.too_small(rows[:, : self.spec.dim])
        counted = dead.copy()
        if self.life.ttl_steps is not None:
            last = self._stored_last_use(ids)
            dead |= self.life.expired(last)
            counted |= dead & (last >= 0)
        if dead.any():
            rows[dead] = initial_rows(self.spec, ids[dead])
            self.counters.life.expired += int(counted.sum())

    def last_use_to_store(self, ids: np.ndarray) -> np.ndarray:
        """Last-use steps of rows on their way to LMDB (sorted ids): the step in
        progress for its rows, the tiers' use clocks for cached rows, and for a
        write of a row not cached its stored step, or the latest step if it had
        none alive (a write re-creates it)."""
        life = self.life
        out = np.full(len(ids), -1, dtype=np.int64)
        if life.current is not None:
            out[find_sorted(life.current, ids)[1]] = life.steps + 1
        todo = np.flatnonzero(out < 0)
        if len(todo):
            for tier, slots, pos in self._cached(torch.from_numpy(ids[todo]))[0]:
                out[todo[pos.numpy()]] = life.steps_of(tier.last[slots.to(tier.device)].cpu().numpy())
        rest = np.flatnonzero(out < 0)
        if len(rest):
            stored = self._stored_last_use(ids[rest])
            stored[life.expired(stored)] = life.steps
            out[rest] = stored
        return out
