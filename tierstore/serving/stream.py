"""Streaming updates from a training store to serving replicas (docs/serving.md).

A Publisher, beside a training store, writes into one directory: ``export-V/``, a
whole serving store at version V, and ``delta-V.bin``, the rows changed from
version V - 1 to V. ``publish()``, called at a training step boundary, flushes the
store and writes the rows sent to LMDB since the last publish (TieredStore.take_changes),
read as the store reads them, packed in the serving dtype. ``compact()`` writes a
new export at the current version and removes the files it makes unnecessary.

A Replica, in any process that sees the directory (shared or copied), serves the
newest export and applies each delta after it in order (``poll()``). A delta is
applied whole while lookups wait, so a lookup sees one version. A delta is checked
whole before any of it is applied: one that is damaged, cut short, or does not fit the
replica's tables raises DeltaCorruptError and changes nothing. A replica that finds the
next delta gone (compacted away) catches up from the newest export; with no newer export
but later deltas published, the gap is DeltaGapError.

Files appear whole: each is written aside, synced and renamed. A delta carries the
rows deleted in the training store too (evict, TTL and L2 expiry: every row that reads
as its initial value again): a replica serves their initial values from then on, as
for a row an export leaves out.
"""
from __future__ import annotations

import os
import re
import threading
import time
import uuid
from pathlib import Path

import torch

from tierstore.io.deltas import DeltaCorruptError, damaged, decode_delta, encode_delta, write_whole
from tierstore.io.serving_layout import RowFormat

from tierstore.serving.store import ServingStore
from tierstore.serving.export import export, written
from tierstore.errors import BadValuesError, PathNotFoundError
from tierstore.eviction import make_policy

_EXPORT = re.compile(r"export-(\d{8})")
_DELTA = re.compile(r"delta-(\d{8})\.bin")


class DeltaGapError(DeltaCorruptError):
    """The next delta is missing while later ones are published, and no export after the version
    served lets the replica catch up: it keeps the version it serves."""


def _versions(directory: Path, pattern: re.Pattern) -> list[int]:
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := pattern.fullmatch(p.name)))


class Publisher:
    """Publishes a training store's changes into ``directory`` for replicas. Opening one
    writes an export at a new version (a publisher's record of changes starts there)."""

    def __init__(self, store, directory: str | os.PathLike, dtype: str = "int8", tables=None):
        self.store, self.dtype = store, dtype
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        known = _versions(self.directory, _EXPORT) + _versions(self.directory, _DELTA)
        self.version = max(known, default=-1) + 1
        store.take_changes()  # the record starts before the export's flush: nothing falls between
        path = export(store, self.directory / f"export-{self.version:08d}", tables, dtype, version=self.version)
        with ServingStore(path) as s:
            self.tables = {name: RowFormat(spec.dim, dtype) for name, spec in s.tables.items()}
        self.rows_published = 0

    def publish(self) -> int:
        """Flush the store and publish the rows it changed in LMDB since the last publish
        (written or deleted) as the next version; returns it. Call at a step boundary."""
        self.store.flush()
        changed = self.store.take_changes()
        try:
            tables = {}
            for name, ids in changed.items():
                if name in self.tables and len(ids):
                    ids = ids.numpy()
                    weights = self.store.peek(name, ids).numpy()
                    kept = written(self.store.tables[name], ids, weights)  # the others read as initial: deleted
                    tables[name] = (self.dtype, ids[kept], self.tables[name].encode(weights[kept]), ids[~kept])
            write_whole(self.directory / f"delta-{self.version + 1:08d}.bin", encode_delta(self.version + 1, time.time(), tables))
        except BaseException:  # no delta: the version stays, and the next publish carries these rows
            self.store.return_changes(changed)
            raise
        self.version += 1
        self.rows_published += sum(len(ids) + len(gone) for _, ids, _, gone in tables.values())
        return self.version

    def compact(self) -> int:
        """Write an export of the current version; remove the older exports and the deltas it
        holds. A replica behind it catches up from this export. Returns the version."""
        export(self.store, self.directory / f"export-{self.version:08d}", list(self.tables), self.dtype, version=self.version)
        for v in _versions(self.directory, _DELTA):
            if v <= self.version:
                (self.directory / f"delta-{v:08d}.bin").unlink(missing_ok=True)
        for v in _versions(self.directory, _EXPORT):
            if v < self.version:
                _remove_tree(self.directory / f"export-{v:08d}")
        return self.version


def _remove_tree(path: Path) -> None:
    # renamed first, so a reader never opens a half-removed export
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.removing")
    os.rename(path, aside)
    for f in aside.iterdir():
        f.unlink()
    aside.rmdir()


class Replica:
    """Serves the versions published in ``directory``: the newest export, then each
    delta after it, applied by ``poll()``. ``hbm_rows``, ``ddr_rows``, ``device``, ``policy``
    as ServingStore's; lookups and ``rows`` as ServingStore's."""

    def __init__(self, directory: str | os.PathLike, hbm_rows=0, ddr_rows=0, device=None, policy: str = "lru"):
        self.directory = Path(directory)
        make_policy(policy)  # a bad setting is named before the directory is read
        if not self.directory.is_dir():
            raise PathNotFoundError(f"{self.directory} is not a directory; pass the directory a "
                                    "tierstore.serving.stream.Publisher publishes exports and deltas into")
        self._open_args = dict(hbm_rows=hbm_rows, ddr_rows=ddr_rows, device=device, policy=policy)
        self._lock = threading.Lock()  # a catch-up swaps the store
        self._polling = threading.Lock()  # one poll at a time: each delta is applied once
        self.rows_applied = 0
        self.store = self._open_newest()
        if self.store is None:
            raise PathNotFoundError(f"no export in {self.directory}; a tierstore.serving.stream.Publisher writes one")
        try:
            self.poll()
        except DeltaCorruptError:  # the replica serves what it could apply; poll() raises this again
            pass
        except BaseException:
            self.store.close()
            raise

    def _open_newest(self) -> ServingStore | None:
        for v in reversed(_versions(self.directory, _EXPORT)):
            try:
                return ServingStore(self.directory / f"export-{v:08d}", **self._open_args)
            except FileNotFoundError:  # removed by a compaction meanwhile
                continue
        return None

    @property
    def version(self) -> int:
        return self.store.version

    def poll(self) -> int:
        """Apply every delta published after the version served, in order; returns the
        version served. Raises DeltaCorruptError (the version stays, nothing of the delta is
        applied) on a damaged delta, DeltaGapError on a missing one that later deltas follow."""
        with self._polling:
            return self._poll()

    def _poll(self) -> int:
        while True:
            v = self.store.version + 1
            path = self.directory / f"delta-{v:08d}.bin"
            try:
                header, rows = decode_delta(path)
            except FileNotFoundError:
                if max(_versions(self.directory, _EXPORT), default=-1) > self.store.version:
                    self._catch_up()
                    continue
                later = [d for d in _versions(self.directory, _DELTA) if d >= v]
                if later and later[0] == v:  # published meanwhile
                    continue
                if later:
                    raise DeltaGapError(f"delta {path} is missing, but deltas {later[0]} to {later[-1]} after it are published "
                                        f"and no export after version {v - 1}: the replica keeps serving version {v - 1}. "
                                        "Copy the missing delta in, or compact() the publisher to write an export "
                                        "replicas catch up from") from None
                return self.store.version
            if header["version"] != v:
                raise DeltaCorruptError(f"delta {path} holds version {header['version']}, not {v}; the replica keeps serving "
                                        f"version {v - 1}")
            try:
                changes = self.store._checked(rows)
                for t in header["tables"]:
                    if t.get("dtype") != self.store.dtype(t["name"]):
                        raise BadValuesError(f"table {t['name']!r} has {t.get('dtype')} rows, the replica's {self.store.dtype(t['name'])}")
            except (ValueError, KeyError) as e:
                raise damaged(path, str(e.args[0] if isinstance(e, KeyError) else e)) from None
            self.store._apply_checked(v, changes)
            self.rows_applied += sum(len(ids) + len(gone) for ids, _, gone in rows.values())

    def _catch_up(self) -> None:
        newer = self._open_newest()
        if newer is None or newer.version <= self.store.version:
            if newer is not None:
                newer.close()
            return
        with self._lock:
            old, self.store = self.store, newer
        old.close()

    def metrics(self) -> dict:
        """version served, the newest published, lag in versions and seconds, rows applied.
        ``lag_seconds``: the age of the oldest file published after the version served (the
        next delta, or when it is missing the oldest later delta or export), 0 when none is."""
        served = self.version
        deltas, exports = _versions(self.directory, _DELTA), _versions(self.directory, _EXPORT)
        published = max(deltas + exports, default=served)
        newer = [self.directory / f"delta-{v:08d}.bin" for v in deltas if v > served]
        newer += [self.directory / f"export-{v:08d}" / "data.mdb" for v in exports if v > served]
        written = []
        for p in newer:
            try:
                written.append(p.stat().st_mtime)
            except FileNotFoundError:  # compacted away meanwhile
                pass
        lag_s = max(0.0, time.time() - min(written)) if written else 0.0
        return {"version": served, "published_version": published, "lag_versions": published - served,
                "lag_seconds": lag_s, "rows_applied": self.rows_applied}

    def lookup(self, table: str, ids, offsets, per_sample_weights: torch.Tensor | None = None, mode: str = "sum") -> torch.Tensor:
        with self._lock:  # the store is not swapped (and closed) under a lookup
            return self.store.lookup(table, ids, offsets, per_sample_weights, mode)

    def rows(self, table: str, ids) -> torch.Tensor:
        with self._lock:
            return self.store.rows(table, ids)

    def close(self) -> None:
        self.store.close()
