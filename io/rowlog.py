"""A bounded table's rows as a log of segments in LMDB.

Why: stored one row per key, a random row written costs LMDB a copy of its whole
4 KiB leaf page and of the branch pages above it (13-23x the bytes of a 256-byte row
at scale), and a row read faults a branch page as well when the page cache is small.
Here a write appends the rows it writes, packed, as one LMDB value, a *segment*, which
LMDB stores in contiguous overflow pages: a transaction writes about its rows' own
bytes. Where each row lives (segment, slot) is kept in memory (io.rowindex), and
rebuilt at open from the segments' id lists; the segments' own B-tree is a few pages.
Rows start on a page boundary of the file, so a row read touches its own page only.

A segment: a 16-byte header (magic, kind, count, slot bytes), the ids (int64), and for
rows, padding to a page boundary, then one slot per id: the row's encoded bytes, and its
last-use step (int64) where the table keeps one. A *tombstone* segment has ids only: those
rows are deleted. Segments are keyed by a sequence number that only grows, so the latest
copy of a row is the one in the highest segment: replaying segments in key order gives
the index, in any process and after any crash (a segment is in LMDB exactly when its
transaction committed). Where each row is, is kept by io.rowindex: runs of ids in
consecutive slots, memory that grows with the rows written, not the ids declared.

Space: overwritten rows leave dead slots; a collection copies the live rows of the segments
most worth cleaning (how empty, and how long its rows have stayed: RowLog._worth) into a new
one and deletes them, in one transaction, once dead slots pass its spare room (SPARE of the
live ones by default). A tombstone is dropped once every row segment is newer than it (no
older copy of its ids is left to resurrect).

This module knows LMDB's value layout and nothing of the store; io.lmdb_backend calls it
inside its transactions and under its locks.
"""
from __future__ import annotations

import copy
import struct
from array import array
from pathlib import Path

import numpy as np

from . import rowindex, rowindex_file
from .rowindex import dense_bytes, mapped_bytes_bound  # noqa: F401  (what a table's index holds besides its runs: tierstore.engine.memory)
from .codecs import RowCodec
from .liveslots import LiveSlots
from .lmdb_map import PAGE, VALUE_OFFSET
from .errors import SegmentFormatError, SegmentLimitError
from .rowindex import NONE, SLOT_BITS as _SLOT_BITS, RowIndex

# A segment's slots, in bytes: big enough that a write is sequential, small enough that LMDB
# finds room for it. LMDB keeps a segment in contiguous pages; each write transaction reloads its
# free list from the oldest record, merging until it finds a run long enough, and a run a
# single page was taken from no longer holds a segment of the size that freed it. At 1 MiB
# (257 pages) the `tierstore bench scale` table, aged by 123 runs, kept 268k free pages in runs
# of 2-256 (read from its free database), reloaded by every transaction: 36% of the write-back's
# CPU in mdb_page_alloc and mdb_midl_xmerge (perf, 1 GiB, depth 4).
SEGMENT_BYTES = 64 << 10
MIN_SEGMENT_ROWS = 256  # fewer and the segments' own bookkeeping (SEGMENT_ENTRY_BYTES) outgrows a byte a row
SPARE = 0.5  # dead slots kept at most, as a fraction of live rows, before a collection (RowLog.victims): the default
MAX_SLOTS = 1 << _SLOT_BITS
_MAX_SEGMENTS = (1 << (32 - _SLOT_BITS)) - 1  # the last one would make NONE a place
# The most a segment entry of a RowLog takes in memory (its live bits are the page cache's): its
# seq and file offset (8 bytes each), live and slots counts (4 each), a place in the free or held
# stack (4), its SeqMap entry (12, with a quarter to spare: 15), and the copies of seq and offset a
# commit makes while a lookup's view holds them (16). Counted at 32 (the four of them as int64,
# nothing else), an index held 46% more than it reported (tests/test_rowlog.py, tracemalloc).
SEGMENT_ENTRY_BYTES = 8 + 8 + 4 + 4 + 4 + 15 + 16
HEADER = struct.Struct("<4sB3xII")  # magic, kind, ids, slot bytes
_MAGIC = b"TSG1"
ROWS, TOMBSTONES = 0, 1
# A row segment is at least this long: LMDB keeps a value of more than about half a page in
# overflow pages of its own, which stay where they are until the value is rewritten; a
# smaller one lives in a B-tree leaf, and moves whenever another key of that leaf changes
# (the index caches where each segment's slots are in the file)
MIN_SEGMENT = PAGE // 2
_STEP = np.dtype("<i8")
_PLACE_MASK = (1 << 32) - 1  # a place in a hint (RowLog.hints)
_HINT_SEQ = (1 << 31) - 1  # the bits of its segment's seq a hint keeps above the place: a hint is never negative
_MIN_DEAD = MAX_SLOTS  # dead slots below this never trigger a collection
MAX_TOMBSTONE_SEGMENTS = 16  # more are merged into one
_REPLAY_SEGMENTS = 64  # segments a replay applies at once (RowLog.apply)
# A writer saves its index once the rows applied since it was last saved pass this, and an
# eighth of the runs a save writes from memory: recovery after kill -9 replays no more, and saves
# write at most 8 runs (128 bytes) a row written, and less as the spilled levels take the runs.
# Saved only at close, an index held in memory replayed every row written since at the next
# open (1M random rows: 1.1 s).
SAVE_ROWS = 1 << 18
_SAVED_RUNS_A_ROW = 8
# ... and, for the segments' bookkeeping a save writes whole (each segment's entry and its slots'
# live bits), at most this many bytes a row applied since. The 200M x 16 table's 40 MB of it,
# saved every SAVE_ROWS rows, was 150 bytes a row written and took a third of its write-back's
# time (`tierstore bench scale`, 256 MiB). A spill between saves writes its runs alone
# (write_index(..., saved=False)), named by the next save as one of its levels.
_SAVED_BYTES_A_ROW = 32


_ENTRY = "i"  # a segment index in the free and held stacks (array's typecode: below _MAX_SEGMENTS)
_ENTRY_BYTES = array(_ENTRY).itemsize


def _entries(values: np.ndarray) -> array:
    """Segment indexes as a stack (array(_ENTRY)), 4 bytes each."""
    return array(_ENTRY, np.asarray(values, dtype=np.dtype(_ENTRY)).tobytes())


def rows_per_segment(slot_bytes: int, num_rows: int) -> int:
    """Slots of a full segment: SEGMENT_BYTES of them, at least MIN_SEGMENT_ROWS, and enough
    that the table's rows fill at most half the segment numbers the index can name (dead
    slots and partly filled segments take the rest)."""
    fit = -(-2 * num_rows // _MAX_SEGMENTS)
    return min(MAX_SLOTS, max(SEGMENT_BYTES // slot_bytes, MIN_SEGMENT_ROWS, fit))


def segment_bytes_bound(num_rows: int, slot_bytes: int) -> int:
    """The most the segments' entries of a RowLog of ``num_rows`` rows of ``slot_bytes`` take:
    victims() keeps the segments under twice the full ones needed plus 16 (64 more: room for
    what a collection has yet to merge), and reserve grows the entries by a quarter when none is
    free, from 64, never past _MAX_SEGMENTS. (Entries of segments a recovery found gone wait in
    ``_held`` until the next spill merges the levels naming them.)"""
    in_use = 2 * -(-num_rows // rows_per_segment(slot_bytes, num_rows)) + 16 + 64
    return SEGMENT_ENTRY_BYTES * min(_MAX_SEGMENTS, in_use + in_use // 4 + 64)


def runs_bytes_bound(num_rows: int) -> int:
    """The most an unlimited io.rowindex of ``num_rows`` rows holds: each level at most a run
    a row, and a merge's copies (RowIndex._settles: three of main, two of recent)."""
    return 5 * rowindex.RUN_BYTES * num_rows


def index_bytes_bound(num_rows: int, slot_bytes: int) -> int:
    """The most a RowLog of ``num_rows`` rows of ``slot_bytes`` holds in memory without a
    limit: its segments' entries and its runs."""
    return segment_bytes_bound(num_rows, slot_bytes) + runs_bytes_bound(num_rows)


def seq_key(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _rows_offset(n: int, slot_bytes: int) -> int:
    """Where a segment of ``n`` slots puts its first slot: on a page boundary of the file
    when the slots fill a page or more (a slot then spans as few pages as it can)."""
    end = HEADER.size + 8 * n
    if n * slot_bytes < PAGE:
        return end
    return -(-(end + VALUE_OFFSET) // PAGE) * PAGE - VALUE_OFFSET


def encode_segment(ids: np.ndarray, slots: np.ndarray | None, slot_bytes: int) -> np.ndarray:
    """A segment of ``ids`` and their ``slots`` (uint8 [n, slot_bytes]); tombstones when ``slots``
    is None. As uint8, which LMDB takes as it is: a bytes copy was another 1 MiB a segment."""
    n = len(ids)
    if slots is None:
        out = np.empty(HEADER.size + 8 * n, dtype=np.uint8)
        kind = TOMBSTONES
    else:
        start = _rows_offset(n, slot_bytes)
        end = start + n * slot_bytes
        out = np.zeros(max(end, MIN_SEGMENT), dtype=np.uint8)
        out[start:end].reshape(n, slot_bytes)[:] = slots
        kind = ROWS
    out[: HEADER.size] = np.frombuffer(HEADER.pack(_MAGIC, kind, n, slot_bytes), dtype=np.uint8)
    out[HEADER.size: HEADER.size + 8 * n] = np.ascontiguousarray(ids, dtype="<i8").view(np.uint8)
    return out


def parse_header(value) -> tuple[int, np.ndarray, int]:
    """(kind, ids, offset of the first slot) of a segment ``value`` (a buffer)."""
    if len(value) < HEADER.size:
        raise SegmentFormatError(f"a segment of {len(value)} bytes, shorter than its header")
    magic, kind, n, slot_bytes = HEADER.unpack_from(value)
    start = _rows_offset(n, slot_bytes)
    need = HEADER.size + 8 * n if kind == TOMBSTONES else max(start + n * slot_bytes, MIN_SEGMENT)
    if magic != _MAGIC or kind not in (ROWS, TOMBSTONES) or len(value) != need:
        raise SegmentFormatError(f"a segment with header {bytes(value[:HEADER.size])!r} and {len(value)} bytes")
    return kind, np.frombuffer(value, dtype="<i8", count=n, offset=HEADER.size), start


class SeqMap:
    """Segment index by sequence number, for sequence numbers added in increasing order (as
    segments are applied): two sorted arrays, 16 bytes an entry, an entry forgotten marked and
    dropped when they grow. A dict of them took ~100 bytes an entry: 27 MiB for the 290k
    segments of the 200M x 16 table, aged by training, beside its 16 MiB share of the budget."""

    def __init__(self, seqs: np.ndarray = np.zeros(0, dtype=np.int64), entries: np.ndarray = np.zeros(0, dtype=np.int64)):
        """Mapping ``seqs`` (distinct) to ``entries`` (segment indexes: below 2**31)."""
        order = np.argsort(seqs)
        self._seqs, self._entries = np.asarray(seqs, dtype=np.int64)[order], np.asarray(entries, dtype=np.int32)[order]
        self._n = self._live = len(order)

    @property
    def nbytes(self) -> int:
        return self._seqs.nbytes + self._entries.nbytes

    def __len__(self) -> int:
        return self._live

    def __iter__(self):
        return iter(self.seqs().tolist())

    def _at(self, seqs: np.ndarray) -> np.ndarray:
        """Each seq's position in the arrays, -1 where it is not mapped."""
        at = np.searchsorted(self._seqs[:self._n], seqs)
        inside = at < self._n
        found = np.zeros(len(at), dtype=bool)
        found[inside] = (self._seqs[at[inside]] == seqs[inside]) & (self._entries[at[inside]] >= 0)
        return np.where(found, at, -1)

    def get(self, seq: int, default: int | None = None) -> int | None:
        at = int(self._at(np.array([seq], dtype=np.int64))[0])
        return default if at < 0 else int(self._entries[at])

    def __contains__(self, seq: int) -> bool:
        return self.get(seq) is not None

    def __getitem__(self, seq: int) -> int:
        s = self.get(seq)
        if s is None:
            raise KeyError(seq)
        return s

    def many(self, seqs) -> np.ndarray:
        """The segment index of each of ``seqs`` (every one mapped: KeyError where not)."""
        at = self._at(np.asarray(seqs, dtype=np.int64).reshape(-1))
        if (at < 0).any():
            raise KeyError(int(np.asarray(seqs).reshape(-1)[np.argmax(at < 0)]))
        return self._entries[at]

    def add(self, seq: int, s: int) -> None:
        """Map ``seq``, newer than every seq added before, to segment index ``s``."""
        if self._n and seq <= self._seqs[self._n - 1]:
            raise ValueError(f"segment {seq} added after segment {int(self._seqs[self._n - 1])}: seqs are added in increasing order")
        if self._n == len(self._seqs):
            kept = self._entries[:self._n] >= 0
            size = max(64, self._live + self._live // 4 + 1)  # SEGMENT_ENTRY_BYTES counts a quarter to spare
            seqs, entries = np.zeros(size, dtype=np.int64), np.full(size, -1, dtype=np.int32)
            seqs[:self._live], entries[:self._live] = self._seqs[:self._n][kept], self._entries[:self._n][kept]
            self._seqs, self._entries, self._n = seqs, entries, self._live
        self._seqs[self._n], self._entries[self._n] = seq, s
        self._n += 1
        self._live += 1

    def pop(self, seq: int, default: int | None = None) -> int | None:
        at = int(self._at(np.array([seq], dtype=np.int64))[0])
        if at < 0:
            return default
        s, self._entries[at] = int(self._entries[at]), -1
        self._live -= 1
        return s

    def seqs(self) -> np.ndarray:
        """The mapped seqs, in increasing order."""
        return self._seqs[:self._n][self._entries[:self._n] >= 0]

    def entries(self) -> np.ndarray:
        """Their segment indexes, in the same order."""
        return self._entries[:self._n][self._entries[:self._n] >= 0]

    def items(self):
        """(seq, segment index) pairs, as a dict's."""
        return zip(self.seqs().tolist(), self.entries().tolist())


class RowLog:
    """The in-memory index of one table's segments: for each id, its segment's slot in
    this index (``index``, io.rowindex: segment index << 12 | slot, NONE where no row is
    stored), and for each segment its sequence number, live rows, place in the file, and
    which of its slots are live (``bits``, io.liveslots: what a collection copies).
    Its own methods never touch LMDB: the backend hands them values and commits.
    ``runs_limit``: the bytes its runs may hold (RowIndex.limit); ``hold``: the bytes of a
    dense level it may hold in memory (RowIndex.hold); ``folder``: where the bits' file goes
    (None: the temporary directory); ``spare``: the dead slots it keeps at most, as a fraction
    of its live rows (None: SPARE), before a collection copies rows to reclaim them."""

    def __init__(self, codec: RowCodec, num_rows: int, last_use: bool, runs_limit: int | None = None,
                 folder: Path | None = None, hold: int = 0, spare: float | None = None):
        self.codec = codec
        self.spare = SPARE if spare is None else spare
        self.last_use = last_use
        self.num_rows = num_rows
        self.slot_bytes = codec.row_bytes + (_STEP.itemsize if last_use else 0)
        self.per_segment = rows_per_segment(self.slot_bytes, num_rows)
        self.index = RowIndex(num_rows, runs_limit, hold)
        self.on_spill = None  # spills the index (RowIndex.wants_spill) during a replay
        self.unsaved = 0  # rows applied since the index was last saved (wants_save)
        # segment indexes: those a mapped index still names (RowIndex.held), and the free ones (a stack); arrays,
        # 4 bytes an entry where a list's ints took 36 (7 MiB of the 200M x 16 table's 232k free entries)
        self._held = array(_ENTRY)
        self.seq = np.zeros(0, dtype=np.int64)  # 0: a free entry
        self.live = np.zeros(0, dtype=np.int32)  # at most MAX_SLOTS: 4 bytes an entry (SEGMENT_ENTRY_BYTES)
        self.slots = np.zeros(0, dtype=np.int32)
        self.offset = np.zeros(0, dtype=np.int64)  # file offset of the first slot; -1 until read
        self.bits = LiveSlots(self.per_segment, _MAX_SEGMENTS, folder)  # by segment index
        self._free = array(_ENTRY)
        self._viewed = False  # a view (view()) may hold seq and offset as they are: copied before an entry is reused
        self._index = SeqMap()  # seq -> segment index
        self.tombstones: dict[int, int] = {}  # seq -> ids
        self.applied = 0  # the highest sequence number applied
        self.live_rows = 0
        self.emptied: list[int] = []  # seqs of segments whose rows are all dead, not yet deleted

    @property
    def dead_slots(self) -> int:
        return int(self.slots.sum()) - self.live_rows

    def wants_save(self) -> bool:
        """Whether a writer's index is to be saved (asked of a writer's only): more rows applied
        since it was last saved than SAVE_ROWS, than an eighth of the runs memory holds and
        than the bookkeeping's bytes over _SAVED_BYTES_A_ROW (what a save writes)."""
        held = len(self.index.main) + len(self.index.recent)
        return self.unsaved >= max(SAVE_ROWS, held // _SAVED_RUNS_A_ROW, self.bookkeeping_bytes() // _SAVED_BYTES_A_ROW)

    def bookkeeping_bytes(self) -> int:
        """The bytes of the segments' bookkeeping a save writes (write_index: seq, live and slots as int64)."""
        return len(self.seq) * (3 * 8 + self.bits.rows.shape[1])

    def segment_bytes(self) -> int:
        """What the segments' entries take in memory now (at most segment_bytes_bound: SEGMENT_ENTRY_BYTES
        an entry); the copies a view holds (view()) are not seen here."""
        entries = sum(a.nbytes for a in (self.seq, self.live, self.slots, self.offset))
        return entries + self._index.nbytes + _ENTRY_BYTES * (len(self._free) + len(self._held))

    def index_bytes(self) -> int:
        return self.index.nbytes + self.segment_bytes()

    # -- applying segments (in sequence order) -----------------------------------------
    def reserve(self, segments: int) -> None:
        """Room for ``segments`` more row segments, made before the transaction that writes them
        commits: the live bits' disk is taken here (io.liveslots.LiveSlots.reserve), so that a
        full disk fails the write (OSError ENOSPC), never the index update after its commit."""
        if not self._free and self._held and self.index.dead is None:  # no mapped index names them now
            self._free, self._held = self._held[::-1], array(_ENTRY)
        if len(self._free) < segments:
            old = len(self.seq)
            if old >= _MAX_SEGMENTS:
                raise SegmentLimitError(f"a table reached {_MAX_SEGMENTS:,} segments; compact the store (tierstore compact)")
            # by a quarter: every entry is written (np.full), so charged, and doubling left 44% of the aged
            # 200M x 16 table's 524k entries free (8 MiB)
            new = min(_MAX_SEGMENTS, max(64, old + old // 4, old + segments))
            self.bits.reserve(new)
            for name, fill in (("seq", 0), ("live", 0), ("slots", 0), ("offset", -1)):
                grown = np.full(new, fill, dtype=getattr(self, name).dtype)
                grown[:old] = getattr(self, name)
                setattr(self, name, grown)
            self._free = _entries(np.arange(new - 1, old - 1, -1)) + self._free

    def _allocate(self, seq: int, n: int) -> int:
        self.reserve(1)  # a replay's: a writer's commits reserve first
        self.bits.widen(n, len(self.seq))  # a segment written under an older SEGMENT_BYTES may have more slots
        s = self._free.pop()
        if self._viewed:  # a lookup's view may still place rows in the segment this entry held
            self.seq, self.offset, self._viewed = self.seq.copy(), self.offset.copy(), False
        self.seq[s], self.live[s], self.slots[s], self.offset[s] = seq, 0, n, -1
        self.bits.reset(s, n)
        self._index.add(seq, s)
        return s

    def _release(self, places: np.ndarray) -> None:
        """Drop the rows at ``places`` (their ids were overwritten or deleted)."""
        places = places[places != NONE]
        if not len(places):
            return
        # over the segments named only: a pass over every segment (bincount) for each segment
        # applied took a fifth of the write-back's CPU with 64 KiB segments
        segs, counts = np.unique(places >> _SLOT_BITS, return_counts=True)
        self.live[segs] -= counts
        self.bits.clear((places >> _SLOT_BITS).astype(np.int64), (places & (MAX_SLOTS - 1)).astype(np.int64))
        self.live_rows -= len(places)
        self.emptied.extend(self.seq[segs[self.live[segs] == 0]].tolist())

    def apply(self, segments: list[tuple[int, int, np.ndarray, int]], known: np.ndarray | None = None) -> None:
        """Apply ``segments`` ((seq, kind, ids, file offset of the first slot or -1), in sequence
        order, each newer than every one applied): one update of the index for all of them
        (it costs about its own runs, and a little for the runs it meets: see io.rowindex).
        ``known``: the place of each of their ids (all of them, in order) before them, where
        the caller found it under the same write lock (a collection's copies: the slots it
        found live; a write's rows: previous_places), so that the index is not asked again:
        in a mapped level that is a page read from disk a row."""
        if not segments:
            return
        all_ids, all_places = [], []
        for seq, kind, ids, offset in segments:
            if kind == TOMBSTONES:
                self.tombstones[seq] = len(ids)
                all_places.append(np.full(len(ids), NONE, dtype=np.uint32))
            else:
                s = self._allocate(seq, len(ids))
                self.live[s], self.offset[s] = len(ids), offset  # every slot live (_allocate's bits)
                self.live_rows += len(ids)
                if not len(ids):
                    self.emptied.append(seq)
                all_places.append((s << _SLOT_BITS) | np.arange(len(ids), dtype=np.uint32))
            all_ids.append(ids)
            self.applied = seq
        ids, places = np.concatenate(all_ids).astype(np.int64), np.concatenate(all_places)
        self.unsaved += len(ids)
        order = np.argsort(ids, kind="stable")  # an id's places in segment order
        ids, places = ids[order], places[order]
        first = np.ones(len(ids), dtype=bool)
        first[1:] = ids[1:] != ids[:-1]
        last = np.append(first[1:], True)
        previous = np.empty(len(ids), dtype=np.uint32)  # where each place's row was before it
        if known is not None:
            previous[first] = np.asarray(known, dtype=np.uint32)[order][first]
        else:
            previous[first] = self.index.get(ids[first])
        previous[~first] = places[:-1][~first[1:]]
        self._release(previous)
        self.index.put(ids[last], places[last])

    def note_offset(self, seq: int, at: int) -> None:
        """Segment ``seq`` (committed, its value at file offset ``at``) starts its slots where its
        slot count puts them; a tombstone has none. Its header is not read: a read through the
        map maps the pages around it too (the kernel's fault-around), a whole new segment."""
        s = self._index.get(seq)
        if s is not None:
            self.offset[s] = at + _rows_offset(int(self.slots[s]), self.slot_bytes)

    def forget(self, seq: int) -> None:
        """Segment ``seq`` was deleted (it held no live row, or it was a tombstone)."""
        self.tombstones.pop(seq, None)
        s = self._index.pop(seq, None)
        if s is not None:
            self.seq[s], self.slots[s], self.live[s] = 0, 0, 0
            self.bits.reset(s, 0)
            self._free.append(s)

    def adopt(self, values: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """A loaded index (load_index) meets the segments ``values`` ((seq, file offset, bytes)
        of every segment now, in seq order): those it knows get their place in the file,
        those gone since it was saved are forgotten (rows still placed in one were deleted by
        a tombstone since dropped), and the newer ones are returned, to be replayed."""
        present = {seq for seq, _, _ in values}
        for seq, at, size in values:
            s = self._index.get(seq)
            if s is not None:  # not read: its size, from the B-tree, must be what its slots make
                n = int(self.slots[s])
                start = _rows_offset(n, self.slot_bytes)
                if size != max(start + n * self.slot_bytes, MIN_SEGMENT):
                    raise SegmentFormatError(f"segment {seq} has {size} bytes, not the {n} slots the saved index knows")
                self.offset[s] = at + start
        known = self._index.seqs()
        lost = ~np.isin(known, np.fromiter(present, dtype=np.int64, count=len(present)))
        if lost.any():
            dead = np.zeros(len(self.seq), dtype=bool)
            dead[self._index.entries()[lost]] = True
            self.index.drop(dead)
        for seq in known[lost].tolist() + [t for t in self.tombstones if t not in present]:
            self.forget(seq)
        held = np.asarray(self.index.held(), dtype=np.int64)  # ascending
        self._held = _entries(held)
        free = np.frombuffer(self._free, dtype=_ENTRY)
        self._free = _entries(free[~np.isin(free, held)])
        self.live_rows = int(self.live[self.seq > 0].sum())
        self.emptied = [seq for seq in self.emptied if seq in present]
        return [v for v in values if v[0] > self.applied]

    def free_emptied(self) -> None:
        """A reader's index: segments whose rows all moved on are forgotten at once, and
        tombstones are not tracked (it never collects)."""
        for seq in self.emptied:
            self.forget(seq)
        self.emptied.clear()
        self.tombstones.clear()

    def replay(self, mem: np.ndarray, values: list[tuple[int, int, int]]) -> None:
        """Apply the segments ``values`` ((seq, file offset, bytes), in seq order) of the map
        ``mem``: _REPLAY_SEGMENTS at once, fewer where their rows' runs could pass a quarter of
        the index's limit; the index spills between, and before a batch that would take it past its
        limit, so that a replay of any length holds at most about three quarters of the limit,
        or half of it and one segment's runs."""
        most = None if self.index.limit is None else self.index.limit // (4 * rowindex.RUN_BYTES)
        segments, rows = [], 0
        for i, (seq, at, size) in enumerate(values):
            kind, ids, start = parse_header(mem[at: at + size])
            segments.append((seq, kind, ids, at + start))
            rows += len(ids)
            if len(segments) == _REPLAY_SEGMENTS or i + 1 == len(values) or most is not None and rows + self.per_segment > most:
                if (most is not None and self.on_spill is not None and len(self.index.main) + len(self.index.recent)
                        and self.index.nbytes + rows * rowindex.RUN_BYTES > self.index.limit):
                    self.on_spill(self)  # first: a segment of many rows would take the runs past the limit
                self.apply(segments)
                segments, rows = [], 0
                if self.on_spill is not None and self.index.wants_spill():
                    self.on_spill(self)

    # -- reading ---------------------------------------------------------------------------
    def view(self) -> "RowLog | None":
        """What a lookup reads (places, hints, index.get and ids) as it is now, for a lookup
        that runs while commits go on: taken under the index lock, used without it. A commit
        replaces the index's runs and levels rather than writing into them, and copies seq and
        offset before it gives a freed entry to a new segment, so a view keeps placing rows
        where its snapshot has them (LMDB keeps that snapshot's pages while its reader is
        open); the hints of a segment forgotten since are not valid (valid_hints). None where
        the index holds a dense level in memory: commits write into that one
        (RowIndex.current), and lookups, which then find places in memory, hold the lock. Under the
        lock, the write-back's commits waited for lookups reading index pages from disk (54% of
        its samples: py-spy, `tierstore bench scale`'s 200M x 16 table under 256 MiB, its DLRM
        step)."""
        if any(rowindex.in_memory(level) for level in self.index.levels):
            return None
        view = copy.copy(self)
        view.index = copy.copy(self.index)
        self._viewed = True
        return view

    def places(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(segment index, slot, found) of each id; the caller holds the index still, or this is a view."""
        loc = self.index.get(ids)
        found = loc != NONE
        loc = loc[found]
        return (loc >> _SLOT_BITS).astype(np.int64), (loc & (MAX_SLOTS - 1)).astype(np.int64), found

    def hints(self, segs: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Where rows were found (places() of them), as hints a later write of the same rows
        hands back (apply): the place, and the low 31 bits of its segment's sequence number,
        which tell the segment from a later one that takes its entry (int64, never negative)."""
        return ((self.seq[segs] & _HINT_SEQ) << 32) | (segs << _SLOT_BITS) | slots

    def previous_places(self, ids: np.ndarray, hints: np.ndarray) -> np.ndarray:
        """Where the rows of ``ids`` are before a write of them (uint32, NONE: nowhere), for
        apply's ``known``: a hint still valid (valid_hints) where a read left one (``hints``,
        -1 for none), the index's place otherwise. Asked before the write commits, under the
        write lock: checking the hints reads the live bits' pages, which the page cache may
        have dropped, and after the commit the writer holds the index lock alone, holding
        up every lookup (23% of the write-back's samples there: py-spy,
        `tierstore bench scale`'s 200M x 16 table under 256 MiB, its DLRM step)."""
        hints = np.asarray(hints, dtype=np.int64)
        valid = self.valid_hints(hints)
        out = np.empty(len(hints), dtype=np.uint32)
        out[valid] = hints[valid] & _PLACE_MASK
        out[~valid] = self.index.get(np.asarray(ids, dtype=np.int64)[~valid])
        return out

    def valid_hints(self, hints: np.ndarray) -> np.ndarray:
        """Mask of the ``hints`` (int64, -1 for none) that are still their row's place: the
        segment they name is still the one it was (its sequence number) and the slot still
        holds its id's latest row (its live bit; a slot once dead is never live again, and a
        slot holds one id for good). So a hint gone stale (the row written, moved by a
        collection, deleted since) is known as such, and costs an index lookup, never a row."""
        place = hints & _PLACE_MASK
        segs, slots = place >> _SLOT_BITS, place & (MAX_SLOTS - 1)
        ok = (hints >= 0) & (segs < len(self.seq))
        seq = self.seq[segs[ok]]
        ok[ok] = (seq > 0) & ((seq & _HINT_SEQ) == hints[ok] >> 32)
        ok[ok] = self.bits.live_at(segs[ok], slots[ok])
        return ok

    # -- writing ---------------------------------------------------------------------------
    def slots_of(self, rows: np.ndarray, steps: np.ndarray | None) -> np.ndarray:
        packed = self.codec.pack(rows)
        if not self.last_use:
            return packed
        slots = np.empty((len(rows), self.slot_bytes), dtype=np.uint8)
        slots[:, : self.codec.row_bytes] = packed
        slots[:, self.codec.row_bytes:] = np.ascontiguousarray(steps, dtype=_STEP).view(np.uint8).reshape(-1, 8)
        return slots

    def victims(self, written: int, most: int | None = None) -> list[int]:
        """Seqs of the row segments to clean now, the most worth it first (_worth): enough to
        bring dead slots under ``spare`` of the live rows, copying at most about twice the rows
        just written (a write never waits on a whole cleanup) and at most ``most`` rows (the
        collection holds them in memory and as its transaction's dirty pages), or to merge
        segments a few rows each."""
        used = np.flatnonzero(self.seq > 0)
        if not len(used):
            return []
        over = self.dead_slots - max(_MIN_DEAD, int(self.spare * self.live_rows))
        too_many = len(used) - (2 * (-(-self.live_rows // self.per_segment)) + 16)
        if over <= 0 and too_many <= 0:
            return []
        budget = max(2 * written if most is None else min(2 * written, most), self.per_segment)
        worth = self._worth(used)
        # the loop below stops within the budget + (emptied) + 1 most worth it: sorting only those
        # takes 3 ms where sorting 210k segments took 32
        k = min(len(used), budget + int(np.count_nonzero(self.live[used] == 0)) + 1)
        first = np.argpartition(-worth, k - 1)[:k] if k < len(used) else np.arange(len(used))
        order = used[first[np.argsort(-worth[first], kind="stable")]]
        chosen, copied, freed, merged = [], 0, 0, 0
        for s in order.tolist():
            if (freed >= over and merged >= too_many) or copied + self.live[s] > budget:
                break
            chosen.append(int(self.seq[s]))
            copied += int(self.live[s])
            freed += int(self.slots[s] - self.live[s])
            merged += 1
        return chosen if len(chosen) > 1 or freed > 0 else []

    def _worth(self, segs: np.ndarray) -> np.ndarray:
        """What cleaning each segment of ``segs`` is worth (LFS's cost-benefit): the slots it
        frees, weighed by the age of its rows (rows that have stayed long are likely to stay:
        copied once, they fill their new segment for good), per slot read and written
        (1 + its live fraction); an emptied segment first (it costs nothing). Cleaning the
        emptiest first instead waits on segments whose rows are rewritten soon anyway and copies
        cold rows from segments barely emptier than the rest: 0.91 rows copied a row written
        against 0.77 (a log of 3.4M rows under the writes a 42k-row LRU cache evicts of a
        Zipf 1.05 stream, spare 0.5, steady state)."""
        live = self.live[segs]
        u = live / np.maximum(self.slots[segs], 1)
        age = (self.applied + 1 - self.seq[segs]).astype(np.float64)
        return np.where(live == 0, np.inf, (1 - u) * age / (1 + u))

    def id_span(self, seq: int) -> tuple[int, int, int]:
        """(file offset, bytes) of row segment ``seq``'s header and ids, and the file offset of
        its first slot, for a writer's index (which knows every segment's place). A collection
        reads these, never the whole value."""
        s = self._index[seq]
        if self.offset[s] < 0:
            raise RuntimeError(f"the index does not know where segment {seq} is; a writer's index knows every place")
        n, first = int(self.slots[s]), int(self.offset[s])
        return first - _rows_offset(n, self.slot_bytes), HEADER.size + 8 * n, first

    def ids_at(self, seq: int, head) -> np.ndarray:
        """The ids of row segment ``seq`` from ``head``, the bytes id_span named; checked
        against its header, so that a place gone stale is damage named, never rows copied
        from elsewhere."""
        n = int(self.slots[self._index[seq]])
        if len(head) != HEADER.size + 8 * n or HEADER.unpack_from(head) != (_MAGIC, ROWS, n, self.slot_bytes):
            raise SegmentFormatError(f"segment {seq} is not where the index places it (header {bytes(head[:HEADER.size])!r})")
        return np.frombuffer(head, dtype="<i8", count=n, offset=HEADER.size)

    def live_of(self, seqs: list[int]) -> np.ndarray:
        """Mask of the slots of row segments ``seqs`` (each one's in order, concatenated) that
        hold their id's latest row: read from their bits, no index lookup."""
        if not seqs:
            return np.zeros(0, dtype=bool)
        s = self._index.many(seqs)
        return self.bits.live(s, self.slots[s])

    def slot_places(self, seqs: list[int]) -> np.ndarray:
        """The places of every slot of row segments ``seqs``, concatenated (in live_of's order)."""
        s = self._index.many(seqs).tolist()
        return np.concatenate([(i << _SLOT_BITS) | np.arange(self.slots[i], dtype=np.uint32) for i in s])

    def droppable_tombstones(self) -> list[int]:
        """Tombstones older than every row segment: no older copy of their ids is left."""
        rows = self.seq[self.seq > 0]
        oldest = int(rows.min()) if len(rows) else self.applied
        # never the newest segment: a reader that finds the newest sequence number it knows
        # gone from a snapshot could not tell what it missed (io.lmdb_backend rebuilds then)
        return [seq for seq in self.tombstones if seq < min(oldest, self.applied)]


# -- the index saved -------------------------------------------------------------------------
# Replaying every segment's ids at open reads about 9 bytes a row (34M rows: 311 MiB, 10-12 s).
# The writer saves its index when it closes (and when its runs outgrow their limit: spill), and
# an open replays only what came after. The file is a cache: it counts only when LMDB names it
# (the token committed after the file was written; it names the older levels' files in turn),
# so a file from another history (a store copied back, a crash between the two) is never
# applied, and whatever is wrong with what the files hold (their CRCs, checked at open) costs
# a full replay, never a row.
def _header(log: "RowLog", token: str) -> dict:
    # "live_bits": saved with each segment's live slots (files from before hold none: a replay)
    return {"token": token, "live_bits": True, **_shape(log)}


def _shape(log: "RowLog") -> dict:
    return {"rows": log.num_rows, "slot_bytes": log.slot_bytes, "slot_bits": _SLOT_BITS}


def write_index(log: "RowLog", path: Path, token: str, k: int, durable: bool = True, saved: bool = True) -> dict:
    """Write ``log``'s segments' bookkeeping and a level of its runs (what memory holds over
    its ``k`` newest mapped levels: RowIndex.plan) to ``path`` (a temporary file, synced where
    ``durable``, renamed over it); returns the header take_index needs. Not ``saved``: the
    level alone, a file an open reads only as a level a saved one names."""
    tombstones = np.array(sorted(log.tombstones.items()), dtype=np.int64).reshape(-1)
    arrays = [log.seq, log.live.astype(np.int64), log.slots.astype(np.int64), tombstones, log.bits.saved(len(log.seq))] if saved else []
    return rowindex_file.write_file(log.index, path, {**_header(log, token), "applied": log.applied, "live_rows": log.live_rows},
                                    arrays, k, durable)


def take_index(log: "RowLog", path: Path, header: dict, k: int) -> bool:
    """``log``'s runs, just written to ``path`` (write_index(..., k)), from there: mapped
    where they pass its limit (no index changed since write_index: the writer's lock is held
    between). False, the log left as it was, where they do not read back."""
    if not rowindex_file.take_runs(log.index, path, header, k):
        return False
    if header["counts"]:  # a save (write_index(..., saved=True)), not a spill's level alone
        log.unsaved = 0
    return True


def index_files(path: Path, header: dict) -> set[str]:
    """The names of the files the index saved at ``path`` (its ``header``) reads: its own and
    its older levels'."""
    return {path.name, *(name for name, _ in header["levels"])}


def load_index(path: Path, log: "RowLog", token: str) -> set[str] | None:
    """Fill ``log`` (new, empty) with the index saved at ``path`` under ``token``; returns the
    names of the files it reads (index_files). None, the log left empty, where there is none,
    it was saved under another token or for another table shape, or it does not read back
    whole (a file of its levels missing, torn or damaged)."""
    got = rowindex_file.read_file(path, _header(log, token))
    if got is None:
        return None
    if len(got[1]) != 5:  # a spill's level alone, never named: not a save
        return None
    h, (seq, live, slots, tombstones, bits) = got
    if not rowindex_file.load_runs(log.index, path, h, _shape(log)):
        return None
    n = len(seq)
    log.seq, log.live, log.slots = seq, live.astype(np.int32), slots.astype(np.int32)
    log.offset = np.full(n, -1, dtype=np.int64)
    log.bits.load(bits, n)
    used = np.flatnonzero(log.seq > 0)
    log._index = SeqMap(log.seq[used], used)
    log._free = _entries(np.flatnonzero(log.seq == 0)[::-1])
    tombstones = tombstones.reshape(-1, 2)
    log.tombstones = dict(zip(tombstones[:, 0].tolist(), tombstones[:, 1].tolist()))
    log.applied, log.live_rows = h["applied"], h["live_rows"]
    log.emptied = log.seq[used[log.live[used] == 0]].tolist()
    return index_files(path, h)
