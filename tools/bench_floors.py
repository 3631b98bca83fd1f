"""The floors ``tierstore bench scale`` measures beside its runs, on the store's own
data.mdb: the disk's 4 KiB random reads (O_DIRECT) at queue depth 32 and 1 (fio with
libaio; without fio, Python preads from a thread pool), and py-lmdb alone doing a
step's gets and puts in the table's layout."""
from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np


def drop_page_cache(file: Path) -> None:
    """Drop ``file``'s pages from the page cache, dirty ones too: they are written out first
    (DONTNEED skips a dirty page, and the rows a run before wrote back would then serve the
    next run from memory charged to no limit of its)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_floor(file: Path, seconds: float, depths: tuple[int, ...] = (32, 1)) -> dict:
    """4 KiB random reads per second of ``file``, O_DIRECT, at each queue depth of ``depths``
    (``iops_qd<depth>``), once the writes the system holds are on disk (os.sync: the kernel
    writing them out meanwhile took reads' time)."""
    os.sync()
    if shutil.which("fio"):
        return {"tool": "fio (libaio, O_DIRECT, 4 KiB random reads)", "file": str(file),
                **{f"iops_qd{d}": _fio_iops(file, d, seconds) for d in depths}}
    try:
        iops = {f"iops_qd{d}": _pread_iops(file, d, seconds) for d in depths}
    except OSError as e:  # O_DIRECT is refused on some filesystems (tmpfs)
        return {"tool": f"none: fio is not installed and O_DIRECT preads failed ({e.strerror})", "file": str(file),
                **{f"iops_qd{d}": None for d in depths}}
    return {"tool": "fio is not installed (apt-get install -y fio): Python O_DIRECT preads from a thread pool "
                    "of as many threads as the depth (a lower bound: the interpreter adds CPU a read)",
            "file": str(file), **iops}


def _fio_iops(file: Path, depth: int, seconds: float) -> float:
    out = subprocess.run(["fio", "--name=floor", f"--filename={file}", "--readonly", "--rw=randread", "--bs=4k", "--direct=1",
                          "--ioengine=libaio", f"--iodepth={depth}", f"--runtime={seconds:g}", "--time_based",
                          "--output-format=json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out[out.index("{"):])["jobs"][0]["read"]["iops"])


def _pread_iops(file: Path, threads: int, seconds: float) -> float:
    fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
    pages = max(1, os.fstat(fd).st_size // 4096)

    def reader(seed: int) -> int:
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
        offsets = (np.random.default_rng(seed).integers(0, pages, 1 << 14) * 4096).tolist()
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            os.preadv(fd, [buf], offsets[n % len(offsets)])
            n += 1
        return n

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            reads = sum(pool.map(reader, range(threads)))
        return reads / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def lmdb_floor(path: Path, table: str, ids: np.ndarray) -> dict:
    """py-lmdb alone getting the rows of ``ids`` (a step's unique ids, sorted), with the
    page cache dropped and again warm, and writing them in one write transaction
    (committed, not synced, as the write-back commits), on the store's own data.mdb.

    Keyed layout: a get and a put a row, as tools/bench.py's cold bench times its raw
    loop, the rows put back unchanged. Log layout (io.rowlog): a get of each row's
    newest segment (a value of LMDB's) and a copy of the row's slot out of it, and a put
    of the rows packed as one value into a scratch environment beside the store (LMDB's
    cost of appending them, as the write-back appends a segment)."""
    from tierstore.io import encode_keys

    uid = np.unique(ids)
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=1024)
    try:
        with env.begin() as txn:
            log = txn.get(b"s:" + table.encode()) is not None
        found = locate_log_rows(env, env.open_db(b"s:" + table.encode(), create=False), uid) if log else None
    finally:
        env.close()  # the pages this process has mapped would stay in the page cache
    if log:
        return _log_floor(path, table, found)
    keys = encode_keys(uid)
    n = len(keys)
    # copy-on-write: the transaction takes new pages (a leaf and its branches a row) past the file's end
    env = lmdb.open(str(path), max_dbs=1024, sync=False,
                    map_size=(path / "data.mdb").stat().st_size + n * 4 * 4096 + (64 << 20))
    try:
        db = env.open_db(b"t:" + table.encode(), create=False)
        drop_page_cache(path / "data.mdb")
        times = []
        for _ in range(2):  # cold, then warm
            t0 = time.perf_counter()
            with env.begin(db=db, buffers=False) as txn:
                values = list(map(txn.get, keys))
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with env.begin(write=True, db=db) as txn:  # the rows put back unchanged: random page rewrites
            txn.cursor().putmulti(zip(keys, values))
        put = time.perf_counter() - t0
    finally:
        env.close()
    return {"rows": n, "layout": "keyed", "get_cold_us": 1e6 * times[0] / n, "get_warm_us": 1e6 * times[1] / n,
            "put_us": 1e6 * put / n}


def _log_floor(path: Path, table: str, found: "LogRows") -> dict:
    out = np.empty((len(found.rows), found.width), dtype=np.uint8)
    drop_page_cache(path / "data.mdb")
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=1024)
    try:
        db = env.open_db(b"s:" + table.encode(), create=False)
        times = []
        for _ in range(2):  # cold, then warm
            t0 = time.perf_counter()
            copy_log_rows(env, db, found, out)
            times.append(time.perf_counter() - t0)
    finally:
        env.close()
    m = max(len(out), 1)
    put = _scratch_put(path, out.tobytes())
    return {"rows": len(out), "segments": len(found.segments), "layout": "log", "get_cold_us": 1e6 * times[0] / m,
            "get_warm_us": 1e6 * times[1] / m, "put_us": 1e6 * put / m}


@dataclass(frozen=True)
class LogRows:
    """Where a log table's newest copies of some rows are: ``rows`` (positions in the ids
    asked for, grouped by segment), ``segments`` (sequence numbers, ascending), ``groups``
    (each segment's positions among ``rows``), ``offsets`` (each asked id's slot in its
    segment's value, in bytes) and ``width`` (slot bytes)."""
    rows: np.ndarray
    segments: np.ndarray
    groups: list[np.ndarray]
    offsets: np.ndarray
    width: int


def locate_log_rows(env, db, uid: np.ndarray) -> LogRows:
    """Where the rows of ``uid`` (sorted unique) are in a log table's segments database
    ``db``, read with py-lmdb alone: its values' headers, in sequence order (io.rowlog)."""
    from tierstore.io import rowlog

    n = len(uid)
    seq = np.full(n, -1, dtype=np.int64)  # each row's newest segment, -1 where none holds it
    offsets = np.zeros(n, dtype=np.int64)
    width = 0
    with env.begin(db=db, buffers=True) as txn:  # keys in sequence order: later copies overwrite earlier
        for key, value in txn.cursor():
            kind, seg_ids, start = rowlog.parse_header(value)
            pos = np.minimum(np.searchsorted(uid, seg_ids), n - 1)
            hit = np.flatnonzero(uid[pos] == seg_ids)
            seq[pos[hit]] = int.from_bytes(key, "big") if kind == rowlog.ROWS else -1
            if kind == rowlog.ROWS:
                width = rowlog.HEADER.unpack_from(value)[3]
                offsets[pos[hit]] = start + hit * width
    stored = np.flatnonzero(seq >= 0)
    rows = stored[np.argsort(seq[stored], kind="stable")]
    segments, firsts = np.unique(seq[rows], return_index=True)
    return LogRows(rows, segments, np.split(np.arange(len(rows)), firsts[1:]), offsets, width)


def copy_log_rows(env, db, found: LogRows, out: np.ndarray) -> None:
    """Copy the slots of ``found`` into ``out`` (uint8 [len(found.rows), width]): a get of
    each segment, its rows copied out of the value at once."""
    from tierstore.io import rowlog

    with env.begin(db=db, buffers=True) as txn:
        for seq, group in zip(found.segments.tolist(), found.groups):
            value = np.frombuffer(txn.get(rowlog.seq_key(seq)), dtype=np.uint8)
            slots = np.lib.stride_tricks.as_strided(value, shape=(len(value) - found.width + 1, found.width), strides=(1, 1))
            out[group] = slots[found.offsets[found.rows[group]]]


def _scratch_put(path: Path, value: bytes) -> float:
    """Seconds LMDB takes to put ``value`` in one write transaction and commit it (not
    synced), in a scratch environment beside the store (on its disk), removed after."""
    scratch = path.parent / f".{path.name}-lmdb-floor"
    shutil.rmtree(scratch, ignore_errors=True)
    env = lmdb.open(str(scratch), map_size=2 * len(value) + (64 << 20), sync=False)
    try:
        t0 = time.perf_counter()
        with env.begin(write=True) as txn:
            txn.put(b"floor", value)
        return time.perf_counter() - t0
    finally:
        env.close()
        shutil.rmtree(scratch, ignore_errors=True)
