"""The log layout of LmdbBackend's tables (io.rowlog): their in-memory index kept to a
read snapshot, appends, collection, sweeps, and what readers see of them (publish)."""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from tierstore.io import lmdb_map, rowindex_file, rowlog
from tierstore.io.codecs import row_norms_sq
from tierstore.io.errors import RowIndexDamagedError
from tierstore.io.lmdb_file import corrupt, disk_full

_INDEX_KEY = b"index:"  # + a log table's name: the token of its saved index (_save_indexes)
# + a log table's name: what readers see of it (publish): {"seq": the newest segment, "dropped": the
# newest tombstone deleted while older copies of its ids went}; a table without one is read as committed
_PUBLISHED_KEY = b"published:"
_ROLLBACK_KEYS = 4096  # segments a roll-back deletes a transaction
_ADVISED_READ = 64  # rows a log read gathers from which it asks for all their pages at once first
STEP = np.dtype("<i8")  # a row's last-use step, in a log slot and in a keyed table's u: database


class LogTables:
    """LmdbBackend's methods for its tables in the log layout."""

    def _index_file(self, table: str, token: str) -> Path:
        return self.path / rowindex_file.file_name(f"index-{table.encode().hex()}", token)

    def _new_log(self, table: str, codec, num_rows: int, last_use: bool) -> rowlog.RowLog:
        """An empty index of ``table``, its runs limited as limit_index set: past it, a writer's
        replay spills to the index files it names, a reader's to a private one."""
        log = rowlog.RowLog(codec, num_rows, last_use, self._index_limits.get(table), folder=self.path,
                            hold=self._index_held.get(table, 0), spare=self.spare)
        if self._lock_fd is not None:
            log.on_spill = lambda spilled: self._write_level(table, spilled, locked=False)
        else:
            log.on_spill = self._spill_private
        return log

    def _spill_private(self, log: rowlog.RowLog) -> None:
        """A reader's index past its limit (its only writes are the replays of what the writer
        committed): a level written to a file of its own, mapped, and unlinked at once, so that
        no other process sees it and nothing is left behind, even after kill -9 (the map keeps
        the file until it unmaps), never synced. Beside data.mdb, on the levels' file system, where the reader
        may write there; else in the temporary directory. A file that cannot be written leaves
        the index in memory, past its limit, until the next replay tries again."""
        folder = self.path if os.access(self.path, os.W_OK) else Path(tempfile.gettempdir())
        path = folder / f"reader-index-{os.getpid()}-{os.urandom(8).hex()}.bin"
        k = log.index.plan()
        try:
            rowlog.take_index(log, path, rowlog.write_index(log, path, "", k, durable=False, saved=False), k)
        except OSError as e:
            warnings.warn(f"could not write a reader's row index for {self.path} to {folder} ({e})", stacklevel=3)
        finally:
            path.unlink(missing_ok=True)
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)

    def _load_index(self, table: str) -> None:
        """Start ``table``'s index from the one its writer saved at close (io.rowlog.save_index),
        where LMDB names that file: then only the segments written since are replayed (up to
        the published one: _sync_log)."""
        with self._reading(buffers=True) as txn:
            saved = txn.get(_INDEX_KEY + table.encode(), db=self._meta)
            log = self._logs[table]
            token = None if saved is None else json.loads(bytes(saved))["token"]
            files = None if token is None else rowlog.load_index(self._index_file(table, token), log, token)
            if files is None:
                return
            published = self._published_in(txn, table)
            if published is not None and log.applied > published[0]:  # saved past what was published: not this history
                self._logs[table] = self._new_log(table, log.codec, log.num_rows, log.last_use)
                return
            self._index_named[table] = self._index_current[table] = token
            self._index_named_files[table] = self._index_current_files[table] = files
            _, base, size = self._map_base(txn)
            mem = lmdb_map.map_view(base, size)
            try:
                newer = log.adopt(lmdb_map.walk_values(mem, txn.get(b"s:" + table.encode(), db=self._shared.main), 0))
                log.replay(mem, newer if published is None else [v for v in newer if v[0] <= published[0]])
            except rowlog.SegmentFormatError as e:
                raise self._damaged(table, e) from None
            except RowIndexDamagedError:  # the open's replay (_log_slots) then replays every segment
                self._rebuild_log(table, sync=False)
                return
            if self._lock_fd is None:
                log.free_emptied()
            self._log_synced[table] = txn.id()

    def _save_indexes(self) -> None:
        """A writer's close: save each log table's index (_save_index), unless a publishing
        writer holds segments it has not published (it could not be named)."""
        if self.publish_at_flush and self._unpublished():
            return
        for table in self._logs:
            self._save_index(table)

    def _spill_indexes(self) -> None:
        """After a commit, and at open once replayed: save the index of each log table whose runs
        passed their limit (io.rowindex.RowIndex.wants_spill), which maps them from the file
        written, or that would replay too many rows after a crash (io.rowlog.RowLog.wants_save);
        and name one a replay spilled, where it can be named."""
        for table, log in self._logs.items():
            save, spill = log.wants_save(), log.index.wants_spill()
            unnamed = self._index_current.get(table) != self._index_named.get(table) and not (
                self.publish_at_flush and self._unpublished())
            if save or spill or unnamed:
                try:
                    if spill and not save:  # the runs alone, a level the next save names
                        if self._write_level(table, log, saved=False):
                            self._remove_index_files(table)
                    else:
                        self._save_index(table, write=save)
                except RowIndexDamagedError:  # the merge met a damaged block: the segments hold every row
                    with self._index_lock:
                        self._rebuild_log(table)
                except OSError as e:  # the commit stands; the index stays in memory, past its limit, until the next try
                    warnings.warn(f"could not write the row index of table {table!r} at {self.path} ({e})", stacklevel=3)

    def _save_index(self, table: str, write: bool = True) -> None:
        """Spill ``table``'s index (_write_level) and name it in LMDB: the index an open starts
        from. An index written but not named, or named by another copy of the file, is ignored.
        Named later (at the next publish) while a publishing writer holds segments it has not
        published: the next writer rolls those back, and the index would place rows in them.
        Files no longer named nor mapped are removed."""
        if write and not self._write_level(table, self._logs[table]):
            return
        token = self._index_current[table]
        if token != self._index_named.get(table) and not (self.publish_at_flush and self._unpublished()):
            self._write(lambda txn: txn.put(_INDEX_KEY + table.encode(), json.dumps({"token": token}).encode(), db=self._meta))
            self._index_named[table], self._index_named_files[table] = token, self._index_current_files[table]
        self._remove_index_files(table)

    def _write_level(self, table: str, log: rowlog.RowLog, locked: bool = True, saved: bool = True) -> bool:
        """Write a file of ``table``'s index (``log``) beside data.mdb under a new token: a level
        of what memory holds and the mapped levels its plan merges (io.rowindex.RowIndex.plan),
        and take its runs from there (under the index lock where ``locked``: a replay holds it,
        or runs before any reader). False where it does not read back (nothing changed). Not
        ``saved``: the level alone (io.rowlog.write_index), kept for the next save to name, the
        current save (the one LMDB may name) left as it was."""
        token = os.urandom(16).hex()
        path = self._index_file(table, token)
        k = log.index.plan()
        header = rowlog.write_index(log, path, token, k, saved=saved)
        with self._index_lock if locked else contextlib.nullcontext():
            if not rowlog.take_index(log, path, header, k):  # does not read back: neither named nor mapped
                path.unlink(missing_ok=True)
                return False
        if saved:
            self._index_current[table] = token
            self._index_current_files[table] = rowlog.index_files(path, header)
        self._index_spilled_files[table] = set() if saved else rowlog.index_files(path, header)
        if not locked:  # a replay's spill, at open: named once the open is done (_spill_indexes)
            self._remove_index_files(table)
        return True

    def _remove_index_files(self, table: str) -> None:
        """Remove ``table``'s index files that are neither named in LMDB, nor the current save's,
        nor mapped (a reader that maps one keeps it until it unmaps: the file system frees it then)."""
        keep = self._index_named_files.get(table, set()) | self._index_current_files.get(table, set()) | self._index_spilled_files.get(table, set())
        hexed = table.encode().hex()
        for f in [*self.path.glob(f"index-{hexed}-*"), self.path / f"index-{hexed}.bin"]:
            if f.name not in keep:
                f.unlink(missing_ok=True)

    # -- what readers see of the log tables: the last publish ---------------------------------
    def _published_in(self, txn, table: str) -> tuple[int, int] | None:
        """(newest segment, newest tombstone dropped) of what readers see of log ``table`` in
        ``txn``'s snapshot; None where they see every commit (no publishing writer wrote it)."""
        value = txn.get(_PUBLISHED_KEY + table.encode(), db=self._meta)
        if value is None:
            return None
        try:
            record = json.loads(bytes(value))
            return int(record["seq"]), int(record["dropped"])
        except (ValueError, KeyError, TypeError) as e:
            raise corrupt(self.path / "data.mdb", f"table {table!r}'s published record is unreadable ({e})") from None

    @staticmethod
    def _published_record(seq: int, dropped: int) -> bytes:
        return json.dumps({"seq": seq, "dropped": dropped}).encode()

    def _roll_back(self, table: str) -> None:
        """A writer's open: delete the segments of ``table`` that no publish named (a writer died
        before its flush published them), so the table is as its last flush left it."""
        with self._reading(buffers=True) as txn:
            published = self._published_in(txn, table)
            if published is None:
                return
            _, base, size = self._map_base(txn)
            record = txn.get(b"s:" + table.encode(), db=self._shared.main)
            try:
                seqs = [seq for seq, _, _ in lmdb_map.walk_values(lmdb_map.map_view(base, size), record, published[0])]
            except rowlog.SegmentFormatError as e:
                raise self._damaged(table, e) from None
        for lo in range(0, len(seqs), _ROLLBACK_KEYS):
            def op(txn, part=seqs[lo: lo + _ROLLBACK_KEYS]):
                for seq in part:
                    txn.delete(rowlog.seq_key(seq), db=self._log_dbs[table])
            self._write(op)

    def _start_publishing(self, table: str) -> None:
        """A writer's open, its index replayed: a publishing writer names what readers see of
        ``table`` (all of it) where nothing does yet; any other writer removes that record, for
        readers to see each of its commits."""
        with self._reading() as txn:
            published = self._published_in(txn, table)
        key = _PUBLISHED_KEY + table.encode()
        if not self.publish_at_flush:
            if published is not None:
                self._write(lambda txn: txn.delete(key, db=self._meta))
            return
        if published is None:
            # a reader behind this store's last commit may have missed a dropped tombstone: it rebuilds
            applied = self._logs[table].applied
            published = (applied, applied)
            self._write(lambda txn: txn.put(key, self._published_record(*published), db=self._meta))
        self._published[table], self._dropped[table] = published
        self._retired[table] = set()

    def _unpublished(self) -> bool:
        """Whether a publishing writer has committed segments, or retired some, since its last publish."""
        return any(self._retired.get(t) or log.applied != self._published.get(t) for t, log in self._logs.items())

    def publish(self, meta: dict | None = None, sketches: dict[str, bytes] | None = None) -> None:
        """One transaction that makes what this writer committed visible to readers whole: the
        metadata records ``meta``, the admission ``sketches``, and, of each log table, the
        segments written since the last publish; it deletes the segments retired since (their
        rows live on in newer ones), which readers of the last publish still read. A writer that
        is not publish_at_flush has published each commit already: this writes meta and sketches."""
        opened = [None]

        def op(txn, _):
            self._put_sketches(txn, sketches or {}, opened)
            for k, v in (meta or {}).items():
                txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)
            if not self.publish_at_flush:
                return
            for t, token in self._index_current.items():
                if token != self._index_named.get(t):  # spilled since the last publish: named now
                    txn.put(_INDEX_KEY + t.encode(), json.dumps({"token": token}).encode(), db=self._meta)
            for t, log in self._logs.items():
                for seq in self._retired[t]:
                    txn.delete(rowlog.seq_key(seq), db=self._log_dbs[t])
                txn.put(_PUBLISHED_KEY + t.encode(), self._published_record(log.applied, self._dropped[t]), db=self._meta)

        def applied(_):
            self._sketch_db = opened[0] or self._sketch_db
            for t, log in self._logs.items() if self.publish_at_flush else ():
                self._published[t] = log.applied
                self._retired[t].clear()
            if self.publish_at_flush:
                renamed[:] = [t for t, token in self._index_current.items() if token != self._index_named.get(t)]
                self._index_named.update({t: self._index_current[t] for t in renamed})
                self._index_named_files.update({t: self._index_current_files[t] for t in renamed})
        renamed: list[str] = []
        self._write(op, applied, plan=lambda: None)
        for t in renamed:
            self._remove_index_files(t)

    def _log_read(self, table: str, under_lock, after=None):
        """``under_lock(log)`` with ``table``'s index brought to a read snapshot, then
        ``after(txn, its result)`` in that snapshot with the index free again (a
        commit may update it meanwhile: what under_lock took still names this snapshot).
        Where the index is at the snapshot already (a writer's, but just after a commit),
        under_lock runs on a view of it (io.rowlog.RowLog.view) without the lock, or shares
        the lock with other lookups where the index takes no view; it changes nothing."""
        while True:
            with self._reading(db=self._log_dbs[table], buffers=True) as txn:
                try:
                    with self._index_lock.shared():
                        synced = txn.id() == self._log_synced[table]
                        view = self._logs[table].view() if synced else None
                        got = under_lock(self._logs[table]) if synced and view is None else None
                    if view is not None:
                        got = under_lock(view)
                    if not synced:
                        with self._index_lock:
                            if not self._sync_log(table, txn):
                                continue  # the index moved past this snapshot (a commit meanwhile): take a newer one
                            got = under_lock(self._logs[table])
                except RowIndexDamagedError:  # a block of its files fails its CRC: replayed from the segments
                    with self._index_lock:
                        self._rebuild_log(table, sync=False)
                    continue
                return after(txn, got) if after is not None else got

    def _rebuilt_on_damage(self, table: str, fn):
        """``fn()``, or, where a block of ``table``'s index files fails its CRC when ``fn`` first
        reads it, ``fn()`` again over the index rebuilt from the segments. For a write's lookups
        made before it writes anything (a delete's, a collection's, a sweep's): the segments
        hold every row, and the write goes on."""
        try:
            return fn()
        except RowIndexDamagedError:
            with self._index_lock:
                self._rebuild_log(table)
            return fn()

    def _rebuild_log(self, table: str, sync: bool = True) -> set[str]:
        """``table``'s index afresh (a block of its files failed its CRC when first read:
        io.rowindex_file), replayed from every segment now where ``sync`` (under the index
        lock), else at the next read. Returns {table}: the tables rebuilt."""
        log = self._logs[table]
        self._logs[table] = self._new_log(table, log.codec, log.num_rows, log.last_use)
        self._log_synced[table] = -1
        if sync:
            with self._reading(db=self._log_dbs[table], buffers=True) as txn:
                self._sync_log(table, txn)
        return {table}

    def _log_slots(self, table: str, ids: np.ndarray, out: np.ndarray | None = None,
                   hints: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The stored slots (row bytes, then the last-use step where kept) of ``ids`` and the
        mask of those found, all of one snapshot; into ``out`` (uint8 [n, slot bytes]) when given.
        ``hints`` (int64 [n]): filled with where each row was found (io.rowlog.RowLog.hints), -1
        where none was."""
        def places(log):
            segs, slots, found = log.places(ids)
            if hints is not None:
                hints[:] = -1
                hints[found] = log.hints(segs, slots)
            return log.slot_bytes, log.offset[segs] + slots * log.slot_bytes, found

        def read(txn, got):
            width, offsets, found = got
            slots = np.empty((len(ids), width), dtype=np.uint8) if out is None else out
            if len(offsets):
                every = len(offsets) == len(ids)
                picked = slots if every else np.empty((len(offsets), width), dtype=np.uint8)
                self._read_at(txn, offsets, width, picked)
                if not every:
                    slots[found] = picked
            return slots, found
        return self._log_read(table, places, read)

    def _read_at(self, txn, offsets: np.ndarray, width: int, out: np.ndarray, packed: bool = False) -> None:
        """``width`` bytes at each file offset of ``offsets`` into ``out``, in ``txn``'s snapshot
        (LMDB reuses none of its pages while it is open): directly (io.direct) when worth it,
        else from the map, all pages asked for at once first. ``packed``: rows of a page at
        most packed many to a page (the live slots a collection copies), read directly each
        page once (DirectReader.read_packed), where a direct read reads a page for each row.
        Through the map, those reads took 14% of the write-back thread's time in the DLRM step
        of `tierstore bench scale` (34M rows, 0.5 GiB): process_madvise waiting on page-cache
        allocation and reclaim under the memory limit, then a fault a page; and they pushed
        pages of the index and of hot rows out of the page cache for rows copied once."""
        reader = self._shared.direct if self.reads_directly and len(offsets) >= _ADVISED_READ else None
        if reader is not None and not packed and reader.fits(width):
            reader.read(offsets, width, out)
            return
        if reader is not None and packed and width <= lmdb_map.PAGE and reader.fits(lmdb_map.PAGE):  # a row on two pages at most
            reader.read_packed(offsets, width, out)
            return
        _, base, size = self._map_base(txn)
        if len(offsets) >= _ADVISED_READ:
            lmdb_map.will_need(base, offsets, width)
        lmdb_map.gather(base, size, offsets, width, out)

    def _sync_log(self, table: str, txn) -> bool:
        """Bring ``table``'s index to ``txn``'s snapshot (under the index lock); False when
        the index already reflects a later commit than the snapshot. Another process's
        commits are replayed; a sequence number missing among them is a segment that came
        and went unseen (a dropped tombstone, maybe), and the index is rebuilt from all."""
        tid, synced = txn.id(), self._log_synced[table]
        if tid <= synced:
            return tid == synced
        log = self._logs[table]
        # a reader sees a published table as its last publish left it: segments up to the one
        # named; none it still needs is deleted before a later publish names the newer copies
        published = self._published_in(txn, table) if self._lock_fd is None else None
        if published is not None and published[0] == log.applied >= published[1]:  # nothing published since
            self._log_synced[table] = tid
            return True
        _, base, size = self._map_base(txn)
        mem = lmdb_map.map_view(base, size)
        record = txn.get(b"s:" + table.encode(), db=self._shared.main)
        upto = published[0] if published is not None else None
        try:
            newer = lmdb_map.walk_values(mem, record, log.applied, upto=upto)
            if published is not None:
                # segments that came and went unseen held only rows that newer segments hold, or are
                # tombstones: a merged one's ids are in the merge, a dropped one's are not (rebuild)
                stale = published[1] > log.applied
            else:  # a sequence number missing is a segment that came and went unseen, a dropped tombstone maybe
                seqs = [seq for seq, _, _ in newer]
                stale = seqs and seqs[-1] - seqs[0] + 1 != len(seqs) or seqs[:1] not in ([], [log.applied + 1])
            if stale:
                log = self._logs[table] = self._new_log(table, log.codec, log.num_rows, log.last_use)
                newer = lmdb_map.walk_values(mem, record, 0, upto=upto)
            log.replay(mem, newer)
        except rowlog.SegmentFormatError as e:
            raise self._damaged(table, e) from None
        if self._lock_fd is None:  # a reader: segments left behind are gone from its snapshots
            log.free_emptied()
        self._log_synced[table] = tid
        return True

    def _map_base(self, txn) -> tuple[int, int, int]:
        return self._shared.map_base(txn)

    def _write_log(self, segments: dict[str, list[tuple[np.ndarray, np.ndarray | None]]], meta: dict | None = None,
                   deleting: dict[str, list[int]] | None = None, dropping: dict[str, list[int]] | None = None,
                   known: dict[str, np.ndarray] | None = None, hints: dict[str, np.ndarray] | None = None) -> None:
        """Append segments (ids, slots or a function making them; tombstones where slots is None) to log tables, retire
        the segments ``deleting`` names (``dropping``: the tombstones among them no older copy
        of their ids outlives) and those left without a live row, then meta: one transaction;
        the index follows once it has committed. Retired segments go in the same transaction,
        or, for a publish_at_flush writer, with the next publish: readers of the last one may
        still read them. ``known``: by table, the place of each id of its segments before them
        (RowLog.apply); ``hints``: by table, where a read found each id of its segments
        (RowLog.hints, -1 for none), made known before the commit (RowLog.previous_places)."""
        known = dict(known or {})

        def previous(t, h):  # shared: lookups go on while the hints' live bits are read
            with self._index_lock.shared():
                return self._logs[t].previous_places(np.concatenate([ids for ids, _ in segments[t]]), h)

        def plan():
            out, gone = [], {}
            for t, h in (hints or {}).items():
                known[t] = self._rebuilt_on_damage(t, functools.partial(previous, t, h))
            for t in set(segments) | set(deleting or ()):
                log = self._logs[t]
                gone[t] = set(log.emptied) | set((deleting or {}).get(t, ()))
                seq = log.applied
                for ids, slots in segments.get(t, ()):
                    if len(ids):
                        seq += 1
                        out.append((t, seq, ids, slots))
                try:  # the index's room for them, taken before the commit (RowLog.reserve)
                    log.reserve(sum(1 for table, *_, slots in out if table == t and slots is not None))
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    raise disk_full(self.path, f"could not allocate the row index's live-slot bits of table {t!r} "
                                    f"beside {self.path}", e) from e
            return out, gone

        def op(txn, planned):
            new, gone = planned
            for t, seq, ids, slots in new:
                blob = rowlog.encode_segment(ids, slots() if callable(slots) else slots, self._logs[t].slot_bytes)
                txn.put(rowlog.seq_key(seq), blob, db=self._log_dbs[t], append=True)
            for t, seqs in gone.items() if not self.publish_at_flush else ():
                for seq in seqs:
                    txn.delete(rowlog.seq_key(seq), db=self._log_dbs[t])
            for k, v in (meta or {}).items():
                txn.put(k.encode(), json.dumps(v).encode(), db=self._meta)

        def applied(planned):
            new, gone = planned
            for t in {t for t, *_ in new}:
                self._logs[t].apply([(seq, rowlog.TOMBSTONES if slots is None else rowlog.ROWS, ids, -1)
                                     for table, seq, ids, slots in new if table == t],
                                    known=known.get(t))
            for t, seqs in gone.items():
                log = self._logs[t]
                for seq in seqs:
                    log.forget(seq)
                log.emptied = [q for q in log.emptied if q not in seqs]
                if self.publish_at_flush:
                    self._retired[t] |= seqs
                    self._dropped[t] = max([self._dropped[t], *(dropping or {}).get(t, ())])
            if any(slots is not None for *_, slots in new):
                # where the new segments' slots are in the file: their B-tree walked in a snapshot,
                # as a replay finds them (this process's own map never moves under it: only its
                # writer grows the map)
                with self._reading(buffers=True) as txn:
                    _, base, size = self._map_base(txn)
                    mem = lmdb_map.map_view(base, size)
                    for t in {t for t, *_ in new}:
                        first = min(seq for table, seq, *_ in new if table == t)
                        record = txn.get(b"s:" + t.encode(), db=self._shared.main)
                        for seq, at, _ in lmdb_map.walk_values(mem, record, first - 1):
                            self._logs[t].note_offset(seq, at)
        self._write(op, applied, plan, dirties=sum(len(ids) * self._logs[t].slot_bytes for t, parts in segments.items()
                                                   for ids, slots in parts if slots is not None))

    def _collect(self, table: str, written: int) -> None:
        """Clean ``table``'s log after ``written`` rows were appended (io.rowlog): copy the live
        slots of the segments most worth it (io.rowlog.RowLog.victims) into one new segment,
        drop tombstones no longer needed, merge the rest when they are many; one transaction."""
        with self._write_lock:
            self._rebuilt_on_damage(table, lambda: self._collect_locked(table, written))

    def _collect_locked(self, table: str, written: int) -> None:
        log = self._logs[table]
        # at most a write transaction's share of bytes copied: the copies are held read out and
        # as the transaction's dirty pages, outside the budget's parts for more than that (twice
        # the rows of a full write-back transaction, 67 MB each at 0.5 GiB, OOM-killed a trainer)
        victims = log.victims(written, max(1, self.txn_bytes // log.slot_bytes))
        dropped = log.droppable_tombstones()
        merged = sorted(set(log.tombstones) - set(dropped)) if len(log.tombstones) > rowlog.MAX_TOMBSTONE_SEGMENTS else []
        if not victims and not dropped and not merged:
            return
        with self._reading(db=self._log_dbs[table], buffers=True) as txn:
            still_deleted = []
            kept_ids, kept_places, kept_slots = self._live_slots(table, victims, txn)
            for seq in merged:
                ids = rowlog.parse_header(txn.get(rowlog.seq_key(seq)))[1]
                still_deleted.append(ids[log.index.get(ids) == rowlog.NONE])
        # where each id of the new segments was: its victim slot, found live above; a merged
        # tombstone's id, nowhere (the index held none). The index is not asked again
        parts, known = [], []
        if victims:
            order = np.argsort(kept_ids, kind="stable")
            ids = kept_ids[order]
            known.append(kept_places[order])
            # each segment's slots taken in id order only when it is written: not a second copy of all
            parts += [(ids[lo: lo + log.per_segment], functools.partial(kept_slots.take, order[lo: lo + log.per_segment], axis=0))
                      for lo in range(0, len(ids), log.per_segment)]
        if still_deleted:
            parts.append((np.unique(np.concatenate(still_deleted)), None))
            known.append(np.full(len(parts[-1][0]), rowlog.NONE, dtype=np.uint32))
        self._write_log({table: parts}, deleting={table: victims + dropped + merged}, dropping={table: dropped},
                        known={table: np.concatenate(known)} if known else None)

    def _damaged(self, table: str, e: rowlog.SegmentFormatError) -> Exception:
        return corrupt(self.path / "data.mdb", f"table {table!r} holds a damaged segment ({e})")

    def _live_slots(self, table: str, seqs: list[int], txn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, places, slots) of the live slots of ``table``'s row segments ``seqs``, in
        order, in ``txn``'s snapshot (what a collection copies and a sweep examines): each
        segment's header and ids read through the map, its live slots from the log's bits (no
        index lookup), their pages asked for all at once (not a fault a page); never txn.get,
        which faults in a whole 1 MiB value."""
        log = self._logs[table]
        _, base, size = self._map_base(txn)
        mem = lmdb_map.map_view(base, size)
        spans = np.array([log.id_span(seq) for seq in seqs], dtype=np.int64).reshape(-1, 3)
        lmdb_map.will_need(base, spans[:, 0], spans[:, 1])
        ids, at = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
        for seq, (start, length, first) in zip(seqs, spans.tolist()):
            try:
                ids.append(log.ids_at(seq, mem[start: start + length]))
            except rowlog.SegmentFormatError as e:
                raise self._damaged(table, e) from None
            at.append(first + np.arange(len(ids[-1]), dtype=np.int64) * log.slot_bytes)
        live = log.live_of(seqs)
        at = np.concatenate(at)[live]
        slots = np.empty((len(at), log.slot_bytes), dtype=np.uint8)
        self._read_at(txn, at, log.slot_bytes, slots, packed=True)
        places = log.slot_places(seqs)[live] if seqs else np.zeros(0, dtype=np.uint32)
        return np.concatenate(ids)[live], places, slots

    def _log_sweep(self, table: str, cutoff: int | None, budget: int, l2_below: float | None) -> int:
        """sweep() of a log table: the live rows of its next segments, ``budget`` slots or so."""
        with self._write_lock:
            return self._rebuilt_on_damage(table,
                                           lambda: self._log_sweep_locked(table, cutoff, budget, l2_below))

    def _log_sweep_locked(self, table: str, cutoff: int | None, budget: int, l2_below: float | None) -> int:
        log, db, codec = self._logs[table], self._log_dbs[table], self._codecs[table]
        used = np.flatnonzero(log.seq > 0)
        used = used[np.argsort(log.seq[used])]
        used = used[log.seq[used] >= int(self._sweep_from.get(table, 0) or 0)]
        reach = np.cumsum(log.slots[used])  # the next segments, until budget slots are examined
        chosen = log.seq[used[: int(np.searchsorted(reach, budget)) + 1]].tolist()
        with self._reading(db=db, buffers=True) as txn:
            ids, _, slots = self._live_slots(table, chosen, txn)
        gone = np.zeros(len(ids), dtype=bool)
        if log.last_use and cutoff is not None:
            gone |= np.ascontiguousarray(slots[:, codec.row_bytes:]).view(STEP).ravel() <= cutoff
        if l2_below is not None:
            gone |= row_norms_sq(codec.unpack(slots[:, : codec.row_bytes])[:, : codec.dim]) < l2_below ** 2
        examined = int(reach[len(chosen) - 1]) if chosen else 0
        self._sweep_from[table] = chosen[-1] + 1 if examined >= budget else 0
        doomed = np.sort(ids[gone])
        return self.delete_rows(table, doomed) if len(doomed) else 0
