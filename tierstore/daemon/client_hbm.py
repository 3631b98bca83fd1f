"""Client-side HBM tier (``hbm_rows=N``, a :class:`tierstore.engine.tiers.CacheTier`
on ``device``; one per process). Consistency rests on the claims: a row has
at most one writer, so that writer may keep the newest copy of the row to
itself. Hence:

- Only rows this client claimed are cached in its HBM tier; reads of any
  other row (and every read of a readonly client) go to the daemon each time,
  so they see the other writers' rows as soon as those reach the daemon.
- A write to a row in the HBM tier updates it there and marks it dirty; a
  write to any other row goes to the daemon (like the embedded store, where a
  write to an uncached row goes to the level below). Writes are not uses.
- A dirty row the HBM tier evicts goes back to the daemon with a WRITE (with
  its state) before the tier lets it go. ``flush()`` writes every dirty HBM
  row to the daemon, then asks the daemon to flush: when it returns, all of
  this client's writes are durable. ``close()`` writes dirty rows back too.
- Other clients read a claimed row's newest value only once it has reached
  the daemon (eviction, flush, close). A client killed with dirty HBM rows
  loses those rows only: the daemon's copy is the last one written back.
- The HBM tier is inclusive over the daemon (the daemon may keep a copy of a
  row the client caches); the embedded store's tiers are exclusive. Values are
  bit-identical to an embedded store; counts follow the embedded rules inside
  the HBM tier: each read call counts each unique id once, a hit if the HBM
  tier held it, else a miss; ids of unclaimed rows are not counted there.
  ``stats()`` gives the client's HBM counts with the daemon's DDR/SSD counts
  (the daemon counts every client's reads). Frequencies (LFU) start at 1 when
  a row enters the HBM tier.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from tierstore.daemon import wire
from tierstore.engine.counters import TierCounters
from tierstore.engine.step import StepPlanner
from tierstore.engine.tensors import gather_rows, gather_tier
from tierstore.engine.tiers import CacheTier, first_uses, nonzero
from tierstore.eviction import make_policy
from tierstore.precision import DTYPES
from tierstore.validate import check_int
from tierstore.errors import SettingError


class ClientHbm:
    """DaemonStore's HBM tier: its sizing at attach, its read step by the embedded store's
    rules (tierstore.engine.step's plan), and the write-back of its dirty rows to the daemon.
    It uses the client's tables, device, use clock and READ/WRITE frames."""

    def _make_hbm(self, hbm_rows, policy: str) -> None:
        make_policy(policy)  # raises on unknown names
        sizes = dict(hbm_rows) if isinstance(hbm_rows, Mapping) else {t: hbm_rows for t in self._ranges}
        for table, rows in sizes.items():
            check_int(rows, f"hbm_rows for {table}", meaning="0 = no HBM tier")
            spec = self.spec(table)
            if rows and spec.lived:
                raise SettingError(f"hbm_rows for table {table!r}, which has admit_after, ttl_steps or evict_l2_below: the daemon counts "
                                 "each read of it as a step, and a client HBM tier would keep reads from it; give hbm_rows as "
                                 "{table: rows} for the other tables only")
            if rows and table not in self._ranges:
                raise SettingError(f"hbm_rows for table {table!r}, which this client has not claimed: a client caches only rows "
                                 f"it writes (its claims keep other writers away); claim it, e.g. claim=[{table!r}]")
            if table in self._ranges:  # never more slots than rows it may cache
                r = self._ranges[table]
                rows = min(rows, int((np.maximum(np.minimum(r[:, 1], spec.num_rows or wire.WHOLE), r[:, 0]) - r[:, 0]).sum()))
            if rows:
                self._hbm[table] = CacheTier("hbm", int(rows), spec.dim, spec.state_dim, self.device, make_policy(policy), spec.num_rows,
                                             DTYPES[spec.dtype])
                self._hbm_counts[table] = TierCounters()
                self._planners[table] = StepPlanner()
        if not isinstance(hbm_rows, Mapping) and hbm_rows and not self._hbm:
            raise SettingError("hbm_rows > 0 with no claim=: a client caches only rows it has claimed for writing "
                             "(readonly and unclaimed reads always go to the daemon); add claim=[...] or drop hbm_rows")

    def _hbm_read(self, table: str, H: CacheTier, ids: torch.Tensor, cols: int, out: torch.Tensor | None) -> torch.Tensor:
        """One read step of the HBM tier, by the embedded store's rules: every
        unique id is used at clock ``start + first position``; misses come from
        the daemon with their state; evicted dirty rows go back to it first."""
        c = self._hbm_counts[table]
        n = len(ids)
        slots = H.lookup(ids)
        if bool((slots >= 0).all()):  # every row resident: no dedupe, no daemon
            c.hits += H.use_resident(slots, self._use_clock)
            self._use_clock += n
            return gather_tier(H, slots, cols, out, self.device)

        uid, inverse, first = first_uses(ids)
        slot = H.lookup(uid).cpu()
        hit = slot >= 0
        miss = nonzero(~hit)
        fetched = self._daemon_read(table, uid[miss].numpy(), H.width, True, None)

        rows = torch.empty((len(uid), H.width), dtype=torch.float32, device=H.device)
        rows[hit.to(H.device)] = H.gather(slot[hit].to(H.device))
        rows[miss.to(H.device)] = fetched.to(H.device)
        plan = self._planners[table].plan(H, None, (first + self._use_clock).numpy(), slot.numpy(),
                                          np.full(len(uid), -1, dtype=np.int64))
        # before anything changes: a failure leaves the tier as it was
        wb = plan.write_back
        self._write_back(table, H, torch.cat([torch.from_numpy(wb.hbm), slot[torch.from_numpy(wb.call)]]))
        H.commit(plan.hbm, plan, uid, rows.index_select(0, torch.from_numpy(plan.hbm.entering()).to(H.device)))
        c.evictions += plan.hbm.evictions
        c.hits += int(hit.sum())
        c.misses += len(miss)
        self._use_clock += n
        return gather_rows(rows, inverse.to(H.device), cols, out, self.device)

    def _write_back(self, table: str, H: CacheTier, slots: torch.Tensor) -> int:
        """WRITE the dirty rows among ``slots`` (with their state) to the daemon; marks them clean."""
        s = slots.to(H.device)
        dirty = s[H.dirty[s]]
        if len(dirty) == 0:
            return 0
        self._daemon_write(table, *H.rows_by_id(dirty), True)
        H.dirty[dirty] = False
        self._hbm_counts[table].writebacks += len(dirty)
        return len(dirty)
