"""Client-side HBM tier (``hbm_rows=N``, a :class:`tierstore.engine.tiers.CacheTier`
on ``device``; one per process). Each claimed table with one is a
tierstore.engine.table.TableStore with that tier alone, over a DaemonRows source
(tierstore.engine.source): the embedded store's own step, its misses READ from the
daemon and its dirty rows leaving it WRITTEN there. Consistency rests on the claims:
a row has at most one writer, so that writer may keep the newest copy of the row to
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
from typing import TYPE_CHECKING

import numpy as np
import torch

from tierstore.daemon import wire
from tierstore.engine.table import Resident, Shared, TableStore
from tierstore.engine.tensors import gather_tier
from tierstore.engine.tiers import CacheTier
from tierstore.engine.upload import Upload
from tierstore.eviction import make_policy
from tierstore.precision import DTYPES
from tierstore.validate import check_int
from tierstore.errors import SettingError

if TYPE_CHECKING:
    from tierstore.daemon.client import DaemonStore


class DaemonRows:
    """A daemon client's RowSource (tierstore.engine.source): below its HBM tier, the daemon's
    store. Misses are READ with their state; rows leaving the tier, and writes to rows it
    does not hold, are WRITTEN (the daemon refuses a write outside the client's claims)."""

    def __init__(self, client: DaemonStore):
        self._client = client

    def fetch(self, table: TableStore, ids: torch.Tensor, out: np.ndarray | None = None,
              places: np.ndarray | None = None) -> torch.Tensor:  # the daemon keeps where rows are
        spec = table.spec
        rows = torch.empty((len(ids), spec.width), dtype=torch.float32) if out is None else torch.from_numpy(out)
        return self._client._daemon_read(spec.name, ids.numpy(), spec.width, True, rows)

    def write_back(self, table: TableStore, ids: np.ndarray, rows: np.ndarray, places: np.ndarray | None = None) -> None:
        self._client._daemon_write(table.spec.name, ids, rows, True)

    def write(self, table: TableStore, ids: torch.Tensor, values: torch.Tensor, cols: int) -> None:
        self._client._daemon_write(table.spec.name, ids.numpy(), values.numpy(), cols == table.spec.width)


class ClientHbm:
    """DaemonStore's HBM tiers: their sizing at attach, their tables (the embedded step over
    DaemonRows), and the write-back of their dirty rows at flush and close. It uses the
    client's specs, claims, device and lock."""

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
                tier = CacheTier("hbm", int(rows), spec.dim, spec.state_dim, self.device, make_policy(policy), spec.num_rows,
                                 DTYPES[spec.dtype])
                self._hbm[table] = TableStore(spec, tier, None, self._shared)
        if not isinstance(hbm_rows, Mapping) and hbm_rows and not self._hbm:
            raise SettingError("hbm_rows > 0 with no claim=: a client caches only rows it has claimed for writing "
                             "(readonly and unclaimed reads always go to the daemon); add claim=[...] or drop hbm_rows")

    def _shared_parts(self) -> Shared:
        """What the client's tables share: the daemon below them, and one use clock. A gather
        from a tier runs under the client's lock, so no writer waits for one."""
        return Shared(DaemonRows(self), self.readonly, lambda: None, upload=Upload(self.device))

    def _read_cached(self, t: TableStore, ids: np.ndarray, cols: int, out: torch.Tensor | None) -> torch.Tensor:
        """A read of claimed rows: the embedded store's step through the table's HBM tier."""
        result = t.read(torch.from_numpy(ids), cols, out, self.device)
        return gather_tier(result.tier, result.slots, cols, out, self.device) if isinstance(result, Resident) else result

    def _write_back_all(self) -> None:
        """WRITE every dirty HBM row (with its state) to the daemon, then mark it clean."""
        for table, t in self._hbm.items():
            H = t.hbm
            dirty = H.dirty_slots()
            if len(dirty):
                ids, rows, _ = H.rows_by_id(dirty)  # the daemon keeps where rows are
                self._daemon_write(table, ids, rows, True)
                H.dirty[dirty] = False
                t.counters.hbm.writebacks += len(dirty)
