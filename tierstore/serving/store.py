"""Inference from a serving store (docs/serving.md): readonly tiers of quantized rows.

A ServingStore opens what tierstore.export wrote. Each table keeps an HBM tier
(on ``device``) and a DDR tier (host memory) of rows in their serving dtype, as
FBGEMM's IntNBit kernel lays them out (int8/int4: float16 scale and bias first,
then the codes), over the LMDB rows, each evicting by a policy of tierstore.eviction.
The DDR tier keeps the rows it sends up (the HBM tier holds copies of some of
its rows): a lookup whose rows one tier holds, HBM first, pools them there in
place, the kernel reading the tier's rows as FBGEMM's HOST placement reads its
table; any other brings its rows up into the top tier, then pools
the quantized rows in place: with FBGEMM's IntNBit CPU kernel where FBGEMM is
installed and the tier is on the CPU (the same bits as FBGEMM's
IntNBitTableBatchedEmbeddingBagsCodegen on those rows), else by dequantizing the
rows (``scale * code + bias``, float32) and pooling them with torch.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tierstore.io import find_sorted
from tierstore.io.serving_layout import RowFormat, ServingReader

from tierstore.training import fbgemm
from tierstore.eviction import UNUSED, EvictionPolicy, make_policy

from tierstore.engine.hashindex import make_index
from tierstore.engine.table import PROBE_SAMPLE
from tierstore.spec import TableSpec, initial_rows
from tierstore.engine.tensors import resolve_device
from tierstore.validate import check_int
from tierstore.errors import ArgumentTypeError, BadIdsError, BadValuesError, IdRangeError, SettingError, UnknownTableError

MODES = {"sum": 0, "mean": 1}
_KERNEL_TYPES = {"float32": 0, "float16": 1, "int8": 2, "int4": 3}  # FBGEMM's SparseType


class _Tier:
    """A fixed number of packed rows on one device, by id; when full, the rows its eviction
    policy (tierstore.eviction) ranks first are put over. A tier with room for the whole
    table is direct: row ``id`` in slot ``id``, nothing ever put over, so no use is marked;
    once it holds every row, a lookup's slots are its ids."""

    def __init__(self, name: str, capacity: int, row_bytes: int, device: torch.device, num_rows: int | None,
                 policy: EvictionPolicy):
        self.name, self.capacity, self.policy = name, capacity, policy
        self.direct = num_rows is not None and capacity >= num_rows
        self.rows = torch.zeros((capacity, row_bytes), dtype=torch.uint8, device=device)
        self.ids = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        # the policy's metadata (host numpy, read only when rows are put over): the clock of each
        # slot's last use (a call's rows share its clock) and the calls that used it; UNUSED when free
        self.last = np.full(capacity, UNUSED, dtype=np.int64)
        self.freq = np.full(capacity, UNUSED, dtype=np.int64)
        self.index = make_index(capacity, num_rows, device)

    @property
    def resident(self) -> int:
        return len(self.index)

    @property
    def whole(self) -> bool:
        """Every row of the table is here, row ``id`` in slot ``id``."""
        return self.direct and len(self.index) == self.capacity

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.index.lookup(ids.to(self.rows.device))

    def holds(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The slots of ``ids`` when every one is here, else None. A spread sample is probed
        first: a call that misses somewhere says so for PROBE_SAMPLE ids' probes, not all of them."""
        if self.whole:
            return ids.to(self.rows.device)
        sample = ids[:: max(1, len(ids) // PROBE_SAMPLE)]
        if len(sample) < len(ids) and not bool((self.lookup(sample) >= 0).all()):
            return None
        slots = self.lookup(ids)
        return slots if bool((slots >= 0).all()) else None

    def mark(self, slots: torch.Tensor, clock: int) -> None:
        """Rows at ``slots`` (repeats allowed) used by call ``clock``: numpy's fill (a 2-thread
        index_put over 65,536 repeated slots took 16 ms, numpy's 0.17 ms); ``freq[s] += 1`` counts
        a slot once however often it repeats (numpy's buffered indexing)."""
        if self.direct:
            return
        at = slots.cpu().numpy()
        self.last[at] = clock
        if self.policy.uses_frequency:
            self.freq[at] += 1

    def put(self, ids: torch.Tensor, rows: torch.Tensor, clock: int, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add rows of ids not resident, in the free slots, then over the rows the policy
        ranks first except those at ``keep``; returns the (ids, rows) that do not stay:
        the rows put over, and the rows given beyond the room there is."""
        dev = self.rows.device
        ids, rows = ids.to(dev), rows.to(dev)
        if self.direct:  # each row into its own slot, free as the row is not here
            self.index.insert(ids, ids)
            self.ids[ids], self.rows[ids] = ids, rows
            return ids[:0], rows[:0]
        n = min(len(ids), self.capacity - len(keep))
        taken = self.ids.cpu().numpy() >= 0
        free = np.flatnonzero(~taken)[:n]
        last, freq = self.last.copy(), self.freq.copy()
        last[keep.cpu().numpy()] = freq[keep.cpu().numpy()] = UNUSED  # kept: ranked after every row
        at = np.concatenate([free, self.policy.select(last, freq, n - len(free))]) if n > len(free) else free
        slots = torch.from_numpy(at).to(dev)
        old = slots[taken[at]]
        out_ids, out_rows = torch.cat([self.ids[old], ids[n:]]), torch.cat([self.rows[old], rows[n:]])
        self.index.remove(self.ids[old])
        self.index.insert(ids[:n], slots)
        self.ids[slots], self.rows[slots] = ids[:n], rows[:n]
        self.last[at], self.freq[at] = clock, 1
        return out_ids, out_rows


class _ServingTable:
    def __init__(self, reader: ServingReader, desc: dict, hbm_rows: int, ddr_rows: int, device: torch.device, policy: str):
        self.spec = TableSpec.from_json(desc["spec"])
        self.name, self.dtype = self.spec.name, desc["dtype"]
        self.format = RowFormat(self.spec.dim, self.dtype)
        self.reader = reader
        self.device = device
        n = self.spec.num_rows
        bytes_ = self.format.row_bytes
        self.hbm = _Tier("hbm", min(hbm_rows, n or hbm_rows), bytes_, device, n, make_policy(policy)) if hbm_rows else None
        self.ddr = _Tier("ddr", min(ddr_rows, n or ddr_rows), bytes_, torch.device("cpu"), n, make_policy(policy)) if ddr_rows else None
        self.tiers = [t for t in (self.hbm, self.ddr) if t is not None] or [None]
        self.clock = 0
        # rows newer than LMDB's (applied deltas, tierstore.serving.stream): sorted ids, rows as LMDB stores them
        self.newer_ids = np.zeros(0, dtype=np.int64)
        self.newer_rows = np.zeros((0, bytes_), dtype=np.uint8)
        self.counts = {"hbm_hits": 0, "ddr_hits": 0, "lmdb_reads": 0, "initial_rows": 0}

    def kernel_rows(self, packed: np.ndarray) -> np.ndarray:
        """Rows as LMDB stores them -> as the kernel reads them (scale and bias first)."""
        if self.format.bits is None:
            return packed
        return np.concatenate([packed[:, self.format.code_bytes:], packed[:, : self.format.code_bytes]], axis=1)

    def _cold(self, ids: torch.Tensor) -> torch.Tensor:
        """Kernel rows of sorted ids in no tier: from LMDB, else the table's initial rows."""
        ids_np = ids.numpy()
        packed, found = self.reader.get_rows(self.name, ids_np, self.format.row_bytes)
        pos, newer = find_sorted(self.newer_ids, ids_np)
        packed[newer], found = self.newer_rows[pos[newer]], found | newer
        if not found.all():
            packed[~found] = self.format.encode(initial_rows(self.spec, ids_np[~found])[:, : self.spec.dim])
        self.counts["lmdb_reads"] += len(ids_np)
        self.counts["initial_rows"] += int((~found).sum())
        return torch.from_numpy(self.kernel_rows(packed))

    def apply(self, ids: np.ndarray, packed: np.ndarray, deleted: np.ndarray) -> None:
        """Serve rows ``packed`` (as LMDB stores them) for the sorted unique ``ids`` from now on,
        and the initial rows for ``deleted`` (as for rows an export leaves out): written over the
        tiers' copies, and kept beside LMDB's rows for reads that miss."""
        if len(deleted):
            ids = np.concatenate([ids, deleted])
            packed = np.concatenate([packed, self.format.encode(initial_rows(self.spec, deleted)[:, : self.spec.dim])])
            order = np.argsort(ids, kind="stable")
            ids, packed = ids[order], packed[order]
        kernel = torch.from_numpy(self.kernel_rows(packed))
        for tier in self.tiers:
            if tier is not None:
                slots = tier.lookup(torch.from_numpy(ids))
                hit = slots >= 0
                tier.rows[slots[hit]] = kernel[hit.cpu()].to(tier.rows.device)
        every = np.concatenate([self.newer_ids, ids])
        order = np.argsort(every, kind="stable")  # an id's newest row last among its copies
        ordered = every[order]
        newest = np.append(ordered[1:] != ordered[:-1], True)
        self.newer_ids, self.newer_rows = ordered[newest], np.concatenate([self.newer_rows, packed])[order[newest]]

    def fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, index): kernel rows and the row of each of ``ids`` among them. A call whose
        rows one tier holds (HBM first) is pooled there in place; else its rows come up into
        the top tier (HBM, else DDR) as far as it has room, the rows read from LMDB and
        those it puts over (where DDR lacks them) into DDR."""
        self.clock += 1
        top, lower = self.tiers[0], self.tiers[1] if len(self.tiers) > 1 else None
        for tier in (top, lower):
            slots = tier.holds(ids) if tier is not None and len(ids) else None
            if slots is not None:
                if not tier.direct:  # nothing is ever put over a direct tier: the order of use decides nothing
                    tier.mark(slots, self.clock)
                self.counts[f"{tier.name}_hits"] += len(ids)
                return tier.rows, slots
        uid, inverse = torch.unique(ids.cpu(), return_inverse=True)
        dev = top.rows.device if top is not None else self.device
        rows = torch.empty((len(uid), self.format.row_bytes), dtype=torch.uint8, device=dev)
        hit = torch.zeros(len(uid), dtype=torch.bool)
        keep = torch.zeros(0, dtype=torch.int64, device=dev)
        if top is not None:
            slots = top.lookup(uid)
            hit = (slots >= 0).cpu()
            keep = slots[hit.to(dev)]
            rows[hit.to(dev)] = top.rows.index_select(0, keep)
            top.mark(keep, self.clock)
            self.counts[f"{top.name}_hits"] += int(hit.sum())
        mid = uid[~hit]
        got = torch.empty((len(mid), self.format.row_bytes), dtype=torch.uint8)
        below, dslots = torch.zeros(len(mid), dtype=torch.bool), torch.zeros(0, dtype=torch.int64)
        if lower is not None and len(mid):
            dslots = lower.lookup(mid)
            below = dslots >= 0
            dslots = dslots[below]
            got[below] = lower.rows.index_select(0, dslots)  # copied up: DDR keeps its copy
            lower.mark(dslots, self.clock)
            self.counts[f"{lower.name}_hits"] += int(below.sum())
        if not bool(below.all()):
            got[~below] = self._cold(mid[~below])
        rows[(~hit).to(dev)] = got.to(dev)
        if top is not None:
            # the misses that go up: as many as the top tier has room for beside this call's hits
            up = torch.arange(len(mid)) < top.capacity - len(keep)
            out_ids, out_rows = top.put(mid[up], got[up], self.clock, keep)
            if lower is not None:
                out_ids, out_rows = out_ids.cpu(), out_rows.cpu()
                lacks = lower.lookup(out_ids) < 0
                new_ids, new_rows = torch.cat([mid[~below], out_ids[lacks]]), torch.cat([got[~below], out_rows[lacks]])
                n = lower.capacity
                lower.put(new_ids[:n], new_rows[:n], self.clock, dslots)
        return rows, inverse.to(dev)


class ServingStore:
    """A serving store (tierstore.export's output) opened for lookups, readonly.

    ``hbm_rows`` / ``ddr_rows``: rows each table keeps in the HBM tier (on
    ``device``; None is torch's default device, as for torch's modules) and the DDR tier; an int for
    every table or {table: rows}. ``policy``: the eviction policy of both tiers, by its name in
    tierstore.eviction ("lru", "lfu" or one registered). Thread-safe: lookups take turns.
    """

    def __init__(self, path: str | Path, hbm_rows: int | Mapping[str, int] = 0, ddr_rows: int | Mapping[str, int] = 0,
                 device: str | torch.device | None = None, policy: str = "lru"):
        self.path = Path(path)
        self.device = resolve_device(device)
        self._reader = ServingReader(self.path)
        self._lock = threading.Lock()
        try:
            self.meta = self._reader.meta
            self._version = int(self.meta.get("version", 0))
            names = [t["name"] for t in self.meta["tables"]]
            for what, sizes in (("hbm_rows", hbm_rows), ("ddr_rows", ddr_rows)):
                _check_sizes(what, sizes, names)
            make_policy(policy)  # an unknown name: the error naming the policies, before any tier is made
            self._tables = {t["name"]: _ServingTable(self._reader, t, _size(hbm_rows, t["name"]), _size(ddr_rows, t["name"]),
                                                     self.device, policy) for t in self.meta["tables"]}
        except BaseException:
            self._reader.close()
            raise

    @property
    def tables(self) -> dict[str, TableSpec]:
        return {name: t.spec for name, t in self._tables.items()}

    @property
    def version(self) -> int:
        """The published version served (tierstore.serving.stream): the export's, then each delta's applied."""
        return self._version

    def apply(self, version: int, rows: Mapping[str, tuple[np.ndarray, ...]]) -> None:
        """Serve version ``version``: ``rows[table]`` = (sorted unique ids, rows packed as LMDB
        stores them[, sorted ids deleted: served as their initial rows from now on]). Lookups
        take turns with it, so each sees the versions before or after. The change is checked
        whole first: an unknown table (KeyError), rows of another size, or ids not sorted, not
        unique, outside the table's range or both written and deleted (ValueError) change nothing."""
        self._apply_checked(version, self._checked(rows))

    def _checked(self, rows: Mapping[str, tuple[np.ndarray, ...]]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``rows`` as apply takes them, checked (apply's docstring): {table: (ids, packed, deleted)}."""
        changes = {}
        for name, (ids, packed, *deleted) in rows.items():
            t = self._table(name)
            ids = _sorted_ids(t, ids, "ids")
            gone = _sorted_ids(t, deleted[0], "deleted ids") if deleted else np.zeros(0, dtype=np.int64)
            if packed.shape != (len(ids), t.format.row_bytes):
                raise BadValuesError(f"rows for table {name!r} must be {len(ids)} x {t.format.row_bytes} bytes, got {packed.shape}")
            _, both = find_sorted(ids, gone)
            if both.any():
                raise BadIdsError(f"table {name!r}: id {int(gone[both][0])} is both written and deleted")
            changes[name] = (ids, packed, gone)
        return changes

    def _apply_checked(self, version: int, changes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        with self._lock:
            for name, change in changes.items():
                self._tables[name].apply(*change)
            self._version = version

    def spec(self, table: str) -> TableSpec:
        """``table``'s spec; a KeyError naming the store's tables if it has no such table."""
        return self._table(table).spec

    def dtype(self, table: str) -> str:
        return self._table(table).dtype

    def rows(self, table: str, ids) -> torch.Tensor:
        """The serving values of rows ``ids``: float32 [n, dim] on ``device`` (dequantized)."""
        t = self._table(table)
        ids = self._ids(t, ids)
        with self._lock:
            rows, index = t.fetch(ids)
            rows = rows.index_select(0, index).cpu().numpy()
        return torch.from_numpy(t.format.decode(_stored_order(t, rows))).to(self.device)

    def lookup(self, table: str, ids, offsets, per_sample_weights: torch.Tensor | None = None, mode: str = "sum") -> torch.Tensor:
        """Pooled bags, float32 [B, dim] on ``device``: bag b pools rows ``ids[offsets[b]:offsets[b + 1]]``
        (``offsets``: B + 1 of them, the last ``len(ids)``), each times its per-sample weight if given."""
        if mode not in MODES:
            raise SettingError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        if per_sample_weights is not None and mode != "sum":
            raise SettingError(f"per_sample_weights are only supported with mode='sum', got mode={mode!r}")
        t = self._table(table)
        ids = self._ids(t, ids)
        offsets = _offsets(offsets, len(ids))
        if per_sample_weights is not None:
            per_sample_weights = torch.as_tensor(per_sample_weights, dtype=torch.float32).reshape(-1)
            if len(per_sample_weights) != len(ids):
                raise BadValuesError(f"per_sample_weights must have one weight per id ({len(ids)}), got {len(per_sample_weights)}")
        with self._lock:
            rows, index = t.fetch(ids)
            return _pool(t, rows, index, offsets.to(rows.device), per_sample_weights, mode).to(self.device)

    def stats(self) -> dict[str, dict]:
        """Per table: hits in each tier, rows read from LMDB and rows that were initial values."""
        with self._lock:
            return {n: {**t.counts, "hbm_resident": t.hbm.resident if t.hbm else 0, "ddr_resident": t.ddr.resident if t.ddr else 0}
                    for n, t in self._tables.items()}

    def close(self) -> None:
        with self._lock:
            self._tables.clear()
            self._reader.close()

    def __enter__(self) -> "ServingStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _table(self, name: str) -> _ServingTable:
        try:
            return self._tables[name]
        except KeyError:
            raise UnknownTableError(f"unknown table {name!r}; the serving store has tables {sorted(self._tables)}") from None

    @staticmethod
    def _ids(t: _ServingTable, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        if not ids.numel():  # [] is a float tensor to torch
            ids = ids.long()
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dtype.is_complex:
            raise ArgumentTypeError(f"ids for table {t.name!r} must be integers, got {ids.dtype}")
        ids = ids.reshape(-1).to("cpu", torch.int64)
        if len(ids):
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or (t.spec.num_rows is not None and hi >= t.spec.num_rows):
                bad = lo if lo < 0 else hi
                raise IdRangeError(f"id {bad} out of range for table {t.name!r} (ids are in [0, {t.spec.num_rows or '2**63'}))")
        return ids


def _sorted_ids(t: _ServingTable, ids, what: str) -> np.ndarray:
    """``ids`` of a change to table ``t`` as int64, checked to be ascending, unique and in its range."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise BadIdsError(f"{what} for table {t.name!r} must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
    ids = ids.astype(np.int64, copy=False)
    down = np.flatnonzero(ids[1:] <= ids[:-1])
    if len(down):
        k = int(down[0])
        raise BadIdsError(f"{what} for table {t.name!r} must be ascending and unique: {int(ids[k + 1])} follows {int(ids[k])}")
    if len(ids) and (ids[0] < 0 or (t.spec.num_rows is not None and ids[-1] >= t.spec.num_rows)):
        bad = int(ids[0]) if ids[0] < 0 else int(ids[-1])
        raise BadIdsError(f"{what} for table {t.name!r}: id {bad} is out of range (ids are in [0, {t.spec.num_rows or '2**63'}))")
    return ids


def _size(sizes: int | Mapping[str, int], table: str) -> int:
    return int(sizes.get(table, 0)) if isinstance(sizes, Mapping) else int(sizes)


def _check_sizes(what: str, sizes, names: Sequence[str]) -> None:
    items = sizes.items() if isinstance(sizes, Mapping) else [("every table", sizes)]
    for table, rows in items:
        if isinstance(sizes, Mapping) and table not in names:
            raise UnknownTableError(f"{what} names unknown table {table!r}; the serving store has tables {sorted(names)}")
        check_int(rows, f"{what} for {table}", meaning="0 = no such tier")


def _offsets(offsets, n: int) -> torch.Tensor:
    off = torch.as_tensor(offsets).reshape(-1).to("cpu", torch.int64)
    if len(off) == 0 or int(off[0]) != 0 or int(off[-1]) != n or bool((off[1:] < off[:-1]).any()):
        raise BadValuesError(f"offsets must be B + 1 non-decreasing bag starts from 0 to the number of ids ({n}), "
                         f"got {off.tolist()[:8]}{'...' if len(off) > 8 else ''}")
    return off


def _stored_order(t: _ServingTable, rows: np.ndarray) -> np.ndarray:
    """Kernel rows -> as LMDB stores them (codes first): the inverse of kernel_rows."""
    if t.format.bits is None:
        return rows
    return np.concatenate([rows[:, 4:], rows[:, :4]], axis=1)


def _pool(t: _ServingTable, rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
          psw: torch.Tensor | None, mode: str) -> torch.Tensor:
    if rows.device.type == "cpu" and fbgemm.installed():
        return pool_intnbit(rows, t.dtype, t.spec.dim, index, offsets, psw, mode)
    # without FBGEMM: dequantize the rows the bags use, then pool them
    uid, inverse = torch.unique(index, return_inverse=True)
    packed = _stored_order(t, rows.index_select(0, uid).cpu().numpy())
    values = torch.from_numpy(t.format.decode(packed)).to(rows.device)
    psw = psw.to(rows.device) if psw is not None else None
    out, *_ = torch.embedding_bag(values, inverse, offsets, False, MODES[mode], False, psw, True, None)
    return out


def pool_intnbit(rows: torch.Tensor, dtype: str, dim: int, index: torch.Tensor, offsets: torch.Tensor,
                 psw: torch.Tensor | None, mode: str) -> torch.Tensor:
    """FBGEMM's IntNBit CPU forward over kernel rows ``rows`` (uint8 [n, row_bytes]) as one table:
    bag b pools rows ``index[offsets[b]:offsets[b + 1]]``; float32 [B, dim]."""
    ops = torch.ops.fbgemm
    max_d = {name: dim if name == dtype else 0 for name in _KERNEL_TYPES}
    out = ops.int_nbit_split_embedding_codegen_lookup_function(
        dev_weights=rows.reshape(-1), uvm_weights=torch.empty(0, dtype=torch.uint8),
        weights_placements=torch.tensor([3], dtype=torch.int32), weights_offsets=torch.zeros(1, dtype=torch.int64),
        weights_tys=torch.tensor([_KERNEL_TYPES[dtype]], dtype=torch.uint8), D_offsets=torch.tensor([0, dim], dtype=torch.int32),
        total_D=dim, max_int2_D=0, max_int4_D=max_d["int4"], max_int8_D=max_d["int8"], max_float16_D=max_d["float16"],
        max_float32_D=max_d["float32"], indices=index, offsets=offsets, pooling_mode=MODES[mode], indice_weights=psw,
        output_dtype=0, lxu_cache_weights=torch.empty((0, 0), dtype=torch.uint8),
        lxu_cache_locations=torch.empty(0, dtype=torch.int32), row_alignment=1, max_float8_D=0, fp8_exponent_bits=-1,
        fp8_exponent_bias=-1)
    return out.view(-1, dim)


class ServingEmbeddingBag(nn.Module):
    """One table of a serving store as an inference EmbeddingBag: ``forward(input, offsets,
    per_sample_weights)`` as torch.nn.EmbeddingBag's (1-D input with B bag starts, or
    B + 1 with ``include_last_offset``; or 2-D fixed-length bags), no gradients."""

    def __init__(self, store: ServingStore, table: str, mode: str = "sum", include_last_offset: bool = False):
        super().__init__()
        if mode not in MODES:
            raise SettingError(f"mode must be one of {sorted(MODES)} for serving, got {mode!r}")
        store.spec(table)  # the KeyError naming the store's tables
        self.store, self.table, self.mode, self.include_last_offset = store, table, mode, include_last_offset

    @classmethod
    def open(cls, path: str | Path, table: str | None = None, mode: str = "sum", include_last_offset: bool = False,
             hbm_rows: int = 0, ddr_rows: int = 0, device: str | torch.device | None = None) -> "ServingEmbeddingBag":
        """Open the serving store at ``path`` for one table (its only one when ``table`` is None)."""
        store = ServingStore(path, hbm_rows=hbm_rows, ddr_rows=ddr_rows, device=device)
        if table is None:
            if len(store.tables) != 1:
                store.close()
                raise SettingError(f"{path} has tables {sorted(store.tables)}; pass table= to pick one")
            table = next(iter(store.tables))
        return cls(store, table, mode, include_last_offset)

    @torch.no_grad()
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() == 2:
            if offsets is not None:
                raise BadValuesError("with a 2-D input (fixed-length bags) offsets must be None")
            offsets = torch.arange(input.shape[0] + 1, dtype=torch.int64) * input.shape[1]
        elif offsets is None:
            raise BadValuesError("a 1-D input needs offsets (the start of each bag)")
        else:
            offsets = offsets.to("cpu", torch.int64)
            if not self.include_last_offset:
                offsets = torch.cat([offsets, torch.tensor([input.numel()])])
        return self.store.lookup(self.table, input, offsets, per_sample_weights, self.mode)

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dtype={self.store.dtype(self.table)}, mode={self.mode!r}, store={str(self.store.path)!r}"


class ServingEmbeddingBagCollection(nn.Module):
    """Every table of a serving store: ``forward({table: (values, offsets[, per_sample_weights])
    or a 2-D tensor})`` returns ``{table: pooled [B, dim]}``, as TieredEmbeddingBagCollection's."""

    def __init__(self, path: str | Path, mode: str = "sum", include_last_offset: bool = False,
                 hbm_rows: int | Mapping[str, int] = 0, ddr_rows: int | Mapping[str, int] = 0,
                 device: str | torch.device | None = None):
        super().__init__()
        self.store = ServingStore(path, hbm_rows=hbm_rows, ddr_rows=ddr_rows, device=device)
        self._bags = {name: ServingEmbeddingBag(self.store, name, mode, include_last_offset) for name in self.store.tables}

    def __getitem__(self, name: str) -> ServingEmbeddingBag:
        self.store.spec(name)  # the KeyError naming the store's tables
        return self._bags[name]

    def forward(self, features: Mapping[str, object]) -> dict[str, torch.Tensor]:
        if not isinstance(features, Mapping):
            raise ArgumentTypeError("features must be a mapping {table: (values, offsets)}")
        out = {}
        for name, feature in features.items():
            if isinstance(feature, torch.Tensor):
                out[name] = self[name](feature)
            elif isinstance(feature, (tuple, list)) and len(feature) in (2, 3):
                out[name] = self[name](*feature)
            else:
                raise ArgumentTypeError(f"feature {name!r} must be (values, offsets), (values, offsets, per_sample_weights) or a 2-D tensor")
        return out

    def close(self) -> None:
        self.store.close()
