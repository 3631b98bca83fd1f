"""Incremental checkpoints: ``TieredStore.checkpoint(path, incremental=True)`` writes a
chain of links, each the rows changed in LMDB since the last (a delta file,
tierstore.io.deltas) and the tables' life (step counts, admission sketches); ``restore``
replays a chain into a new store (docs/serving.md)."""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
import uuid
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path

import numpy as np
import torch

from tierstore.io import LmdbBackend, RowBackend, StoreCorruptError
from tierstore.io.deltas import DeltaCorruptError, decode_delta, encode_delta, write_whole
from tierstore.spec import TableSpec
from tierstore.errors import FormatError, PathExistsError, kind


CHAIN_FILE, LINK_FILE, LIFE_FILE = "chain.json", "link.bin", "life.bin"
# chain.json's "format": 2, links carry LIFE_FILE beside their rows; 1 (no "format"), rows only
LINK_FORMAT = 2
_LIFE_MAGIC = b"TSLIFE\x00\x02"  # the life section's own version in its last byte
_LIFE_META = ("steps", "evicted", "updates", "last_flush")  # what flush() records of the tables' lives
_U32 = struct.Struct("<I")
_CHAIN_READER = "checkpoint"  # TieredStore.take_changes's record for the chain
_chains: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # store -> its chain's last checkpoint (path, id, link)


class CheckpointChainError(StoreCorruptError):
    """An incremental checkpoint's chain cannot be replayed: a link is damaged, missing, not its
    parent's, or of a link format this tierstore does not read."""


def incremental_checkpoint(store, backend: RowBackend, path: str | os.PathLike) -> Path:
    """TieredStore.checkpoint(path, incremental=True), the store flushed and its lock held
    (``backend`` its RowBackend): a whole copy (the chain's base) if the store has none yet,
    else a link of the rows changed in LMDB since its last, as LMDB holds them (weights, optimizer
    state and, with ttl_steps, last-use steps), the ids deleted, and the life of every table:
    its step count, eviction and update counts, and its admission sketch, whole."""
    path = Path(path)
    last = _chains.get(store)
    if last is None:
        store.checkpoint(path)
        store.take_changes(_CHAIN_READER)  # the record starts at the copy: the lock is held, nothing falls between
        return _chained(store, path, None, 0)
    parent, parent_id, link = last
    changes = store.take_changes(_CHAIN_READER)
    try:
        return _write_link(store, backend, path, changes, (parent, parent_id), link + 1)
    except BaseException:  # a link that failed is not in the chain: its changes go to the next one
        store.return_changes(changes, _CHAIN_READER)
        raise


def _write_link(store, backend: RowBackend, path: Path, changes: Mapping[str, torch.Tensor], parent: tuple[Path, str], link: int) -> Path:
    tables, last_use = {}, {}
    # every LMDB write and delete of a row is recorded, a step's new last use among them
    # (flush writes each row a step used): these ids are all that changed of the rows
    for name, ids in changes.items():
        ids = ids.numpy()
        rows, found = backend.get_rows(name, ids)
        tables[name] = ("float32", ids[found], rows[found].view(np.uint8), ids[~found])
        if backend.keeps_last_use(name):
            last_use[name] = backend.get_last_use(name, ids[found])
    meta = backend.read_meta()
    sketches = {name: blob for name in store.tables if (blob := backend.get_sketch(name)) is not None}
    path.mkdir(parents=True)
    try:
        write_whole(path / LINK_FILE, encode_delta(link, time.time(), tables))
        write_whole(path / LIFE_FILE, encode_life({k: meta[k] for k in _LIFE_META if k in meta}, last_use, sketches))
        return _chained(store, path, parent, link)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # the directory is this call's: no part of a link stays
        raise


def encode_life(meta: dict, last_use: Mapping[str, np.ndarray], sketches: Mapping[str, bytes]) -> bytes:
    """A link's life section: _LIFE_MAGIC, then compressed: a JSON header's length and the header
    (the meta records, and per table the counts of its last-use steps and sketch bytes), each
    table's last-use steps (int64, in the order of the link's rows) and sketch; then the CRC-32
    of all before it. Sketches compress well while few ids were seen."""
    names = sorted({*last_use, *sketches})
    header = {"meta": meta, "tables": [{"name": n, "last_use": len(last_use[n]) if n in last_use else None,
                                        "sketch": len(sketches[n]) if n in sketches else None} for n in names]}
    head = json.dumps(header).encode()
    body = [_U32.pack(len(head)), head]
    for n in names:
        body += [np.ascontiguousarray(last_use.get(n, ()), dtype="<i8").tobytes(), sketches.get(n, b"")]
    data = _LIFE_MAGIC + zlib.compress(b"".join(body), 1)
    return data + _U32.pack(zlib.crc32(data))


def decode_life(path: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, bytes]]:
    """(meta records, last-use steps, sketches) of a life section; CheckpointChainError if it is not whole."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointChainError(f"incremental checkpoint {path.parent} lacks its {LIFE_FILE}; restore an "
                                   "earlier link of the chain, or its base") from None

    def damaged(what: str) -> CheckpointChainError:
        return CheckpointChainError(f"incremental checkpoint {path.parent}'s {LIFE_FILE} is damaged ({what}); "
                                    "restore an earlier link of the chain, or its base")
    if data[: len(_LIFE_MAGIC) - 1] != _LIFE_MAGIC[:-1] or len(data) < len(_LIFE_MAGIC) + _U32.size:
        raise damaged("it does not start with a life section's header: truncated, or not one")
    if data[len(_LIFE_MAGIC) - 1] != _LIFE_MAGIC[-1]:
        raise CheckpointChainError(f"{path} is a life section of version {data[len(_LIFE_MAGIC) - 1]}; this tierstore "
                                   f"reads version {_LIFE_MAGIC[-1]}: restore the chain with the tierstore that wrote it")
    if zlib.crc32(data[:-_U32.size]) != _U32.unpack_from(data, len(data) - _U32.size)[0]:
        raise damaged(f"its checksum does not match its {len(data)} bytes: truncated or overwritten")
    try:
        body = zlib.decompress(data[len(_LIFE_MAGIC): -_U32.size])
        n = _U32.unpack_from(body)[0]
        header, at = json.loads(body[_U32.size: _U32.size + n]), _U32.size + n
        last_use, sketches = {}, {}
        for t in header["tables"]:
            if t["last_use"] is not None:
                last_use[t["name"]] = np.frombuffer(body, dtype="<i8", count=t["last_use"], offset=at).astype(np.int64)
                at += 8 * t["last_use"]
            if t["sketch"] is not None:
                sketches[t["name"]] = body[at: at + t["sketch"]]
                at += t["sketch"]
        if at != len(body):
            raise FormatError(f"its tables take {at} of {len(body)} bytes")
        return header["meta"], last_use, sketches
    except (zlib.error, struct.error, ValueError, KeyError, TypeError) as e:
        raise damaged(f"its contents do not parse: {kind(e)}: {e}") from None


def _chained(store, path: Path, parent: tuple[Path, str] | None, link: int) -> Path:
    chain = {"id": uuid.uuid4().hex, "link": link, "parent": None, "parent_id": None, "format": LINK_FORMAT}
    if parent is not None:
        chain.update(parent=os.path.relpath(parent[0], path), parent_id=parent[1])
    write_whole(path / CHAIN_FILE, json.dumps(chain).encode())
    _chains[store] = (path.resolve(), chain["id"], link)
    return path


def restore(path: str | os.PathLike, dst: str | os.PathLike, open_store: Callable[[Path], ContextManager]) -> Path:
    """Restore the incremental checkpoint ``path`` into the new directory ``dst``: its chain's
    base copied, then every link up to ``path`` replayed in order (rows written with their
    optimizer state and last-use steps, deleted ids deleted), and the tables' step counts and
    admission sketches set as they were at ``path``: ``dst`` is the store as ``path`` saw it, as
    a whole checkpoint taken there is. CheckpointChainError names a link that is damaged,
    missing, not its parent's or of another link format; ``dst`` is then left out.
    ``open_store(dir)`` opens a store to replay links of format 1 through (tierstore.restore
    passes TieredStore)."""
    links, at = [], Path(path)
    chain = _read_chain(at)
    while chain["parent"] is not None:
        parent = (at / chain["parent"]).resolve()
        up = _read_chain(parent) if (parent / CHAIN_FILE).exists() else None
        if up is None or up["id"] != chain["parent_id"]:
            raise CheckpointChainError(f"incremental checkpoint {at} follows checkpoint {chain['parent_id']} at {parent}, "
                                       "which is missing or another checkpoint; restore from a whole chain, or from a "
                                       "checkpoint taken without incremental=True")
        if up.get("format", 1) != chain.get("format", 1):
            raise CheckpointChainError(f"incremental checkpoint {at} has link format {chain.get('format', 1)}, its parent "
                                       f"{parent} format {up.get('format', 1)}: one chain is written by one store; "
                                       "restore from a whole chain, or from a checkpoint taken without incremental=True")
        links.append(at)
        at, chain = parent, up
    base = at
    dst = Path(dst)
    if dst.exists():
        raise PathExistsError(f"{dst} exists; restore into a new directory")
    partial = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        partial.mkdir(parents=True)
        shutil.copyfile(base / "data.mdb", partial / "data.mdb")
        if chain.get("format", 1) == LINK_FORMAT:
            _replay(partial, links[::-1])
        else:
            _replay_rows(partial, links[::-1], open_store)
        os.rename(partial, dst)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dst


def _replay(store_dir: Path, links: Sequence[Path]) -> None:
    """Links of LINK_FORMAT into the store copied to ``store_dir``, in order: the rows as LMDB
    held them, last-use steps included; then the last link's life records and sketches."""
    backend = LmdbBackend(store_dir, create=False)
    try:
        specs = {d["name"]: TableSpec.from_json(d) for d in backend.read_meta()["tables"]}
        for s in specs.values():
            backend.open_table(s.name, s.dim, s.state_dim, s.dtype, last_use=s.ttl_steps is not None, create=False,
                               num_rows=s.num_rows)
        meta, sketches = {}, {}
        for link in links:
            meta, last_use, sketches = decode_life(link / LIFE_FILE)
            for name, (ids, packed, deleted) in _link_rows(link, specs).items():
                if backend.keeps_last_use(name) and len(last_use.get(name, ())) != len(ids):
                    raise CheckpointChainError(f"incremental checkpoint {link}'s {LIFE_FILE} does not hold the last-use "
                                               f"steps of its {len(ids)} rows of table {name!r}; restore an earlier link")
                if len(ids):
                    rows = np.ascontiguousarray(packed).view(np.float32).reshape(len(ids), specs[name].width)
                    backend.put_rows([(name, ids, rows)], last_use={name: last_use[name]} if name in last_use else None)
                if len(deleted):
                    backend.delete_rows(name, deleted)
        if sketches:
            backend.put_sketches(sketches)
        backend.write_meta(meta)
    finally:
        backend.close()


def _replay_rows(store_dir: Path, links: Sequence[Path], open_store: Callable[[Path], ContextManager]) -> None:
    """Links of format 1 (rows only) through a store: life state stays the base's, and a row
    the replay writes is last used as any written row is."""
    with open_store(store_dir) as store:
        for link in links:
            for name, (ids, packed, deleted) in _link_rows(link, store.tables).items():
                if len(ids):
                    rows = np.ascontiguousarray(packed).view(np.float32).reshape(len(ids), store.tables[name].width)
                    store.write(name, ids, rows, with_state=True)
                if len(deleted):
                    store.evict(name, deleted)


def _link_rows(link: Path, specs: Mapping) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """{table: (ids, packed float32 rows, deleted ids)} of a link; CheckpointChainError if it is not
    whole or names a table the store lacks."""
    try:
        _, tables = decode_delta(link / LINK_FILE)
    except (DeltaCorruptError, FileNotFoundError) as e:
        raise CheckpointChainError(f"incremental checkpoint {link}'s {LINK_FILE} is damaged or missing ({e}); "
                                   "restore an earlier link of the chain, or its base") from None
    if set(tables) - set(specs):
        raise CheckpointChainError(f"incremental checkpoint {link} holds tables {sorted(set(tables) - set(specs))} that its "
                                   f"base lacks (it has {sorted(specs)}); restore from a whole chain")
    return tables


def _read_chain(path: Path) -> dict:
    try:
        chain = json.loads((path / CHAIN_FILE).read_text())
        if not {"id", "link", "parent", "parent_id"} <= chain.keys():
            raise FormatError(f"it lacks {sorted({'id', 'link', 'parent', 'parent_id'} - chain.keys())}")
    except FileNotFoundError:
        raise CheckpointChainError(f"{path} is not an incremental checkpoint (no {CHAIN_FILE}); one is written by "
                                   "store.checkpoint(path, incremental=True)") from None
    except (ValueError, AttributeError) as e:
        raise CheckpointChainError(f"{path / CHAIN_FILE} is damaged ({e}); restore an earlier link of the chain") from None
    if chain.get("format", 1) not in (1, LINK_FORMAT):
        raise CheckpointChainError(f"{path} is an incremental checkpoint of link format {chain['format']}; this tierstore "
                                   f"reads formats 1 and {LINK_FORMAT}: restore it with the tierstore that wrote it")
    return chain
