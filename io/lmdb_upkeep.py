"""LmdbBackend's upkeep: sweeps of idle and faded rows, copies, compaction."""
from __future__ import annotations

import collections
import errno
import fcntl
import functools
import itertools
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from tierstore.io.codecs import row_norms_sq
from tierstore.io.errors import BadRowsError, StoreExistsError, StoreLockedError, StoreReadonlyError
from tierstore.io.files import fsync_path
from tierstore.io.lmdb_env import _OPEN_LOCK, _lock_directory, _shared_env
from tierstore.io.lmdb_log import STEP


class Upkeep:
    """LmdbBackend's sweeps, copies and compaction."""

    def sweep_all(self, table: str, cutoff: int | None, l2_below: float | None = None, chunk: int = 65536) -> int:
        """sweep() over the whole table from its first row, a transaction a ``chunk`` of rows:
        every row the rules delete now is deleted. Returns the rows deleted."""
        self._sweep_from.pop(table, None)
        deleted = self.sweep(table, cutoff, chunk, l2_below)
        while self._sweep_from.get(table):
            deleted += self.sweep(table, cutoff, chunk, l2_below)
        return deleted

    def _delete(self, txn, table: str, keys: list[bytes]) -> int:
        # map: the per-key calls run in C, as get_rows's gets
        found = sum(map(functools.partial(txn.delete, db=self._dbs[table]), keys))
        if table in self._last_dbs:
            collections.deque(map(functools.partial(txn.delete, db=self._last_dbs[table]), keys), maxlen=0)
        return found

    def sweep(self, table: str, cutoff: int | None, budget: int, l2_below: float | None = None) -> int:
        """Delete the rows last used at or before step ``cutoff``, and those whose
        weights' L2 norm is below ``l2_below``, among the next ``budget`` rows of the
        table (of its last-use database where it keeps one), going on where the last
        sweep stopped and starting over after the end; returns the rows deleted.
        Bounded work: one transaction of ``budget`` cursor steps at most."""
        if table in self._logs:
            return self._log_sweep(table, cutoff, budget, l2_below)
        by_age = table in self._last_dbs
        deleted, resume = [0], [b""]

        def op(txn):
            deleted[0], resume[0] = 0, b""
            with txn.cursor(db=self._last_dbs[table] if by_age else self._dbs[table]) as cur:
                if not cur.set_range(self._sweep_from.get(table, b"")) and not cur.first():
                    return  # no rows
                items = list(itertools.islice(cur.iternext(), budget))
            keys = [k for k, _ in items]
            dead = np.zeros(len(keys), dtype=bool)
            if by_age and cutoff is not None:
                dead |= np.frombuffer(b"".join(v for _, v in items), dtype=STEP) <= cutoff
            if l2_below is not None:
                codec = self._codecs[table]
                values = list(map(functools.partial(txn.get, db=self._dbs[table]), keys)) if by_age else [v for _, v in items]
                rows = np.empty((len(keys), codec.width), dtype=np.float32)
                found = codec.decode(values, rows)
                dead[found] |= row_norms_sq(rows[found, : codec.dim]) < l2_below ** 2
            dead_keys = [keys[i] for i in np.flatnonzero(dead)]
            self._record_deleted(table, np.frombuffer(b"".join(dead_keys), dtype=">u8").astype(np.int64))
            deleted[0] = self._delete(txn, table, dead_keys)
            # the next sweep starts after the last key seen (keys are 8-byte big-endian ids < 2**63)
            last = int.from_bytes(keys[-1], "big")
            resume[0] = (last + 1).to_bytes(8, "big") if len(items) == budget else b""
        self._write(op)
        # moved on only once committed: _write replays op after growing the map, and a failed
        # sweep must look at the same rows again
        self._sweep_from[table] = resume[0]
        return deleted[0]

    def copy_to(self, path: str | os.PathLike, compact: bool = True) -> Path:
        """Copy the environment (one read transaction: a consistent snapshot) into
        the directory ``path``, which must be empty or absent; writers may go on meanwhile."""
        dest = Path(path)
        if dest.resolve() == self.path.resolve():
            raise BadRowsError(f"cannot copy the store at {self.path} onto itself; choose another directory")
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise StoreExistsError(f"{dest} exists and is not an empty directory; choose a new directory for the copy")
        # Written aside, synced, then renamed: a copy cut short (a kill, a full disk)
        # never appears under dest's name, where it would open as a damaged store.
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.partial"
        partial.mkdir()
        try:
            with self._named_errors(dest / "data.mdb"):
                self.env.copy(str(partial), compact=compact)
            fsync_path(partial / "data.mdb")
            fsync_path(partial)
            os.rename(partial, dest)  # replaces dest if it is an empty directory
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        fsync_path(dest.parent)
        return dest

    def compact(self) -> tuple[int, int]:
        """Rewrite data.mdb without LMDB's free pages, then close this backend; returns
        data.mdb's bytes before and after. Needs this writer to be the store's only
        user: no other store of it open in this process, no process reading it (a
        reader would go on reading the old file). The compacted copy is written aside,
        synced, and renamed over data.mdb while LMDB's own lock keeps every open
        environment out and the directory's flock every opener (_lock_directory): a
        reader opening meanwhile waits, then reads the new file; a kill at any point
        leaves one whole data.mdb, the old or the new."""
        if self._lock_fd is None:
            raise StoreReadonlyError(f"tierstore at {self.path} is open readonly; compacting needs it open for writing")
        if self._shared.users > 1:
            raise StoreLockedError(f"tierstore at {self.path} is also open readonly in this process; close those stores, then compact")
        data, aside = self.path / "data.mdb", self.path / "data.mdb.compacting"
        before = data.stat().st_size
        try:
            fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # a killed compaction's leftover is reused
            try:
                with self._named_errors(aside):
                    self.env.copyfd(fd, compact=True)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:  # a full disk: the store stays as it was
            aside.unlink(missing_ok=True)
            raise
        writer_lock, self._lock_fd = self._lock_fd, None  # held until data.mdb is swapped: no writer opens meanwhile
        try:
            self.close()
            with _OPEN_LOCK:  # nothing in this process opens the store meanwhile
                others = _shared_env(self.path)
                try:  # nor another process: one opening now refuses the compaction, as one open does
                    swap = _lock_directory(self.path, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    swap, others = None, True
                # Every open environment holds LMDB's lock byte (0 of lock.mdb) shared; an opener waits on it.
                # Opening lock.mdb here is safe only while this process has no environment of it open:
                # closing any descriptor of a file drops all of this process's fcntl locks on it.
                lock = None if others else os.open(self.path / "lock.mdb", os.O_RDWR)
                try:
                    if lock is not None:
                        try:
                            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
                        except OSError as e:
                            if e.errno not in (errno.EAGAIN, errno.EACCES):
                                raise
                            others = True
                    if others:
                        aside.unlink()
                        raise StoreLockedError(
                            f"tierstore at {self.path} is open in another process (a reader: tierstore stats, a readonly "
                            "store, prefetchd); close it, then compact; nothing changed")
                    os.rename(aside, data)
                    fsync_path(self.path)  # the rename itself survives a power loss
                finally:
                    if lock is not None:
                        os.close(lock)  # before the directory: an opener let in must find lock.mdb free, and reset it
                    if swap is not None:
                        os.close(swap)
        finally:
            os.close(writer_lock)
        return before, data.stat().st_size
