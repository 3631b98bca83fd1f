"""Access traces: what a store read, call by call, and the recorder that writes them.

Format (version 1): a directory of .npy arrays plus ``trace.json``, or one
``.npz`` file holding the same arrays plus ``meta`` (the JSON as a string).

==================  ===================  ==================================================
array               dtype, shape         meaning
==================  ===================  ==================================================
``ids``             int64 [n_ids]        the ids of every call, concatenated in trace order
``offsets``         int64 [n_calls + 1]  call c read ``ids[offsets[c]:offsets[c + 1]]``
``call_table``      int32 [n_calls]      index into the meta's ``tables`` of call c
``call_step``       int64 [n_calls]      training step of call c (non-decreasing)
==================  ===================  ==================================================

``trace.json`` / ``meta``: ``{"format": "tierstore-trace", "version": 1,
"tables": [{"name", "num_rows" (null: unbounded), "dim", "row_bytes"}],
"complete": bool}``. A call is one ``TieredStore.read``: its unique ids are
used together, in order of first position (the store's batch semantics), so
the order of calls and of ids inside a call is what the capacity analysis
replays. A step groups the calls of one training step (one per table, as a
rule); rates per step turn into rates per second with a step rate.
``row_bytes`` is the size of one row on SSD (4 * (dim + state_dim)).
"""
from __future__ import annotations

import gzip
import json
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierstore.validate import check_int
from tierstore.errors import ArgumentTypeError, FormatError, IdRangeError, PathNotFoundError, SettingError, StoreClosedError, UnknownTableError

FORMAT = "tierstore-trace"
VERSION = 1
ARRAYS = ("ids", "offsets", "call_table", "call_step")
_DTYPES = {"ids": np.int64, "offsets": np.int64, "call_table": np.int32, "call_step": np.int64}


@dataclass(frozen=True)
class TraceTable:
    """A traced table: its id space (None: unbounded) and the bytes of one row on SSD."""

    name: str
    num_rows: int | None = None
    dim: int | None = None
    row_bytes: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise SettingError(f"trace table name must be a non-empty string, got {self.name!r}")
        for f in ("num_rows", "dim", "row_bytes"):
            check_int(getattr(self, f), f"trace table {self.name!r}: {f}", at_least=1, none=True)

    def to_json(self) -> dict:
        return {"name": self.name, "num_rows": self.num_rows, "dim": self.dim, "row_bytes": self.row_bytes}

    @classmethod
    def from_json(cls, d: Mapping) -> "TraceTable":
        return cls(d["name"], d.get("num_rows"), d.get("dim"), d.get("row_bytes"))


@dataclass
class Trace:
    """An access trace in memory (arrays may be read-only memory maps)."""

    tables: tuple[TraceTable, ...]
    ids: np.ndarray
    offsets: np.ndarray
    call_table: np.ndarray
    call_step: np.ndarray
    complete: bool = True

    def __post_init__(self):
        self.tables = tuple(t if isinstance(t, TraceTable) else TraceTable(t) for t in self.tables)
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise SettingError(f"trace has duplicate table names: {names}")
        for name in ARRAYS:
            arr = np.asarray(getattr(self, name))
            if arr.ndim != 1:
                raise FormatError(f"trace array {name!r} must be 1-D, got shape {arr.shape}")
            if arr.size and arr.dtype.kind not in "iu":
                raise ArgumentTypeError(f"trace array {name!r} must hold integers, got {arr.dtype}")
            if arr.dtype != _DTYPES[name]:
                arr = arr.astype(_DTYPES[name])
            setattr(self, name, arr)
        self.validate()

    # -- checks ----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError/IndexError naming the first inconsistency."""
        n_calls = len(self.call_table)
        if len(self.offsets) != n_calls + 1:
            raise FormatError(f"offsets must have n_calls + 1 = {n_calls + 1} entries, got {len(self.offsets)}")
        if len(self.call_step) != n_calls:
            raise FormatError(f"call_step must have one entry per call ({n_calls}), got {len(self.call_step)}")
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.ids):
            raise FormatError(f"offsets must run from 0 to len(ids)={len(self.ids)}, got {self.offsets[0]}..{self.offsets[-1]}")
        if n_calls and np.any(np.diff(self.offsets) < 0):
            raise FormatError("offsets must be non-decreasing (each call's ids follow the previous call's)")
        if n_calls and np.any(np.diff(self.call_step) < 0):
            raise FormatError("call_step must be non-decreasing: calls are stored in the order they were made")
        if n_calls and (self.call_table.min() < 0 or self.call_table.max() >= len(self.tables)):
            raise IdRangeError(f"call_table holds {int(self.call_table.max())}, but the trace has {len(self.tables)} tables")
        if len(self.ids) and self.ids.min() < 0:
            raise IdRangeError(f"trace holds the negative id {int(self.ids.min())}; ids must be >= 0")
        bounded = [i for i, t in enumerate(self.tables) if t.num_rows is not None]
        if bounded and len(self.ids):
            per_call_max = np.zeros(n_calls, dtype=np.int64)
            nonempty = np.flatnonzero(np.diff(self.offsets) > 0)
            per_call_max[nonempty] = np.maximum.reduceat(self.ids, self.offsets[nonempty])
            limit = np.array([t.num_rows if t.num_rows is not None else np.iinfo(np.int64).max for t in self.tables])
            bad = np.flatnonzero(per_call_max >= limit[self.call_table])
            if len(bad):
                t = self.tables[self.call_table[bad[0]]]
                raise IdRangeError(f"call {bad[0]} reads id {per_call_max[bad[0]]} of table {t.name!r} with num_rows={t.num_rows}")

    # -- views -----------------------------------------------------------------------
    @property
    def n_calls(self) -> int:
        return len(self.call_table)

    @property
    def n_accesses(self) -> int:
        return len(self.ids)

    def accesses_per_table(self) -> np.ndarray:
        """Ids read from each table (int64, in ``tables`` order)."""
        return np.bincount(self.call_table, weights=np.diff(self.offsets), minlength=len(self.tables)).astype(np.int64)

    @property
    def n_steps(self) -> int:
        return int(len(np.unique(self.call_step))) if self.n_calls else 0

    @property
    def table_names(self) -> list[str]:
        return [t.name for t in self.tables]

    def table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise UnknownTableError(f"trace has no table {name!r}; it has {self.table_names}")

    def calls(self) -> Iterator[tuple[int, str, np.ndarray]]:
        """(step, table name, ids) of each call in trace order."""
        for c in range(self.n_calls):
            yield int(self.call_step[c]), self.tables[self.call_table[c]].name, self.ids[self.offsets[c] : self.offsets[c + 1]]

    def table_calls(self, table: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, offsets, global call numbers) of one table's calls, in trace order."""
        calls = np.flatnonzero(self.call_table == table)
        starts, ends = self.offsets[calls], self.offsets[calls + 1]
        lengths = ends - starts
        offsets = np.zeros(len(calls) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if len(calls) == self.n_calls:
            return np.asarray(self.ids), offsets, calls
        return gather_ranges(self.ids, starts, lengths), offsets, calls

    @classmethod
    def from_calls(cls, calls: Iterable[tuple[int, str, Sequence[int]]], tables: Sequence[TraceTable | str] | None = None) -> "Trace":
        """Build a trace from (step, table, ids) tuples (small traces and tests)."""
        tables = [t if isinstance(t, TraceTable) else TraceTable(t) for t in (tables or [])]
        index = {t.name: i for i, t in enumerate(tables)}
        ids, lengths, call_table, call_step = [], [], [], []
        for step, table, call_ids in calls:
            if table not in index:
                index[table] = len(tables)
                tables.append(TraceTable(table))
            arr = np.asarray(call_ids, dtype=np.int64).reshape(-1)
            ids.append(arr)
            lengths.append(len(arr))
            call_table.append(index[table])
            call_step.append(step)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        all_ids = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
        return cls(tuple(tables), all_ids, offsets, np.array(call_table, dtype=np.int32), np.array(call_step, dtype=np.int64))

    # -- files -------------------------------------------------------------------------
    def meta(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "tables": [t.to_json() for t in self.tables], "complete": self.complete}

    def save(self, path: str | Path) -> Path:
        """Write to ``path``: an ``.npz`` file if it ends in .npz, else a directory."""
        path = Path(path)
        arrays = {name: np.ascontiguousarray(getattr(self, name)) for name in ARRAYS}
        if path.suffix == ".npz":
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, meta=np.array(json.dumps(self.meta())), **arrays)
            return path
        path.mkdir(parents=True, exist_ok=True)
        for name, arr in arrays.items():
            np.save(path / f"{name}.npy", arr)
        (path / "trace.json").write_text(json.dumps(self.meta(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path, mmap: bool = True) -> "Trace":
        """Read a trace directory (ids memory-mapped unless ``mmap=False``) or .npz file.

        A trace a recorder did not close (a crashed process) loads up to the last
        call it wrote completely.
        """
        path = Path(path)
        if not path.exists():
            raise PathNotFoundError(f"no trace at {path}; write one with `tierstore trace synth`, `tierstore trace convert` or TieredStore(record_trace=...)")
        if path.is_dir():
            meta_file = path / "trace.json"
            if not meta_file.exists():
                raise FormatError(f"{path} is not a trace directory (no trace.json); see tierstore.trace for the format")
            meta = json.loads(meta_file.read_text())
            arrays = {}
            for name in ARRAYS:
                f = path / f"{name}.npy"
                if not f.exists():
                    raise FormatError(f"trace directory {path} lacks {name}.npy")
                arrays[name] = np.load(f, mmap_mode="r" if mmap and name == "ids" else None)
        else:
            if not zipfile.is_zipfile(path):  # np.load would return a lone .npy array, or fail on the format
                part = (path.parent / "trace.json").exists()
                raise FormatError(f"{path} is neither a trace directory nor a trace .npz"
                                 + (f"; it is one array of the trace directory {path.parent}: pass that" if part else ""))
            with np.load(path, allow_pickle=False) as z:
                missing = [n for n in ("meta", *ARRAYS) if n not in z.files]
                if missing:
                    raise FormatError(f"{path} is not a trace .npz: it lacks {missing}")
                meta = json.loads(str(z["meta"]))
                arrays = {name: z[name] for name in ARRAYS}
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise FormatError(f"{path} holds format {meta.get('format')!r} v{meta.get('version')}; this tierstore reads {FORMAT!r} v{VERSION}")
        complete = bool(meta.get("complete", True))
        if not complete:  # keep the calls whose every array entry was written
            n = min(len(arrays["offsets"]) - 1, len(arrays["call_table"]), len(arrays["call_step"]))
            n = max(n, 0)
            while n and arrays["offsets"][n] > len(arrays["ids"]):
                n -= 1
            arrays["offsets"] = arrays["offsets"][: n + 1] if len(arrays["offsets"]) else np.zeros(1, dtype=np.int64)
            arrays["call_table"] = arrays["call_table"][:n]
            arrays["call_step"] = arrays["call_step"][:n]
            arrays["ids"] = arrays["ids"][: arrays["offsets"][-1]]
        tables = tuple(TraceTable.from_json(t) for t in meta["tables"])
        return cls(tables, complete=complete, **arrays)


def gather_ranges(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate values[s:s+l] for each (s, l), vectorized."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=values.dtype)
    keep = lengths > 0
    starts, lengths = np.asarray(starts, dtype=np.int64)[keep], lengths[keep]
    ends = np.cumsum(lengths)
    step = np.ones(total, dtype=np.int64)
    step[0] = starts[0]
    step[ends[:-1]] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1
    return np.asarray(values)[np.cumsum(step)]


# -- recording -------------------------------------------------------------------------------
class _GrowingNpy:
    """A 1-D .npy file appended to in place; its header is rewritten with the length
    on ``sync`` so that a reader always sees a valid file (readers ignore the tail
    written since the last sync)."""

    HEADER = 128  # bytes reserved for the .npy v1.0 header, enough for any 1-D length

    def __init__(self, path: Path, dtype):
        self.path = path
        self.dtype = np.dtype(dtype)
        self.count = 0
        self._f = open(path, "wb")
        self._write_header()

    def _write_header(self) -> None:
        d = f"{{'descr': '{self.dtype.str}', 'fortran_order': False, 'shape': ({self.count},), }}"
        body = d.encode("latin1").ljust(self.HEADER - 10 - 1) + b"\n"
        self._f.write(b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body)

    def append(self, arr: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self.count += len(arr)

    def sync(self) -> None:
        pos = self._f.tell()
        self._f.seek(0)
        self._write_header()
        self._f.seek(pos)
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self.sync()
            self._f.close()


class TraceRecorder:
    """Writes a trace directory while a store runs; ``record`` costs one file write.

    ``tables``: the store's tables (TableSpecs: name, num_rows, dim, row_bytes,
    or :class:`TraceTable`). A new step starts when a table is read a second time
    within the current step. Empty calls are not recorded (they use nothing).
    Headers are rewritten every ``sync_every`` calls and on close, so a crashed
    process leaves a trace that loads up to then.
    """

    def __init__(self, path: str | Path, tables: Iterable = (), sync_every: int = 256):
        self.path = Path(path)
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise SettingError(f"record_trace={str(self.path)!r} exists and is not an empty directory; pass a new directory for the trace")
        self.path.mkdir(parents=True, exist_ok=True)
        self._tables: list[TraceTable] = []
        self._index: dict[str, int] = {}
        for t in tables:
            self._add_table(t)
        self._files = {name: _GrowingNpy(self.path / f"{name}.npy", _DTYPES[name]) for name in ARRAYS}
        self._files["offsets"].append(np.zeros(1, dtype=np.int64))
        for f in self._files.values():
            f.sync()
        self._n_ids = 0
        self._step = 0
        self._in_step: set[int] = set()
        self._sync_every = sync_every
        self._since_sync = 0
        self.closed = False
        self._write_meta(complete=False)

    def _add_table(self, t) -> int:
        if not isinstance(t, TraceTable):
            t = TraceTable(t.name, t.num_rows, t.dim, t.row_bytes)
        self._index[t.name] = len(self._tables)
        self._tables.append(t)
        return self._index[t.name]

    def _write_meta(self, complete: bool) -> None:
        meta = {"format": FORMAT, "version": VERSION, "tables": [t.to_json() for t in self._tables], "complete": complete}
        tmp = self.path / "trace.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, self.path / "trace.json")

    def record(self, table: str, ids) -> None:
        """Append one read call (ids: a 1-D integer tensor or array, already validated)."""
        if self.closed:
            raise StoreClosedError(f"trace recorder for {self.path} is closed")
        arr = ids.cpu().numpy() if hasattr(ids, "numpy") else np.asarray(ids)
        if len(arr) == 0:
            return
        idx = self._index.get(table)
        if idx is None:
            idx = self._add_table(TraceTable(table))
            self._write_meta(complete=False)
        if idx in self._in_step:
            self._step += 1
            self._in_step.clear()
        self._in_step.add(idx)
        self._files["ids"].append(arr)
        self._n_ids += len(arr)
        self._files["call_table"].append(np.array([idx], dtype=np.int32))
        self._files["call_step"].append(np.array([self._step], dtype=np.int64))
        self._files["offsets"].append(np.array([self._n_ids], dtype=np.int64))
        self._since_sync += 1
        if self._since_sync >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        # ids and the call arrays first, offsets last: a reader trusts only calls
        # whose end offset it can see
        for name in ("ids", "call_table", "call_step", "offsets"):
            self._files[name].sync()
        self._since_sync = 0

    def close(self) -> None:
        if self.closed:
            return
        for name in ("ids", "call_table", "call_step", "offsets"):
            self._files[name].close()
        self._write_meta(complete=True)
        self.closed = True


# -- converters --------------------------------------------------------------------------------
def from_dlrm(files: Sequence[str | Path], batch_size: int | None = None, table_names: Sequence[str] | None = None,
              dim: int | None = None) -> Trace:
    """Trace of FBGEMM dlrm_datasets embedding_bag files (``fbgemm_t856_bs65536_*.pt``).

    Each file holds ``(indices, offsets, lengths)`` (``torch.load``): ``lengths``
    is [T, B] (bags per table and sample), ``offsets`` the T*B+1 bag boundaries,
    table-major. Each file is one batch; ``batch_size`` splits it into steps of
    that many samples. Within a step, tables are read in order, one call each.
    """
    import torch

    all_ids, all_len, all_table, all_step = [], [], [], []
    n_tables = None
    step = 0
    for f in files:
        opener = gzip.open if _is_gzip(f) else open
        with opener(f, "rb") as fh:
            loaded = torch.load(fh, map_location="cpu", weights_only=True)
        if not isinstance(loaded, (tuple, list)) or len(loaded) not in (2, 3):
            raise FormatError(f"{f}: expected (indices, offsets, lengths) from torch.load, got {type(loaded).__name__}")
        indices = np.asarray(loaded[0].numpy(), dtype=np.int64)
        offsets = np.asarray(loaded[1].numpy(), dtype=np.int64).reshape(-1)
        if len(loaded) == 3:
            lengths = np.asarray(loaded[2].numpy())
            if lengths.ndim != 2:
                raise FormatError(f"{f}: lengths must be [tables, batch], got shape {lengths.shape}")
            T, B = lengths.shape
        else:
            if n_tables is None:
                raise FormatError(f"{f} holds (indices, offsets) without lengths; the number of tables is unknown")
            T = n_tables
            B = (len(offsets) - 1) // T
        if len(offsets) != T * B + 1 or offsets[-1] != len(indices):
            raise FormatError(f"{f}: offsets must have tables*batch+1 = {T * B + 1} entries ending at len(indices)={len(indices)}")
        if n_tables is not None and T != n_tables:
            raise FormatError(f"{f} has {T} tables, earlier files {n_tables}")
        n_tables = T
        bs = B if batch_size is None else int(batch_size)
        if bs <= 0:
            raise SettingError(f"batch_size must be > 0, got {batch_size}")
        bag = offsets.reshape(-1)
        for s0 in range(0, B, bs):  # one step per slice of samples; a loop per step, not per id
            s1 = min(B, s0 + bs)
            starts = bag[np.arange(T) * B + s0]
            ends = bag[np.arange(T) * B + s1]
            all_ids.append(gather_ranges(indices, starts, ends - starts))
            all_len.append(ends - starts)
            all_table.append(np.arange(T, dtype=np.int32))
            all_step.append(np.full(T, step, dtype=np.int64))
            step += 1
    if n_tables is None:
        raise SettingError("no dlrm files given")
    names = list(table_names) if table_names is not None else [f"t{i}" for i in range(n_tables)]
    if len(names) != n_tables:
        raise SettingError(f"table_names has {len(names)} names for {n_tables} tables")
    lengths = np.concatenate(all_len)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tables = tuple(TraceTable(n, None, dim, 4 * dim if dim else None) for n in names)
    return Trace(tables, np.concatenate(all_ids), offsets, np.concatenate(all_table), np.concatenate(all_step))


def from_csv(path: str | Path, dim: int | None = None) -> Trace:
    """Trace of a CSV file with a header naming the columns ``step``, ``table`` and
    ``id`` (any order, other columns ignored), one access per line in trace order.

    Consecutive lines with the same (step, table) form one call.
    """
    path = Path(path)
    with open(path, newline="") as fh:
        header = [h.strip() for h in fh.readline().strip().split(",")]
    missing = [c for c in ("step", "table", "id") if c not in header]
    if missing:
        raise FormatError(f"{path}: the header must name columns step, table and id; missing {missing} in {header}")
    col = {c: header.index(c) for c in ("step", "table", "id")}
    try:
        nums = np.loadtxt(path, delimiter=",", skiprows=1, usecols=(col["step"], col["id"]), dtype=np.int64, ndmin=2)
        names = np.loadtxt(path, delimiter=",", skiprows=1, usecols=col["table"], dtype=str, ndmin=1)
    except ValueError as e:
        raise FormatError(f"{path}: step and id must be integers ({e})") from None
    steps, ids = nums[:, 0], nums[:, 1]
    names = np.char.strip(names)
    table_names, table_of = np.unique(names, return_inverse=True)
    # keep tables in order of first appearance
    first = np.full(len(table_names), len(names))
    np.minimum.at(first, table_of, np.arange(len(names)))
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    table_of = rank[table_of].astype(np.int32)
    n = len(ids)
    new_call = np.ones(n, dtype=bool)
    if n:
        new_call[1:] = (steps[1:] != steps[:-1]) | (table_of[1:] != table_of[:-1])
    starts = np.flatnonzero(new_call)
    offsets = np.append(starts, n).astype(np.int64)
    tables = tuple(TraceTable(str(table_names[i]), None, dim, 4 * dim if dim else None) for i in order)
    return Trace(tables, ids, offsets, table_of[starts], steps[starts])


def _is_gzip(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"
