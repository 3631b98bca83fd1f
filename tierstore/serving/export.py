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

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from tierstore.io import StoreCorruptError, unique_ids
from tierstore.io.serving_layout import FLOAT16_MAX, SERVING_DTYPES, RowFormat, ServingWriter

from tierstore.training.sharding import ShardingPlan
from tierstore.spec import TableSpec, initial_rows
from tierstore.store import TieredStore
from tierstore.errors import ArgumentTypeError, BadValuesError, PathNotFoundError, SettingError, UnknownTableError, kind

_CHUNK = 65536  # rows read and written at a time


def export(src, dst: str | os.PathLike, tables: Sequence[str] | None = None, dtype: str = "int8", version: int = 0) -> Path:
    """Write the serving store ``dst`` (a new directory) from the training store
    ``src``: a path (a store that may be open for writing elsewhere, or a sharded
    checkpoint: ShardedEmbeddingBagCollection.checkpoint's directory, every rank's
    shards into whole tables) or an open TieredStore (its checkpoint: what a flush
    made durable, at the step boundary of the call). ``tables``: the tables to export
    (default: all); ``dtype``: float32, float16, int8 or int4 (row-wise, FBGEMM's
    formats); ``version``: the published version the export stands for
    (tierstore.serving.stream). Returns ``dst``."""
    if dtype not in SERVING_DTYPES:
        raise SettingError(f"dtype must be one of {list(SERVING_DTYPES)} (the serving rows' type), got {dtype!r}")
    if isinstance(src, (str, os.PathLike)):
        _check_not_dcp(Path(src))
    writer = ServingWriter(dst)
    try:
        with _source(src, writer.scratch) as source:
            chosen = _chosen(source.tables, tables, src)
            for spec in chosen:
                RowFormat(spec.dim, dtype)  # refuses an int4 table of odd dim before any work
            described = [_export_table(source, writer, spec, dtype) for spec in chosen]
        where = str(Path(src if isinstance(src, (str, os.PathLike)) else src.path).resolve())
        return writer.commit({"tables": described, "source": where, "version": version, "time": time.time()})
    except BaseException:
        writer.abort()
        raise
    finally:
        shutil.rmtree(writer.scratch, ignore_errors=True)


def _check_not_dcp(path: Path) -> None:
    """Refuse a torch.distributed.checkpoint directory (``.metadata`` and ``*.distcp`` files):
    its rows are in DCP's files, which only a model's load_state_dict puts back into a store."""
    if (path / "data.mdb").exists() or (path / "plan.json").exists():
        return
    if (path / ".metadata").is_file() or any(path.glob("*.distcp")):
        raise PathNotFoundError(
            f"{path} is a torch.distributed.checkpoint (DCP) checkpoint, not a tierstore (no data.mdb): export reads a "
            "store. Load it into a model whose tables live in a store (sd = model.state_dict(); "
            "torch.distributed.checkpoint.load(sd, checkpoint_id=DIR); model.load_state_dict(sd)), then export that "
            "store: tierstore.export(model.store, DST), or its directory after a flush; or export a directory "
            "written by store.checkpoint(path)")


@contextlib.contextmanager
def _source(src, scratch: Path) -> Iterator["_Store | _Sharded"]:
    """What the export reads: a snapshot of one store (taken into ``scratch``) or a sharded checkpoint."""
    if isinstance(src, (str, os.PathLike)) and (Path(src) / "plan.json").exists():
        with _Sharded(Path(src)) as sharded:
            yield sharded
        return
    if isinstance(src, (str, os.PathLike)):
        with TieredStore(src, readonly=True, device="cpu") as store:
            store.checkpoint(scratch)
    else:
        src.checkpoint(scratch)
    with TieredStore(scratch, readonly=True, device="cpu") as snap:
        yield _Store(snap)


class _Store:
    def __init__(self, store: TieredStore):
        self.store, self.tables = store, store.tables

    def stored_ids(self, table: str) -> np.ndarray:
        return self.store.stored_ids(table).numpy()

    def weights(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Rows as the store reads them (peek: no step, TTL and L2 rules at its step counts)."""
        return self.store.peek(table, ids).numpy()


class _Sharded:
    """A sharded checkpoint: its plan, and each rank's store of its shards (``rank-<r>``)."""

    def __init__(self, path: Path):
        try:
            self.plan = ShardingPlan.from_json((path / "plan.json").read_text())
            self.tables = {d["name"]: TableSpec.from_json(d) for d in json.loads((path / "tables.json").read_text())}
        except (ValueError, KeyError, TypeError) as e:  # PlanMismatchError and JSON errors among them
            raise StoreCorruptError(f"{path}'s plan.json or tables.json is damaged ({kind(e)}: {e}); "
                                    "export another copy of this checkpoint") from None
        self.stores: dict[int, TieredStore] = {}
        try:
            for tp in self.plan.tables.values():
                for shard in tp.shards:
                    if shard.rank not in self.stores:
                        self.stores[shard.rank] = TieredStore(path / f"rank-{shard.rank}", readonly=True, device="cpu")
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self) -> "_Sharded":
        return self

    def __exit__(self, *exc) -> None:
        for store in self.stores.values():
            store.close()

    def stored_ids(self, table: str) -> np.ndarray:
        ids = [self.stores[s.rank].stored_ids(table).numpy() for s in self.plan.tables[table].shards]
        return unique_ids(np.concatenate(ids))

    def weights(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Whole rows: a row shard's rows from its owner, a column shard's columns from each."""
        tp = self.plan.tables[table]
        out = np.empty((len(ids), self.tables[table].dim), dtype=np.float32)
        owner = tp.owner(torch.from_numpy(ids)).numpy()
        for k, s in enumerate(tp.shards):
            rows = owner == k if tp.sharding == "row" else np.ones(len(ids), dtype=bool)
            out[rows, s.col_start: s.col_stop] = self.stores[s.rank].peek(table, ids[rows]).numpy()
        return out


def _chosen(specs: dict[str, TableSpec], tables: Sequence[str] | None, src) -> list[TableSpec]:
    if tables is None:
        return list(specs.values())
    if isinstance(tables, str):
        raise ArgumentTypeError(f"tables must be a list of table names, got the string {tables!r}; pass [{tables!r}]")
    unknown = sorted(set(tables) - set(specs))
    if unknown:
        raise UnknownTableError(f"tables {unknown} are not in the store at {src}; it has {sorted(specs)}")
    return [specs[name] for name in dict.fromkeys(tables)]


def _export_table(source: "_Store | _Sharded", writer: ServingWriter, spec: TableSpec, dtype: str) -> dict:
    fmt = RowFormat(spec.dim, dtype)
    stored = source.stored_ids(spec.name)
    rows_out = 0
    for lo in range(0, len(stored), _CHUNK):
        ids = stored[lo: lo + _CHUNK]
        weights = source.weights(spec.name, ids)
        kept = written(spec, ids, weights)
        ids, weights = ids[kept], weights[kept]
        _check_values(spec.name, ids, weights, dtype)
        if len(ids):
            writer.put(spec.name, ids, fmt.encode(weights))
            rows_out += len(ids)
    return {"name": spec.name, "dtype": dtype, "dim": spec.dim, "row_bytes": fmt.row_bytes, "rows": rows_out,
            "spec": spec.to_json()}


def written(spec: TableSpec, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Mask of the rows whose ``weights`` (as the store reads them) are not their initial
    values: those a serving store holds; a lookup computes the others from the RowInit."""
    return (weights != initial_rows(spec, ids)[:, : spec.dim]).any(axis=1)


def _check_values(table: str, ids: np.ndarray, weights: np.ndarray, dtype: str) -> None:
    finite = np.isfinite(weights).all(axis=1)
    if not finite.all():
        raise BadValuesError(f"table {table!r}: row {int(ids[~finite][0])} has a non-finite weight (nan or inf); "
                         "fix or evict the row in the training store, then export again")
    if dtype != "float32":
        big = np.abs(weights).max(axis=1) > FLOAT16_MAX
        if big.any():
            raise BadValuesError(f"table {table!r}: row {int(ids[big][0])} has a weight beyond float16's range (+-{FLOAT16_MAX:g}), "
                             f"which {dtype} rows cannot hold (their scale and bias are float16); export it as float32")
