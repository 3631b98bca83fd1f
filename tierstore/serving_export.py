"""Export a training store to a serving store (docs/serving.md).

The export snapshots the training store (TieredStore.checkpoint: one LMDB read
transaction, so a writer training meanwhile is never stopped), reads each stored
row of that snapshot as the store reads it (``peek``: the TTL and L2 rules
applied at the snapshot's step counts, no step taken), and writes its weights,
without the optimizer state, packed in the serving dtype. A row whose value is
its initial value (never written, or read as initial again) is left out: a
serving lookup computes the same initial value from the table's RowInit.
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tierstore.io.serving_layout import FLOAT16_MAX, SERVING_DTYPES, RowFormat, ServingWriter

from .spec import TableSpec, initial_rows
from .store import TieredStore

_CHUNK = 65536  # rows read and written at a time


def export(src, dst: str | os.PathLike, tables: Sequence[str] | None = None, dtype: str = "int8", version: int = 0) -> Path:
    """Write the serving store ``dst`` (a new directory) from the training store
    ``src``: a path (a store that may be open for writing elsewhere) or an open
    TieredStore (its checkpoint: what a flush made durable, at the step boundary of
    the call). ``tables``: the tables to export (default: all); ``dtype``: float32,
    float16, int8 or int4 (row-wise, FBGEMM's formats); ``version``: the published version
    the export stands for (tierstore.serving_stream). Returns ``dst``."""
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype must be one of {list(SERVING_DTYPES)} (the serving rows' type), got {dtype!r}")
    writer = ServingWriter(dst)
    try:
        if isinstance(src, (str, os.PathLike)):
            with TieredStore(src, readonly=True, device="cpu") as store:
                store.checkpoint(writer.scratch)
        else:
            src.checkpoint(writer.scratch)
        with TieredStore(writer.scratch, readonly=True, device="cpu") as snap:
            chosen = _chosen(snap.tables, tables, src)
            for spec in chosen:
                RowFormat(spec.dim, dtype)  # refuses an int4 table of odd dim before any work
            described = [_export_table(snap, writer, spec, dtype) for spec in chosen]
        source = str(Path(src if isinstance(src, (str, os.PathLike)) else src.path).resolve())
        return writer.commit({"tables": described, "source": source, "version": version, "time": time.time()})
    except BaseException:
        writer.abort()
        raise
    finally:
        shutil.rmtree(writer.scratch, ignore_errors=True)


def _chosen(specs: dict[str, TableSpec], tables: Sequence[str] | None, src) -> list[TableSpec]:
    if tables is None:
        return list(specs.values())
    if isinstance(tables, str):
        raise TypeError(f"tables must be a list of table names, got the string {tables!r}; pass [{tables!r}]")
    unknown = sorted(set(tables) - set(specs))
    if unknown:
        raise KeyError(f"tables {unknown} are not in the store at {src}; it has {sorted(specs)}")
    return [specs[name] for name in dict.fromkeys(tables)]


def _export_table(snap: TieredStore, writer: ServingWriter, spec: TableSpec, dtype: str) -> dict:
    fmt = RowFormat(spec.dim, dtype)
    stored = snap.stored_ids(spec.name).numpy()
    rows_out = 0
    for lo in range(0, len(stored), _CHUNK):
        ids = stored[lo: lo + _CHUNK]
        weights = snap.peek(spec.name, ids).numpy()
        kept = (weights != initial_rows(spec, ids)[:, : spec.dim]).any(axis=1)
        ids, weights = ids[kept], weights[kept]
        _check_values(spec.name, ids, weights, dtype)
        if len(ids):
            writer.put(spec.name, ids, fmt.encode(weights))
            rows_out += len(ids)
    return {"name": spec.name, "dtype": dtype, "dim": spec.dim, "row_bytes": fmt.row_bytes, "rows": rows_out,
            "spec": spec.to_json()}


def _check_values(table: str, ids: np.ndarray, weights: np.ndarray, dtype: str) -> None:
    finite = np.isfinite(weights).all(axis=1)
    if not finite.all():
        raise ValueError(f"table {table!r}: row {int(ids[~finite][0])} has a non-finite weight (nan or inf); "
                         "fix or evict the row in the training store, then export again")
    if dtype != "float32":
        big = np.abs(weights).max(axis=1) > FLOAT16_MAX
        if big.any():
            raise ValueError(f"table {table!r}: row {int(ids[big][0])} has a weight beyond float16's range (+-{FLOAT16_MAX:g}), "
                             f"which {dtype} rows cannot hold (their scale and bias are float16); export it as float32")
