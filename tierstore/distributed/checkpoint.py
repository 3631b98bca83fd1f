"""Checkpoints of ShardedEmbeddingBagCollection: every rank's shards as TieredStore checkpoints
with the plan and tables as JSON, and their restore under another plan or world size."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from tierstore.distributed.comm import _Op, _error_of
from tierstore.distributed.tables import _Table
from tierstore.errors import PathExistsError, PathNotFoundError, kind
from tierstore.io import StoreCorruptError
from tierstore.spec import TableSpec
from tierstore.store import TieredStore
from tierstore.training.checkpointing import OptimizerMismatchError, state_layout
from tierstore.training.sharding import PlanMismatchError, ShardingPlan

if TYPE_CHECKING:
    from tierstore.distributed.collection import ShardedEmbeddingBagCollection


_RESHARD_CHUNK = 1 << 16  # rows moved at once when resharding a checkpoint


class Checkpoints:
    """ShardedEmbeddingBagCollection's snapshots (``checkpoint``) and their restore under
    another plan or world size (``from_checkpoint``)."""

    def checkpoint(self, path: str | Path) -> Path:
        """Snapshot every rank's shards into ``path/rank-<r>`` (TieredStore.checkpoint,
        after a barrier: no rank is mid-step), with the plan and tables as JSON;
        restore with ``ShardedEmbeddingBagCollection.from_checkpoint``. Collective: a
        rank's failure raises there, and RankFailedError naming it on the others."""
        path = Path(path)
        # a checkpoint is never overwritten, and every rank learns that before any writes:
        # rank 0 replacing plan.json and tables.json of a checkpoint whose rank directories
        # then refuse the copy would leave it describing rows it does not hold
        self._begin(_Op.CHECKPOINT, error=_error_of(lambda: _check_new_checkpoint(path)))

        def snapshot():
            path.mkdir(parents=True, exist_ok=True)
            if self.rank == 0:
                _write_json(path / "plan.json", self.plan.to_json())
                _write_json(path / "tables.json", json.dumps([t.spec.to_json() for t in self._tables.values()]))
            if self.local_store is not None:
                self.local_store.checkpoint(path / f"rank-{self.rank}")
        self._begin(_Op.SAVED, error=_error_of(snapshot))
        return path

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path, *, plan: ShardingPlan, path: str | Path,
                        **kwargs) -> "ShardedEmbeddingBagCollection":
        """Open a new collection at ``path`` (empty) under ``plan``, any world size, with the
        rows and optimizer state of a ``checkpoint()`` written under another plan.

        Each rank reads the rows its new shards own from the old shards' LMDB
        files (the checkpoint directory must be visible to every rank) and
        rebuilds them column by column. Takes the other arguments of the
        constructor; the optimizer must have the checkpoint's state layout.
        Before anything is created, every rank checks plan.json and tables.json
        against what each rank directory holds (its tables, their columns and
        specs, the rows it stored): a checkpoint that disagrees with itself raises
        StoreCorruptError naming the file or directory."""
        checkpoint = Path(checkpoint)
        old_plan, specs = _read_checkpoint(checkpoint)
        optimizer = kwargs.get("optimizer")
        layout = state_layout(optimizer)
        # the old plan's tables: which old shard holds which rows and columns
        _check_same_tables(checkpoint, old_plan, specs)
        olds = {s.name: _Table(s, old_plan.tables[s.name], None, layout, False) for s in specs}
        stores = _open_shards(checkpoint, old_plan)
        try:
            _check_shards(checkpoint, old_plan, olds, stores)
            for s in specs:
                need = optimizer.state_dim(s.dim) if optimizer else 0
                if s.state_dim != need:
                    raise OptimizerMismatchError(
                        f"table {s.name!r} was checkpointed with state_dim={s.state_dim}, {optimizer!r} needs {need}; "
                        "restore with the optimizer it was trained with")
            rank = dist.get_rank(kwargs.get("process_group"))
            if (Path(path) / f"rank-{rank}").exists():
                raise PathExistsError(f"{Path(path) / f'rank-{rank}'} exists; restore a checkpoint into a new path")
            module = cls([dataclasses.replace(s, state_dim=0) for s in specs], plan, path, **kwargs)
            try:
                module._restore(stores, olds)
            except BaseException:
                with contextlib.suppress(Exception):  # every rank is here: _restore raises on all of them
                    module.close()
                raise
        finally:
            for store in stores.values():
                store.close()
        return module

    def _restore(self, stores: dict[int, TieredStore], olds: dict[str, _Table]) -> None:
        """Write the rows this rank's shards own, read from the old shards' ``stores`` (by rank)."""
        error = None
        try:
            for name, t in self._tables.items():
                if t.mine is None:
                    continue
                o = olds[name]
                ids = torch.unique(torch.cat([stores[s.rank].stored_ids(name) for s in o.tplan.shards]))
                ids = ids[t.masks(ids)[t.mine]]
                cols = t.cols(t.mine, True)
                for lo in range(0, len(ids), _RESHARD_CHUNK):
                    chunk = ids[lo: lo + _RESHARD_CHUNK]
                    rows = torch.empty(len(chunk), t.spec.width)
                    for k, mask in enumerate(o.masks(chunk)):
                        pos = torch.nonzero(mask).squeeze(1)
                        got = stores[o.rank_of(k)].read(name, chunk[pos], with_state=True).cpu()
                        rows[pos.unsqueeze(1), o.cols(k, True)] = got
                    self.local_store.write(name, chunk, rows[:, cols], with_state=True)
            if self.local_store is not None:
                self.local_store.flush()
        except BaseException as e:
            error = e
        self._begin(_Op.RESTORED, error=error)



_RESTORE_ANOTHER = "copy it from another copy of this checkpoint, or restore another checkpoint"
_EDITED = ("plan.json was edited or replaced, or rank directories renamed or taken from another checkpoint: copy the "
           "checkpoint's files from another copy of it, or restore another checkpoint")


def _read_checkpoint(checkpoint: Path) -> tuple[ShardingPlan, list[TableSpec]]:
    """The plan and table specs a sharded checkpoint was written under; a file that is
    damaged (cut short, edited) raises StoreCorruptError naming it and what is wrong."""
    def damaged(name: str, what: str) -> StoreCorruptError:
        return StoreCorruptError(f"{checkpoint / name} is damaged: {what}. Rank 0 wrote it with the checkpoint: "
                                 + _RESTORE_ANOTHER)

    texts = {}
    for name in ("plan.json", "tables.json"):
        try:
            texts[name] = (checkpoint / name).read_text()
        except FileNotFoundError as e:
            raise PathNotFoundError(f"{checkpoint} is not a sharded checkpoint ({e.filename} is missing); "
                                    "write one with ShardedEmbeddingBagCollection.checkpoint(path)") from None
        except UnicodeDecodeError as e:
            raise damaged(name, f"it is not text ({e})") from None
    try:
        plan = ShardingPlan.from_json(texts["plan.json"])
    except PlanMismatchError as e:
        raise damaged("plan.json", str(e)) from None
    try:
        entries = json.loads(texts["tables.json"])
    except json.JSONDecodeError as e:
        raise damaged("tables.json", f"it is not JSON, cut short or overwritten ({e})") from None
    if not isinstance(entries, list):
        raise damaged("tables.json", f"it holds a JSON {type(entries).__name__}, not the list of table specs")
    specs = []
    for i, d in enumerate(entries):
        try:
            specs.append(TableSpec.from_json(d))
        except (TypeError, KeyError, ValueError) as e:
            what = f"lacks the key {e}" if isinstance(e, KeyError) else f"is unreadable ({kind(e)}: {e})"
            raise damaged("tables.json", f"table spec {i} {what}") from None
    return plan, specs


def _check_new_checkpoint(path: Path) -> None:
    """FileExistsError if ``path`` holds any file of a sharded checkpoint."""
    held = sorted(p.name for p in path.glob("*") if p.name in ("plan.json", "tables.json") or p.name.startswith("rank-")) \
        if path.is_dir() else []
    if held:
        raise PathExistsError(f"{path} holds a checkpoint already ({', '.join(held)}); a checkpoint is never overwritten: "
                              "checkpoint into a new directory (and delete the old one once the new is written)")
    if path.exists() and not path.is_dir():
        raise PathExistsError(f"{path} exists and is not a directory; checkpoint into a new directory")


def _check_same_tables(checkpoint: Path, plan: ShardingPlan, specs: list[TableSpec]) -> None:
    if set(plan.tables) != {s.name for s in specs}:
        raise StoreCorruptError(
            f"{checkpoint / 'plan.json'} and {checkpoint / 'tables.json'} name different tables ({sorted(plan.tables)} and "
            f"{[s.name for s in specs]}): one was edited or replaced; {_RESTORE_ANOTHER}")


def _open_shards(checkpoint: Path, plan: ShardingPlan) -> dict[int, TieredStore]:
    """Every rank directory of the checkpoint, opened readonly, by rank: those the plan
    gives shards, and no other (its rows would be left behind unseen)."""
    named = sorted({s.rank for tp in plan.tables.values() for s in tp.shards})
    present = {p.name for p in checkpoint.glob("rank-*")}
    for r in named:
        if f"rank-{r}" not in present:
            tables = sorted(tp.table for tp in plan.tables.values() if r in tp.ranks)
            raise StoreCorruptError(
                f"{checkpoint / f'rank-{r}'} is missing: {checkpoint / 'plan.json'} gives rank {r} shards of {tables}, "
                f"which that directory held. Every rank directory must be visible to each restoring rank: {_RESTORE_ANOTHER}")
    extra = sorted(present - {f"rank-{r}" for r in named})
    if extra:
        raise StoreCorruptError(f"{checkpoint / extra[0]} holds shards, but {checkpoint / 'plan.json'} gives shards to ranks "
                                f"{named} only: {_EDITED}")
    stores: dict[int, TieredStore] = {}
    try:
        for r in named:
            stores[r] = TieredStore(checkpoint / f"rank-{r}", readonly=True, registry=CollectorRegistry())
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    return stores


def _check_shards(checkpoint: Path, plan: ShardingPlan, olds: dict[str, _Table], stores: dict[int, TieredStore]) -> None:
    """StoreCorruptError unless each rank directory holds what plan.json and tables.json say:
    the tables the plan places on its rank, with the plan's columns and tables.json's spec,
    and rows only of its shard. An edited plan would otherwise read rows from a shard that
    does not hold them and restore their initial values instead."""
    plan_file, tables_file = checkpoint / "plan.json", checkpoint / "tables.json"
    placed: dict[int, set[str]] = {r: set() for r in stores}
    for name, o in olds.items():
        shards = o.tplan.shards
        for k, s in enumerate(shards):
            where, store = checkpoint / f"rank-{s.rank}", stores[s.rank]
            placed[s.rank].add(name)
            if name not in store.tables:
                raise StoreCorruptError(f"{where} holds no table {name!r}, which {plan_file} places on rank {s.rank} "
                                        f"(it holds {sorted(store.tables)}): {_EDITED}")
            got = store.tables[name]
            if (got.init.col_start, got.dim) != (s.col_start, s.dim):
                raise StoreCorruptError(
                    f"{plan_file} gives rank {s.rank} columns [{s.col_start}, {s.col_stop}) of table {name!r}, but {where} "
                    f"holds columns [{got.init.col_start}, {got.init.col_start + got.dim}): {_EDITED}")
            ids = store.stored_ids(name)
            outside = ids[o.tplan.owner(ids) != k] if o.tplan.sharding == "row" and len(ids) else ids[:0]
            if len(outside):
                rows = f"rows [{s.row_start}, {s.row_stop})" if s.row_start is not None else \
                    f"the rows that hash to shard {k} of {len(shards)}"
                raise StoreCorruptError(
                    f"{plan_file} gives rank {s.rank} {rows} of table {name!r}, but {where} holds {len(outside)} rows "
                    f"outside them (ids {outside[:5].tolist()}{' ...' if len(outside) > 5 else ''}): {_EDITED}")
            want = dataclasses.replace(o.spec, init=dataclasses.replace(o.spec.init, col_start=s.col_start))
            if o.column:  # a column shard's width and state are its own
                want = dataclasses.replace(want, dim=got.dim, state_dim=got.state_dim)
            for f in dataclasses.fields(TableSpec):
                if getattr(want, f.name) != getattr(got, f.name):
                    raise StoreCorruptError(
                        f"{tables_file} gives table {name!r} {f.name}={getattr(o.spec, f.name)!r}, but {where} holds it "
                        f"with {f.name}={getattr(got, f.name)!r}: {tables_file} was edited or replaced; {_RESTORE_ANOTHER}")
    for r, store in stores.items():
        if set(store.tables) - placed[r]:
            raise StoreCorruptError(f"{checkpoint / f'rank-{r}'} holds tables {sorted(set(store.tables) - placed[r])}, which "
                                    f"{plan_file} does not place on rank {r}: {_EDITED}")
    try:  # each directory agrees with both files; do the files cover the tables' rows and columns?
        plan.check([o.spec for o in olds.values()])
    except PlanMismatchError as e:
        raise StoreCorruptError(f"{plan_file} and {tables_file} disagree ({e}): one was edited or replaced; "
                                f"{_RESTORE_ANOTHER}") from None



def _write_json(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

