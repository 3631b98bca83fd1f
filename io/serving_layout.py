"""Serving stores on disk (tierstore.export writes them, tierstore.serving.store reads them).

A serving store is an LMDB environment holding weights only, each row packed at
its serving dtype's size (docs/serving.md):

- ``float32``: ``dim`` little-endian float32;
- ``float16``: ``dim`` little-endian float16;
- ``int8`` / ``int4``: FBGEMM's ``FusedNBitRowwiseQuantizedSBHalf`` row, as
  ``torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` writes it:
  ``ceil(dim * bits / 8)`` bytes of codes (int4: two a byte, the lower nibble
  first), then the row's scale and bias as float16. A value reads back as
  ``float32(scale) * code + float32(bias)`` in float32.

Each table is a database ``q:<name>`` keyed as the training store's (big-endian
uint64 ids); ``__serving__`` holds the store's description as JSON under ``meta``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np

from .codecs import encode_keys
from .errors import BadRowsError, ForeignStoreError, StoreCorruptError, StoreExistsError, StoreNotFoundError
from .lmdb_file import _LOW_SPACE, _free_bytes, check_data_file, corrupt, disk_full

SERVING_FORMAT = 1
SERVING_DTYPES = ("float32", "float16", "int8", "int4")
_META_DB = b"__serving__"
FLOAT16_MAX = 65504.0


class RowFormat:
    """A serving dtype's rows: float32 [n, dim] <-> packed uint8 [n, row_bytes]."""

    def __init__(self, dim: int, dtype: str):
        if dtype not in SERVING_DTYPES:
            raise BadRowsError(f"unknown serving dtype {dtype!r}; one of {list(SERVING_DTYPES)}")
        if dtype == "int4" and dim % 2:
            raise BadRowsError(f"int4 rows pack two codes a byte and need an even dim, got dim={dim}; export this table as int8")
        self.dim, self.dtype = dim, dtype
        self.bits = {"int8": 8, "int4": 4}.get(dtype)
        if self.bits is None:
            self.code_bytes = dim * np.dtype(_FLOATS[dtype]).itemsize
            self.row_bytes = self.code_bytes
        else:
            self.code_bytes = dim * self.bits // 8
            self.row_bytes = self.code_bytes + 4  # float16 scale, float16 bias

    def encode(self, rows: np.ndarray) -> np.ndarray:
        """Rows (float32 [n, dim], finite) packed; int8/int4 quantized as FBGEMM's
        FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf does, bit for bit."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if self.bits is None:
            return rows.astype(_FLOATS[self.dtype]).view(np.uint8).reshape(len(rows), self.row_bytes)
        levels = (1 << self.bits) - 1
        lo = rows.min(axis=1).astype(np.float16).astype(np.float32)  # the bias is a float16
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            span = rows.max(axis=1) - lo
            scale = np.where(span == 0, np.float32(1), span / np.float32(levels)).astype(np.float16).astype(np.float32)
            scale[scale == 0] = 1  # the span underflowed float16
            inverse = np.float32(1) / scale
            bad = np.isinf(inverse)
            scale[bad], inverse[bad] = 1, 1
            codes = np.clip(np.rint((rows - lo[:, None]) * inverse[:, None]), 0, levels).astype(np.uint8)
        out = np.empty((len(rows), self.row_bytes), dtype=np.uint8)
        out[:, : self.code_bytes] = codes if self.bits == 8 else codes[:, 0::2] | (codes[:, 1::2] << 4)
        out[:, self.code_bytes:] = np.stack([scale, lo], axis=1).astype("<f2").view(np.uint8)
        return out

    def decode(self, packed: np.ndarray) -> np.ndarray:
        """float32 [n, dim]: the exact values a row stands for (module docstring)."""
        packed = np.ascontiguousarray(packed, dtype=np.uint8)
        if self.bits is None:
            return packed.view(_FLOATS[self.dtype]).astype(np.float32)
        codes = self.codes(packed).astype(np.float32)
        scale_bias = np.ascontiguousarray(packed[:, self.code_bytes:]).view("<f2").astype(np.float32)
        return codes * scale_bias[:, :1] + scale_bias[:, 1:]

    def codes(self, packed: np.ndarray) -> np.ndarray:
        """The integer codes of int8/int4 rows, uint8 [n, dim]."""
        raw = packed[:, : self.code_bytes]
        if self.bits == 8:
            return raw
        return np.stack([raw & 15, raw >> 4], axis=2).reshape(len(raw), self.dim)


_FLOATS = {"float32": "<f4", "float16": "<f2"}


class ServingWriter:
    """Writes a new serving store: into a directory beside ``path``, renamed to
    ``path`` by ``commit``; a writer never committed leaves nothing behind, not even
    the directories above ``path`` it made."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise StoreExistsError(f"{self.path} exists and is not an empty directory; choose a new directory for the serving store")
        made = self.path.parent
        while not made.parent.exists() and made.parent != made:
            made = made.parent
        self._made = None if made.exists() else made  # the topmost directory this writer makes
        stem = self.path.parent / f".{self.path.name}.{uuid.uuid4().hex[:8]}"
        self._partial = stem.with_name(stem.name + ".partial")
        # the exporter's scratch space beside the store (its snapshot of the training store)
        self.scratch = stem.with_name(stem.name + ".scratch")
        self._env = None
        self._dbs: dict[str, object] = {}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._partial.mkdir()
            with self._disk_full():
                self._env = lmdb.open(str(self._partial), map_size=1 << 40, max_dbs=1024, sync=False, readahead=False)
        except BaseException:
            self.abort()
            raise

    def put(self, table: str, ids: np.ndarray, packed: np.ndarray) -> None:
        """Rows of ``ids`` (ascending), packed uint8 [n, row_bytes]."""
        values = np.ascontiguousarray(packed).view(f"V{packed.shape[1]}").ravel().tolist()
        with self._disk_full():
            if table not in self._dbs:
                self._dbs[table] = self._env.open_db(b"q:" + table.encode())
            with self._env.begin(write=True, db=self._dbs[table]) as txn, txn.cursor() as cur:
                cur.putmulti(zip(encode_keys(ids), values), append=True)

    def commit(self, meta: dict) -> Path:
        with self._disk_full():
            for t in meta["tables"]:  # a table with no rows stored still has its database
                self._dbs.setdefault(t["name"], self._env.open_db(b"q:" + t["name"].encode()))
            db = self._env.open_db(_META_DB)
            with self._env.begin(write=True, db=db) as txn:
                txn.put(b"meta", json.dumps({**meta, "format": SERVING_FORMAT}).encode())
            self._env.sync(True)
        self._env.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        os.rename(self._partial, self.path)  # replaces an empty directory
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return self.path

    def abort(self) -> None:
        if self._env is not None:
            self._env.close()
        shutil.rmtree(self._partial, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self._made is not None:
            for d in [self.path.parent, *self.path.parent.parents]:
                try:
                    d.rmdir()  # only while empty: another process may have put something there meanwhile
                except OSError:
                    break
                if d == self._made:
                    break

    @contextlib.contextmanager
    def _disk_full(self) -> Iterator[None]:
        """LMDB's errors on a full disk as OSError ENOSPC naming the store: DiskError, or any
        error with little space left (LMDB reports a commit cut short by a full disk as EIO)."""
        try:
            yield
        except lmdb.Error as e:
            if not isinstance(e, lmdb.DiskError) and _free_bytes(self._partial) >= _LOW_SPACE:
                raise
            raise disk_full(self.path, f"could not write the serving store {self.path}", e,
                            "free disk space, or write it to another disk") from e


class NotServingStoreError(StoreCorruptError):
    """An LMDB environment without a serving store's description: not written by tierstore.export."""


class ServingReader:
    """A serving store, readonly: its description and packed rows by id. Readers of
    one store in a process share its environment (LMDB opens one per process)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        data = self.path / "data.mdb"
        if not data.exists():
            raise StoreNotFoundError(f"no serving store at {self.path} (missing data.mdb); write one with tierstore.export(...)")
        check_data_file(data)
        key = (data.stat().st_dev, data.stat().st_ino)
        with _OPEN_LOCK:
            if key not in _OPEN:
                _OPEN[key] = [lmdb.open(str(self.path), readonly=True, lock=False, max_dbs=1024, readahead=False), 0]
            _OPEN[key][1] += 1
        self._key, self._env = key, _OPEN[key][0]
        try:
            self.meta, self._dbs = self._describe()
        except BaseException:
            self.close()
            raise

    def _describe(self) -> tuple[dict, dict]:
        def damaged(what: str) -> StoreCorruptError:
            return corrupt(self.path / "data.mdb", what)
        try:
            with self._env.begin(buffers=False) as txn:
                if txn.get(_META_DB) is None:
                    raise NotServingStoreError(f"{self.path} is not a serving store (no {_META_DB.decode()} database); "
                                            "a training store is exported with tierstore.export(src, dst)")
                raw = txn.get(b"meta", db=self._env.open_db(_META_DB, txn=txn, create=False))
                meta = json.loads(raw)
                if meta.get("format") != SERVING_FORMAT:
                    raise ForeignStoreError(f"{self.path} has serving format {meta.get('format')}; this tierstore reads {SERVING_FORMAT}")
            # opened outside a read transaction: a handle opened in one dies with it
            dbs = {t["name"]: self._env.open_db(b"q:" + t["name"].encode(), create=False) for t in meta["tables"]}
        except (TypeError, KeyError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise damaged(f"its serving metadata is unreadable ({type(e).__name__}: {e})") from None
        except lmdb.NotFoundError as e:
            raise damaged(f"a table's database named in its metadata is missing ({e})") from None
        except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError) as e:
            raise damaged(f"LMDB found a damaged page ({e})") from e
        return meta, dbs

    def get_rows(self, table: str, ids: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """Packed rows of sorted ``ids`` (uint8 [n, row_bytes], zero where absent) and the mask of those found."""
        values = np.empty(len(ids), dtype=object)
        with self._env.begin(db=self._dbs[table], buffers=False) as txn:
            values[:] = list(map(txn.get, encode_keys(ids)))
        found = values != None  # noqa: E711 (elementwise)
        out = np.zeros((len(ids), row_bytes), dtype=np.uint8)
        if found.any():
            buf = b"".join(values[found].tolist())
            if len(buf) != int(found.sum()) * row_bytes:
                raise corrupt(self.path / "data.mdb", f"rows of table {table!r} are not {row_bytes} bytes each")
            out[found] = np.frombuffer(buf, dtype=np.uint8).reshape(-1, row_bytes)
        return out, found

    def rows_stored(self) -> dict[str, int]:
        """Rows each table holds in LMDB (those an export left out read as initial values)."""
        with self._env.begin() as txn:
            return {name: txn.stat(db)["entries"] for name, db in self._dbs.items()}

    def close(self) -> None:
        with _OPEN_LOCK:
            if self._env is None:
                return
            self._env = None
            _OPEN[self._key][1] -= 1
            if not _OPEN[self._key][1]:
                _OPEN.pop(self._key)[0].close()


_OPEN: dict[tuple[int, int], list] = {}  # (st_dev, st_ino) of data.mdb -> [environment, readers]
_OPEN_LOCK = threading.Lock()
