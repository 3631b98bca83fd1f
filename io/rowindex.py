"""Where each row of a log table is (io.rowlog): a map from id to place (segment index << 12
| slot), kept as *runs*, so that its memory grows with what was written, not with the ids
a table declares.

A run is ``length`` ids from ``start`` whose rows lie in consecutive slots of one segment
from place ``loc`` (NONE: deleted). A table loaded in id order, or a collection's segment
(it sorts its ids), is a few runs a segment; a row written on its own is a run of one
(16 bytes). A table never written holds nothing. A dense array of 4 bytes a declared id
took 4,016 MiB for a 10^9-row table never written, and 8.45 s to open.

Levels, each sorted by start with no two runs of a level overlapping, newer over older: in
memory ``recent`` takes each write (small, so a write costs little) and is merged into
``main`` once it holds an eighth of main's runs. Past the index's limit it *spills* (a
writer to the files it names, a reader to private ones):
recent and main go to a new file, mapped from there (io.rowindex_file), one of ``levels``
below main, newest first. A spill writes what memory held and merges into it only the
mapped levels smaller than GROWTH times what it writes so far (a log-structured merge; a
level of long runs, as a load leaves, weighs the ids it covers: Runs.weight):
the levels grow geometrically, at most MAX_LEVELS of them, and a row written is rewritten
a few times (about log_GROWTH of the levels), where rewriting every run at each spill made
writing grow with the square of the rows. A lookup asks the levels newest first, each a
binary search (np.searchsorted; in a mapped level, of the one page its fence names: a
block of FENCE runs, their starts, lengths and places side by side, Paged), and in a mapped
level only where the block's filter (a Bloom filter, Filter) passes the id. A mapped
level's runs are checked against their CRCs a block (the FENCE runs of a page) at a time,
when a lookup or a merge first reads that block (Runs.verify), so that an open reads only
each level's header, fence and CRCs; these are mapped as the runs are, and memory holds a bit
a block (checked or not). Every operation is a few vectorized passes over the ids
asked and the runs they meet, never a loop per id.

A level a table's rows have scattered (a run a row or two, as training writes them) is
stored *dense* instead (Dense): every declared id's place, 4 bytes each, where its runs took
16 a row. A spill writes one where that is the smaller (more than a quarter as many runs as
ids declared) and the index may hold it in memory, or, mapped, where its runs would cover
most ids (MAPPED_DENSE_RUNS): the bench-scale table, aged by training, held 34M rows in 35M
runs, 579 MB its page cache could not keep, so that a row fetched read a page of the index
twice (the prefetch's lookup, and the write-back's freeing its old slot) besides its own;
dense, 136 MB. A mapped dense level costs every lookup a page, where a level of runs costs
one only to the ids it holds and those its filters pass.

A dense level is *held* in memory (read from its file, no map) where the index's ``hold``
allows (a budget gives it: tierstore.engine.memory.split_memory): mapped, its 136 MB shared
the page cache's 128 MiB with the write-back's pages, and a row fetched still read 1.9 pages
(`tierstore bench scale`'s DLRM at 0.5 GiB); held, 1.2, and the step took 0.55x the time. A
merge into a held level updates its values in place as it writes the new file (what a newer
level says of an id is what it then holds: a lookup meanwhile gets the same place either
way), so that a held level never takes its bytes twice. The index keeps a held level
*current* (RowIndex.current): every write since is set in its values as well, and an open
sets there what the levels over it hold, so that a lookup reads memory only, where the
mapped levels over it (up to a quarter of its bytes in runs) cost a page each.
"""
from __future__ import annotations

import mmap

import numpy as np

from .lmdb_map import will_need

NONE = np.uint32(0xFFFFFFFF)
RUN_BYTES = 8 + 4 + 4  # start (int64), length (uint32), place of its first id (uint32)
RECENT_RUNS = 1 << 16  # recent is merged into main past this many runs or an eighth of main's
_CHUNK_RUNS = 1 << 16  # runs of each level a save merges at a time (1 MiB each): memory a spill takes
GROWTH = 4  # a spill merges the mapped levels of fewer than GROWTH times the runs it writes so far
MAX_LEVELS = 6  # ... and more, while the mapped levels would number more than this
_LO, _HI = np.iinfo(np.int64).min, np.iinfo(np.int64).max
# the runs a page holds (a start, a length and a place each): a mapped level keeps every FENCE-th
# start in memory (Runs.fence), so that a lookup reads one page of it. With the starts and the
# places in pages of their own a lookup read two, and DLRM's step under 0.5 GiB read 2.6
# pages a row fetched (`tierstore bench scale`)
FENCE = 4096 // RUN_BYTES
# ids a lookup of a mapped level asks at a time, a page each at most: the pages it asks the
# kernel for at once must stay in the page cache until it reads them. Under a memory cgroup
# the write-back's lookup of 45k ids at once asked for 180 MB of pages, more than the page
# cache held: they were reclaimed before they were read, and read again one by one (3 s of
# CPU a lookup, the DLRM step under 0.5 GiB 1.1 s where its floor is 0.16 s)
LOOKUP_PAGES = 1024
# A mapped level's filter (Filter): bits an id sets, and the ids a run a block's filter takes
# before it passes every id. Without it a lookup read a page of each mapped level of runs over
# the one holding its id: the 200M x 16 table's index, aged by training (dense under 483 MB of
# mapped runs), read 1.03 pages an id under 64 MiB of page cache; with it, 0.60
FILTER_BITS = 4
FILTER_IDS = 4
# ... asked only of a level whose runs cover at most this share of the ids declared: past it most ids a
# lookup asks are held there, and the filter's page (a sixteenth of the runs' bytes, more than the
# page cache keeps of a large level) is one more read for each. The 200M x 16 table aged by 120M
# rows (`tierstore bench scale`, 256 MiB: its moved rows in a level of 128M runs over 152M ids,
# 2.1 GB, and 128 MB of filters) read 2.29-2.63 pages a row fetched with the level's filter asked, 2.10-2.27 without
FILTERED_IDS = 0.5
# Runs, per id declared, past which a spill writes a level it cannot hold in memory dense (mapped). The
# 200M x 16 table aged by training (`tierstore bench scale`, 256 MiB: its moved rows a quarter
# of its ids, in 15-55M runs) read 1.25-1.45 pages a row fetched with them in levels of runs,
# 1.81-1.96 once a spill wrote them in a mapped dense level of 800 MB, whose page every lookup read
MAPPED_DENSE_RUNS = 0.75
SLOT_BITS = 12  # a place: segment index << SLOT_BITS | slot
DENSE_IDS = 4096 // 4  # the places a page of a dense level holds
# a dense level's values: an id it does not cover (an older level may), an id deleted, or its place + _PLACED
# (a hole of its file, never written, reads as ABSENT: no disk for ids no row was written to)
ABSENT, DELETED, _PLACED = 0, 1, 2
_SLOT_MASK = (1 << SLOT_BITS) - 1  # a run never crosses a segment: its places share their high bits


class Paged:
    """A column (the starts, lengths or places) of a mapped level, whose runs lie FENCE a page
    (io.rowindex_file): indexed by run as the 1-D array it stands for (an index, an array of
    them, a slice), each run read from the one page that holds it. ``blocks``: the column's
    [pages, FENCE] view of the map; ``map``: the map (np.memmap)."""

    __slots__ = ("blocks", "map", "n", "per")

    def __init__(self, blocks: np.ndarray, mapped, n: int):
        self.blocks, self.map, self.n, self.per = blocks, mapped, n, blocks.shape[1]

    def __len__(self) -> int:
        return self.n

    @property
    def dtype(self) -> np.dtype:
        return self.blocks.dtype

    @property
    def nbytes(self) -> int:
        return self.n * self.blocks.dtype.itemsize

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, _ = i.indices(self.n)
            if hi <= lo:
                return np.zeros(0, dtype=self.dtype)
            b0 = lo // self.per
            pages = np.ascontiguousarray(self.blocks[b0:(hi - 1) // self.per + 1]).reshape(-1)
            return pages[lo - b0 * self.per: hi - b0 * self.per]
        i = np.asarray(i)
        if i.ndim == 0 and i < 0:
            i = i + self.n
        return self.blocks[i // self.per, i % self.per]

    def __array__(self, dtype=None, copy=None):
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)


class Filter:
    """Which ids each block of a mapped level's runs may hold (a Bloom filter a block, of
    filter_words() 64-bit words: 8 bits a run): a lookup reads a block's page of runs only
    for the ids its filter passes. Each id sets FILTER_BITS bits of one word of its block's
    filter (a word a hash picks); an id no run of the block holds passes with a chance of a
    few percent (3% for a run an id: FILTER_BITS of 64 bits, 8 runs' ids a word). A block
    whose runs hold more ids than FILTER_IDS passes every id (its runs are long: the level's
    pages are few). ``words``: [blocks, filter_words()] of the level file's map; ``check``:
    as a mapped Runs's, of the filter's pages (filter_blocks() blocks' filters a page)."""

    __slots__ = ("words", "check")

    def __init__(self, words: np.ndarray, check=None):
        self.words, self.check = words, check

    @property
    def held(self) -> int:
        return self.check.nbytes if self.check is not None else 0

    def may_hold(self, ids: np.ndarray, block: np.ndarray) -> np.ndarray:
        """Whether block ``block[i]``'s runs may hold ``ids[i]`` (False: they do not)."""
        word, bits = _hashed(ids, self.words.shape[1])
        _read_pages(self.words, np.unique(block // filter_blocks()), 4096, self.check)
        mask = np.zeros(len(ids), dtype=np.uint64)
        for bit in bits:
            mask |= np.uint64(1) << bit
        return (self.words[block, word.view(np.int64)] & mask) == mask


def filter_words() -> int:
    """The 64-bit words of a block's filter (Filter): 8 bits a run (FENCE is a power of 2)."""
    return max(1, FENCE // 8)


def filter_blocks() -> int:
    """The blocks' filters a page of a level's file holds."""
    return 4096 // (8 * filter_words())


def block_filters(runs: "Runs") -> np.ndarray:
    """The filters ([blocks, filter_words()] uint64) of ``runs`` (in memory) as a mapped level
    holds them, FENCE runs a block: every id a run holds (its place, or its deletion) set in
    its block's, a block of more ids than FILTER_IDS all set."""
    blocks, per = -(-len(runs) // FENCE), filter_words()
    bits = np.zeros((blocks, per * 64), dtype=bool)
    if not blocks:
        return np.zeros((0, per), dtype=np.uint64)
    length = runs.length.astype(np.int64)
    full = np.add.reduceat(length, np.arange(0, len(runs), FENCE)) > FILTER_IDS * FENCE
    bits[full] = True
    length = np.where(np.repeat(full, FENCE)[:len(runs)], 0, length)
    word, at = _hashed(np.repeat(runs.start, length) + _within(length), per)
    first = (np.repeat(np.arange(len(runs)) // FENCE, length) * per + word.view(np.int64)) * 64
    flat = bits.reshape(-1)
    for bit in at:  # a bool a bit, packed once
        flat[first + bit.view(np.int64)] = True
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint64)


def _within(length: np.ndarray) -> np.ndarray:
    """For runs of ``length`` ids each, every id's offset within its run, run after run."""
    return np.arange(int(length.sum()), dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)


def _hashed(ids: np.ndarray, words: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(word, bits) of each id in a block's filter of ``words`` words (a power of 2): a 64-bit
    mix of the id (splitmix64's finalizer), its low bits the word, the next FILTER_BITS x 6
    the bits it sets (FILTER_BITS arrays of 0-63), all uint64."""
    h = np.asarray(ids, dtype=np.int64).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    return h & np.uint64(words - 1), [(h >> np.uint64(16 + 6 * j)) & np.uint64(63) for j in range(FILTER_BITS)]


class Runs:
    """Sorted, non-overlapping runs: the ids ``start[i] .. start[i] + length[i] - 1`` are at
    places ``loc[i] ..`` (all NONE where ``loc[i]`` is NONE). A mapped level's has a
    ``fence``: every FENCE-th start (mapped from its file, as its columns are: Paged), so
    that a lookup reads one page of runs, a ``check``: called with the blocks (of FENCE runs, the fence's pages) about to be
    read, it checks those not yet checked against their CRCs (raising where one fails), and a
    ``filter`` (Filter; None in a file written before filters: every block asked) and the
    ids its runs ``covers`` (from its file's header; None where not known)."""

    __slots__ = ("start", "length", "loc", "fence", "check", "filter", "covers")

    def __init__(self, start=None, length=None, loc=None, fence=None, check=None, filter=None, covers=None):
        self.start = np.zeros(0, dtype=np.int64) if start is None else start
        self.length = np.zeros(0, dtype=np.uint32) if length is None else length
        self.loc = np.zeros(0, dtype=np.uint32) if loc is None else loc
        self.fence = fence
        self.check = check
        self.filter = filter
        self.covers = covers

    def __len__(self) -> int:
        return len(self.start)

    @property
    def nbytes(self) -> int:
        return self.start.nbytes + self.length.nbytes + self.loc.nbytes

    @property
    def weight(self) -> int:
        """Its size to a merge plan (RowIndex.plan): its runs, or the ids they cover where
        that is more. Each run merged into a level of long runs (a table loaded in id order: a
        run a segment) cuts one of them, and a lookup of an id the merged level holds reads
        its page, where kept apart the level's few runs stay in the page cache and the filters
        of the levels over it pass over the ids they do not hold. So it is merged only once
        the runs over it are as many as a dense level of its ids would hold (GROWTH x runs >=
        ids: a quarter of them), which the merge writes then. Weighed by a quarter of its
        ids, the 200M x 16 table's load was merged with the 14.8M runs of moved rows in its
        seventh run (`tierstore bench scale`, DLRM at 256 MiB): its seventh and eighth runs
        read 1.49 and 2.20 pages a row fetched; kept apart, 1.16 and 1.31. Weighed by its
        runs, it was merged at the first spill (its second to fourth runs read 1.46, 1.15
        and 1.97 pages a row; kept apart 1.09, 1.06 and 1.23)."""
        return len(self) if self.covers is None else max(len(self), self.covers)

    @property
    def map(self):
        """The file map of a mapped level (np.memmap); None in memory."""
        return getattr(self.start, "map", None)

    @property
    def held(self) -> int:
        """Memory a mapped level holds: a bit a block of its runs and a page of its filter (checked)."""
        return (self.check.nbytes if self.check is not None else 0) + (self.filter.held if self.filter is not None else 0)

    def verify(self, blocks) -> None:
        """Check ``blocks`` (indexes of FENCE runs) of a mapped level before they are read."""
        _verify(self.check, blocks)

    def search(self, x: int, side: str) -> int:
        """np.searchsorted(start, x, side); in a mapped level, of the one block (checked) the
        fence names: a binary search of the whole level would read unchecked pages."""
        if self.fence is None:
            return int(np.searchsorted(self.start, x, side=side))
        p = int(np.searchsorted(self.fence, x, side=side)) - 1
        if p < 0:
            return 0
        self.verify(p)
        lo = p * FENCE
        return lo + int(np.searchsorted(self.start[lo:lo + FENCE], x, side=side))

    def line(self, lo: int) -> int:
        """The first id from ``lo`` past which our runs number more than _CHUNK_RUNS (_HI: none):
        where a merge's piece ends (RowIndex.merging)."""
        a = self.search(lo, "left") + _CHUNK_RUNS
        if a >= len(self):
            return _HI
        if self.fence is not None:
            self.verify(a // FENCE)
        return int(self.start[a])

    @property
    def end(self) -> np.ndarray:
        return np.asarray(self.start) + np.asarray(self.length)

    def take(self, which) -> "Runs":
        return Runs(self.start[which], self.length[which], self.loc[which])

    @classmethod
    def of(cls, ids: np.ndarray, places: np.ndarray | None) -> "Runs":
        """The runs of distinct ``ids`` at ``places`` (uint32, one each, NONE: deleted; None: all deleted)."""
        ids = np.asarray(ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        if not len(ids):
            return cls()
        breaks = np.diff(ids) != 1
        if places is not None:  # a run goes on to the next slot of its segment, or is of deleted ids
            places = np.asarray(places, dtype=np.uint32)[order]
            none = places == NONE
            breaks |= ~(((np.diff(places.astype(np.int64)) == 1) & ((places[1:] & _SLOT_MASK) != 0)) | (none[1:] & none[:-1]))
        first = np.concatenate(([0], np.flatnonzero(breaks) + 1))
        length = np.diff(np.append(first, len(ids))).astype(np.uint32)
        loc = np.full(len(first), NONE, dtype=np.uint32) if places is None else places[first]
        return cls(ids[first], length, loc)

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(covered, place) of each of ``ids``: whether a run holds it, and its place there
        (NONE where that run is a deletion, or where none holds it)."""
        covered, loc = np.zeros(len(ids), dtype=bool), np.full(len(ids), NONE, dtype=np.uint32)
        if not len(self):
            return covered, loc
        if self.fence is None:
            asked, i = slice(None), np.searchsorted(self.start, ids, side="right") - 1
        elif len(ids) > LOOKUP_PAGES:  # a mapped level: a few pages at a time
            parts = [self.find(ids[lo:lo + LOOKUP_PAGES]) for lo in range(0, len(ids), LOOKUP_PAGES)]
            return np.concatenate([c for c, _ in parts]), np.concatenate([p for _, p in parts])
        else:
            page = np.searchsorted(self.fence, ids, side="right") - 1
            asked = np.flatnonzero(page >= 0)
            if self.filter is not None:
                asked = asked[self.filter.may_hold(ids[asked], page[asked])]
            i = self._fenced(ids[asked], page[asked])
        i0 = np.maximum(i, 0)
        off = ids[asked] - self.start[i0]
        held = (i >= 0) & (off < self.length[i0])
        base = self.loc[i0]
        covered[asked] = held
        loc[asked] = np.where(held & (base != NONE), base + off.astype(np.uint32), NONE)
        return covered, loc

    def _fenced(self, ids: np.ndarray, page: np.ndarray) -> np.ndarray:
        """searchsorted(start, ids, "right") - 1 of ``ids`` in the fence's pages ``page`` (each
        id's, none before the first): one search of those pages' starts side by side (in page
        order they are sorted, and an id's page holds the last start at or below it), where a
        binary search a page, a vectorized step each halving, indexed the map nine times."""
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        pages = np.unique(page)
        _read_pages(self.start.map, pages, self.start.map.dtype.itemsize, self.check)
        starts = self.start.blocks[pages]
        if pages[-1] == len(self.fence) - 1:  # the last page's rest is zero, not past every id
            starts[-1, len(self.start) - pages[-1] * FENCE:] = _HI
        j = np.searchsorted(starts.reshape(-1), ids, side="right") - 1
        return pages[j // FENCE] * FENCE + j % FENCE

    def _cut(self, other: "Runs") -> tuple[np.ndarray, "Runs"]:
        """(indexes of our runs that ``other``'s meet, ascending; their pieces left on either
        side of each of other's runs, sorted): a few passes over other's runs and the runs
        they meet, none over ours (a write into a level of many runs costs its own runs)."""
        o_end = other.end
        before = np.searchsorted(self.start, other.start, side="right") - 1  # ours starting at or before each of theirs
        b0 = np.maximum(before, 0)
        lo = np.where((before >= 0) & (self.start[b0] + self.length[b0] > other.start), before, before + 1)
        hi = np.searchsorted(self.start, o_end, side="left")  # ours starting before it ends are below hi
        n = np.maximum(hi - lo, 0)
        a = np.repeat(lo, n) + _within(n)
        if not len(a):
            return a, Runs()
        a = a[np.append(True, a[1:] != a[:-1])]  # ascending: two of theirs meet one of ours only where one ends
        a_start, a_loc = self.start[a], self.loc[a]
        a_end = a_start + self.length[a]
        i0 = np.searchsorted(o_end, a_start, side="right")  # their runs inside run a: i0 .. i1 - 1 (one at least)
        i1 = np.searchsorted(other.start, a_end, side="left")
        pieces = i1 - i0 + 1  # before the first, between each two, after the last
        owner = np.repeat(np.arange(len(a)), pieces)
        m = _within(pieces)
        last = len(other) - 1
        p_start = np.where(m == 0, a_start[owner], o_end[np.clip(i0[owner] + m - 1, 0, last)])
        p_end = np.where(m == pieces[owner] - 1, a_end[owner], other.start[np.clip(i0[owner] + m, 0, last)])
        keep = p_end > p_start
        owner, p_start, p_end = owner[keep], p_start[keep], p_end[keep]
        base = a_loc[owner]
        loc = np.where(base == NONE, NONE, base + (p_start - a_start[owner]).astype(np.uint32)).astype(np.uint32)
        return a, Runs(p_start, (p_end - p_start).astype(np.uint32), loc)

    def under(self, newer: "Runs", bottom: bool = False) -> "Runs":
        """These runs with ``newer``'s over them; at the ``bottom`` level deletions are dropped
        (no level below holds those ids)."""
        if bottom:
            kept = newer.take(newer.loc != NONE)
        else:
            kept = newer
        if not len(self) or not len(newer):
            return kept if not len(self) else _inserted(self, kept)
        cut, pieces = self._cut(newer)
        rest = self if not len(cut) else Runs(np.delete(self.start, cut), np.delete(self.length, cut), np.delete(self.loc, cut))
        return _inserted(rest, _sorted(pieces, kept))

    def window(self, lo: int, hi: int) -> "Runs":
        """Our runs' ids in [lo, hi), the runs across either line cut there: a copy of those
        runs only (of a mapped level, the pages they are in)."""
        a = self.search(lo, "right") - 1
        if a < 0 or int(self.start[a]) + int(self.length[a]) <= lo:
            a += 1
        b = self.search(hi, "left")
        if b <= a:
            return Runs()
        if self.fence is not None:
            self.verify(np.arange(a // FENCE, (b - 1) // FENCE + 1))
        part = Runs(np.array(self.start[a:b]), np.array(self.length[a:b]), np.array(self.loc[a:b]))
        start, end = np.maximum(part.start, lo), np.minimum(part.end, hi)
        loc = np.where(part.loc == NONE, NONE, part.loc + (start - part.start).astype(np.uint32)).astype(np.uint32)
        return Runs(start, (end - start).astype(np.uint32), loc)

    def ids(self) -> np.ndarray:
        """Every id a run holds a row of, ascending."""
        held = self.take(self.loc != NONE)
        length = held.length.astype(np.int64)
        return np.repeat(held.start, length) + _within(length)


class Dense:
    """A level stored dense: the value of every id below ``len(values)`` (ABSENT, DELETED or
    its place + _PLACED), DENSE_IDS a page of its file, so that a lookup reads the one page
    its id names and needs no fence. ``map``: its file's map (np.memmap), None where the
    level is held in memory; ``count``: the ids it covers (at most the runs a merge reads of
    it); ``check``: as a mapped Runs's, by page (None: held, checked as it was read)."""

    __slots__ = ("values", "map", "count", "check")

    def __init__(self, values: np.ndarray, mapped, count: int, check=None):
        self.values, self.map, self.count, self.check = values, mapped, count, check

    def __len__(self) -> int:
        return self.count

    @property
    def weight(self) -> int:
        """Its size to a merge plan: the runs its bytes would hold (a merge reads and writes
        every id's value, covered or not), a quarter of its ids. Counted by the ids it covers,
        the levels above a dense one grew to a quarter of them (7M runs, 113 MB, over the
        bench-scale table's 32M), their pages as many lookups' disk reads as its own."""
        return len(self.values) * 4 // RUN_BYTES

    @property
    def held(self) -> int:
        return (self.check.nbytes if self.check is not None else 0) + (self.values.nbytes if self.map is None else 0)

    def verify(self, pages) -> None:
        _verify(self.check, pages)

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As Runs.find: a page of the file an id, LOOKUP_PAGES of them asked for at a time."""
        if len(ids) > LOOKUP_PAGES:
            parts = [self.find(ids[lo:lo + LOOKUP_PAGES]) for lo in range(0, len(ids), LOOKUP_PAGES)]
            return np.concatenate([c for c, _ in parts]), np.concatenate([p for _, p in parts])
        inside = (ids >= 0) & (ids < len(self.values))
        at = np.where(inside, ids, 0)
        if self.map is not None:
            _read_pages(self.values, np.unique(at[inside] // DENSE_IDS), 4 * DENSE_IDS, self.check)
        value = np.where(inside, self.values[at], ABSENT)
        return value != ABSENT, _places(value)

    def line(self, lo: int) -> int:
        hi = max(lo, 0) + _CHUNK_RUNS
        return hi if hi < len(self.values) else _HI

    def window(self, lo: int, hi: int) -> Runs:
        """The runs of our ids in [lo, hi) (a copy, read from the pages that hold them)."""
        lo, hi = max(lo, 0), min(hi, len(self.values))
        if hi <= lo:
            return Runs()
        self.verify(np.arange(lo // DENSE_IDS, (hi - 1) // DENSE_IDS + 1))
        value = np.array(self.values[lo:hi])
        held = np.flatnonzero(value != ABSENT)
        return Runs.of(lo + held, _places(value[held]))


def in_memory(level) -> bool:
    """Whether ``level`` is a dense level held in memory (its file read, not mapped)."""
    return isinstance(level, Dense) and level.map is None


def _places(value: np.ndarray) -> np.ndarray:
    """The places dense ``value``s stand for (NONE: deleted or not covered)."""
    return np.where(value >= _PLACED, value - _PLACED, NONE).astype(np.uint32)


def dense_pages(pieces, ids: int):
    """(first page, values) of the pages of a dense level of ``ids`` ids that hold the runs
    of ``pieces`` (sorted Runs, each past the last): consecutive pages in parts of a few MiB
    at most, whatever the runs' lengths, a page two pieces share given once, pages no run
    reaches not at all (ABSENT: a hole of the file)."""
    last, held = -1, None  # the last page of the part before, which the next piece may fill on
    for piece in pieces:
        if not len(piece):
            continue
        lo, top_id = int(piece.start[0]) // DENSE_IDS * DENSE_IDS, min(int(piece.end[-1]), ids)  # a table's ids are below ids
        while lo < top_id:
            hi = min(lo + _DENSE_PART, dense_page_count(ids) * DENSE_IDS)
            values = np.zeros(hi - lo, dtype=np.uint32)
            reached = _spread(piece, lo, hi, values)
            if reached > lo:
                page = lo // DENSE_IDS
                if held is not None and last == page:
                    values[:DENSE_IDS] |= held  # the same page: each piece's ids are ABSENT (0) in the other's
                elif held is not None:
                    yield last, held
                top = -(-(reached - lo) // DENSE_IDS)  # the part's pages up to its last id
                if top > 1:
                    yield page, values[:(top - 1) * DENSE_IDS]
                last, held = page + top - 1, values[(top - 1) * DENSE_IDS: top * DENSE_IDS]
            lo = hi
    if held is not None:
        yield last, held


_DENSE_PART = 256 * DENSE_IDS  # ids a part of a dense level's values holds at most: 1 MiB


def dense_page_count(ids: int) -> int:
    """The pages of a dense level of ``ids`` ids."""
    return -(-ids // DENSE_IDS)


def mapped_bytes_bound(ids: int) -> int:
    """The most memory the mapped levels of an index of ``ids`` ids hold (Runs.held,
    Dense.held: a bit a page of runs, filters or values, checked or not): MAX_LEVELS of them
    and the one a spill is taking in their place, each of fewer runs than MAPPED_DENSE_RUNS
    of the ids, or a quarter where that is more (rowindex_file._dense: a spill writes more
    dense, a bit a DENSE_IDS ids)."""
    blocks = -(-int(max(MAPPED_DENSE_RUNS, 4 / RUN_BYTES) * ids + 1) // FENCE)
    bits = max(blocks + -(-blocks // filter_blocks()), -(-ids // DENSE_IDS))
    return (MAX_LEVELS + 1) * (-(-bits // 8) + 2)


def dense_bytes(ids: int) -> int:
    """The bytes of a dense level of ``ids`` ids (Dense): what holding it in memory takes."""
    return 4 * DENSE_IDS * dense_page_count(ids)


def _verify(check, blocks) -> None:
    """A mapped level's ``check`` (None: a level in memory) of ``blocks`` (its pages)."""
    if check is not None:
        check(np.asarray(blocks, dtype=np.int64).reshape(-1))


def _spread(runs: Runs, lo: int, hi: int, values: np.ndarray) -> int:
    """Set the values (DELETED, or place + _PLACED) of the ids of ``runs`` (in memory) in
    [lo, hi) in ``values`` (those of ids lo .. hi - 1); returns the last id set + 1 (lo: none)."""
    end = runs.end
    a, b = np.searchsorted(end, lo, side="right"), np.searchsorted(runs.start, hi, side="left")
    if a >= b:
        return lo
    start = np.maximum(runs.start[a:b], lo)
    length = (np.minimum(end[a:b], hi) - start).astype(np.int64)
    loc = runs.loc[a:b]
    first = np.repeat(np.where(loc == NONE, DELETED, loc.astype(np.int64) + _PLACED + (start - runs.start[a:b])), length)
    offset = _within(length)
    values[np.repeat(start - lo, length) + offset] = first + np.where(np.repeat(loc != NONE, length), offset, 0)
    return min(int(end[b - 1]), hi)


def _sorted(a: Runs, b: Runs) -> Runs:
    """The runs of ``a`` and ``b`` (each sorted, none overlapping; few) in one sorted level."""
    if not len(a) or not len(b):
        return b if not len(a) else a
    start = np.concatenate((a.start, b.start))
    order = np.argsort(start, kind="stable")
    return Runs(start[order], np.concatenate((a.length, b.length))[order], np.concatenate((a.loc, b.loc))[order])


def _inserted(level: Runs, new: Runs) -> Runs:
    """``new``'s runs (sorted, meeting none of ``level``'s) put in their places in ``level``:
    a copy of its arrays, the new ones slotted in."""
    if not len(new):
        return level
    at = np.searchsorted(level.start, new.start)
    return Runs(np.insert(level.start, at, new.start), np.insert(level.length, at, new.length), np.insert(level.loc, at, new.loc))


class RowIndex:
    """id -> place of one table: recent over main in memory, over the mapped ``levels``.

    ``limit``: the bytes its runs and the mapped levels' bits (``marks``) may hold (None: no
    limit). Past half of what the bits leave of it the index spills
    (wants_spill: its backend writes the file, io.rowindex_file), and memory holds what was
    written since; the page cache keeps what lookups use of the mapped levels, as it keeps
    rows. ``hold``: the bytes of dense levels it may hold in memory besides (Dense);
    ``current``: one of those, kept current (put), so that a lookup asks no level over it."""

    def __init__(self, num_rows: int, limit: int | None = None, hold: int = 0):
        self.num_rows = num_rows
        self.limit = limit
        self.hold = hold
        self.main = Runs()
        self.recent = Runs()
        self.levels: list[Runs | Dense] = []  # mapped from their files, newest first
        self.names: list[str] = []  # ... the name of each one's file
        self.dead: np.ndarray | None = None  # by segment index: rows of a mapped level placed there are gone
        self.current: Dense | None = None

    @property
    def mapped(self) -> bool:
        return bool(self.levels)

    @property
    def nbytes(self) -> int:
        """Memory held: mapped levels are the page cache's, but for a bit a page (Runs.held)."""
        return self.main.nbytes + self.recent.nbytes + sum(level.held for level in self.levels)

    @property
    def marks(self) -> int:
        """What the mapped levels hold: a bit a page, checked or not (mapped_bytes_bound at most).
        A spill does not free it: the runs in memory get what it leaves of the limit."""
        return sum(level.held for level in self.levels if level.map is not None)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The place of each of ``ids`` (uint32), NONE where no row is stored: from the newest
        level that holds it (a mapped level: a page of its file, Runs._fenced)."""
        ids = np.asarray(ids, dtype=np.int64)
        covered, loc = self.recent.find(ids)
        rest = np.flatnonzero(~covered)
        levels = self.levels
        if self.current is not None:  # what the levels over it hold, it holds
            levels = levels[next(i for i, level in enumerate(levels) if level is self.current):]
        for i, level in enumerate([self.main, *levels]):
            if not len(rest):
                break
            held, got = level.find(ids[rest])
            loc[rest[held]] = self._alive(got[held]) if i else got[held]
            rest = rest[~held]
        return loc

    def _alive(self, loc: np.ndarray) -> np.ndarray:
        """``loc`` (places a mapped level holds) with those in dead segments deleted, in place."""
        if self.dead is not None:
            seg = loc >> SLOT_BITS
            hit = (loc != NONE) & (seg < len(self.dead))
            hit[hit] = self.dead[seg[hit]]
            loc[hit] = NONE
        return loc

    def put(self, ids: np.ndarray, places: np.ndarray | None) -> None:
        """Rows of distinct ``ids`` now at ``places`` (NONE, or all where None: deleted)."""
        self.recent = self.recent.under(Runs.of(ids, places))
        if self.current is not None:
            values = self.current.values
            values[np.asarray(ids, dtype=np.int64)] = DELETED if places is None else np.where(
                places == NONE, DELETED, np.asarray(places, dtype=np.int64) + _PLACED)
        if len(self.recent) > max(RECENT_RUNS, len(self.main) // 8) and self._settles():
            self.settle()

    def _settles(self) -> bool:
        """Whether recent merges into main in memory: where the merge's copies fit the limit
        (about three of main and two of recent at once). A replay spills as it goes
        (RowLog.replay)."""
        if self.limit is None:
            return True
        return 3 * self.main.nbytes + 2 * self.recent.nbytes <= self.limit - self.marks

    def wants_spill(self) -> bool:
        """Whether memory's runs take more than half of what the mapped levels' bits leave of the
        limit, or recent can merge into main no more."""
        if self.limit is None:
            return False
        return self.main.nbytes + self.recent.nbytes > (self.limit - self.marks) // 2 or not self._settles() and len(self.recent) > max(RECENT_RUNS, len(self.main) // 8)

    def settle(self) -> None:
        """Merge recent into main in memory."""
        if len(self.recent):
            self.main, self.recent = self.main.under(self.recent, bottom=not self.levels), Runs()

    def drop(self, dead: np.ndarray) -> None:
        """Rows placed in the segments ``dead`` marks (bool by segment index) are gone. Mapped
        levels keep them, masked, until a spill merges them all: their segment indexes must
        not be reused until then (``held``)."""
        for level in (self.recent, self.main):
            placed = level.loc != NONE
            level.loc[placed & dead[np.where(placed, level.loc >> SLOT_BITS, 0)]] = NONE
        if not self.levels:
            self.main = self.main.take(self.main.loc != NONE)
        else:
            self.dead = dead.copy() if self.dead is None else _padded(self.dead, len(dead)) | _padded(dead, len(self.dead))

    def make_current(self) -> None:
        """Keep the newest held dense level current (``current``): the runs of the levels over it
        set in its values (the oldest first), a part at a time (_DENSE_PART)."""
        at = next((i for i, level in enumerate(self.levels) if in_memory(level)), None)
        self.current = None if at is None else self.levels[at]
        if at:
            values = self.current.values
            for lo in range(0, len(values), _DENSE_PART):
                hi = min(lo + _DENSE_PART, len(values))
                for level in self.levels[at - 1::-1]:
                    w = level.window(lo, hi)
                    self._alive(w.loc)
                    _spread(w, lo, hi, values[lo:hi])

    def room(self, replaced: int = 0) -> int:
        """The bytes a dense level may hold in memory, where the ``replaced`` newest levels
        are about to go."""
        return self.hold - sum(level.values.nbytes for level in self.levels[replaced:] if in_memory(level))

    def held(self) -> list[int]:
        """Segment indexes mapped levels still name though their segments are gone."""
        return [] if self.dead is None else np.flatnonzero(self.dead).tolist()

    def ids(self) -> np.ndarray:
        """Ids of every row stored, ascending."""
        return np.concatenate([np.zeros(0, dtype=np.int64)] + [p.ids() for p in self.merging(len(self.levels))])

    # -- spilling ---------------------------------------------------------------------------
    def plan(self) -> int:
        """How many mapped levels (the newest) the next spill merges with what memory holds:
        those of fewer than GROWTH times the runs merged before them (a level's weight: a
        dense level's, as many runs as its bytes would hold, what merging it reads and writes;
        a level of long runs', its ids), more while the levels
        would number more than MAX_LEVELS, and all where a mapped level names dead segments
        (the merge drops those places: their segment indexes can then be reused)."""
        if self.dead is not None:
            return len(self.levels)
        size, k = len(self.recent) + len(self.main), 0
        while k < len(self.levels) and (GROWTH * size >= self._weight(self.levels[k]) or len(self.levels) - k >= MAX_LEVELS):
            size += self._weight(self.levels[k])
            k += 1
        return k

    def _weight(self, level) -> int:
        """A level's weight to plan(): its own (Runs.weight, Dense.weight), but GROWTH times the ids
        of a level of long runs where the index would map a dense level of its ids (its hold cannot
        keep one): merged with the levels of moved rows over it, its runs are cut at each moved
        row, and the merged level (dense, or runs whose filters pass every id) costs every lookup a
        page, where kept apart the levels of moved rows cost a page only to the rows they hold and
        those their filters pass (MAPPED_DENSE_RUNS)."""
        if (isinstance(level, Runs) and level.covers is not None and level.covers > 2 * len(level)
                and self.hold < dense_bytes(self.num_rows)):
            return GROWTH * level.weight
        return level.weight

    def merging(self, k: int):
        """Recent over main over the ``k`` newest mapped levels, one level (all of them: the
        bottom, deletions dropped), in pieces of the ids where each holds _CHUNK_RUNS runs at
        most: what a spill writes, never a whole level in memory."""
        sources = [self.recent, self.main, *self.levels[:k]]
        bottom = k == len(self.levels)
        for level in self.levels[:k]:
            _advise(level, mmap.MADV_SEQUENTIAL)
        try:
            yield from self._merged(sources, bottom)
        finally:
            for level in self.levels[:k]:
                _advise(level, mmap.MADV_RANDOM)

    def dense_merging(self, k: int):
        """What merging(k) yields, as (first page, values) of every page of a dense level, where
        the oldest level it merges is dense: that level's values a part at a time (_DENSE_PART),
        the newer levels' runs spread over them. No runs are made of the dense level: turned
        into runs and back (merging, dense_pages), its 34M ids took most of a spill's CPU. A
        held dense level takes each part's values in place as it goes."""
        sources = [self.recent, self.main, *self.levels[:k]]
        base, bottom = sources[-1], k == len(self.levels)
        _advise(base, mmap.MADV_SEQUENTIAL)
        try:
            for lo in range(0, len(base.values), _DENSE_PART):
                hi = min(lo + _DENSE_PART, len(base.values))
                base.verify(np.arange(lo // DENSE_IDS, (hi - 1) // DENSE_IDS + 1))
                values = np.array(base.values[lo:hi])
                placed = np.flatnonzero(values >= _PLACED)
                alive = self._alive(values[placed] - np.uint32(_PLACED))
                values[placed[alive == NONE]] = DELETED
                for i in range(len(sources) - 2, -1, -1):  # the oldest first, each newer over it
                    w = sources[i].window(lo, hi)
                    if i >= 2:
                        self._alive(w.loc)
                    _spread(w, lo, hi, values)
                if bottom:
                    values[values == DELETED] = ABSENT
                if base.map is None:
                    base.values[lo:hi] = values
                yield lo // DENSE_IDS, values
        finally:
            _advise(base, mmap.MADV_RANDOM)

    def _merged(self, sources: list[Runs], bottom: bool):
        lo = _LO
        while True:
            hi = min(s.line(lo) for s in sources)
            acc = Runs()
            for i in range(len(sources) - 1, -1, -1):  # the oldest first, each newer over it
                w = sources[i].window(lo, hi)
                if i >= 2:
                    self._alive(w.loc)
                acc = acc.under(w)
            yield acc.take(acc.loc != NONE) if bottom else acc
            if hi == _HI:
                return
            lo = hi

    def capacity(self, k: int) -> int:
        """The most runs merging(k) yields: each run of a newer level adds itself and cuts one
        older run in two, and each piece's line cuts a run of each level."""
        n = len(self.recent) + len(self.main) + sum(len(level) for level in self.levels[:k])
        return 2 * n + (k + 2) * (n // _CHUNK_RUNS + 2) + 1


def _read_pages(mapped: np.ndarray, pages: np.ndarray, size: int, check) -> None:
    """Ask the kernel for the pages ``pages`` (of ``size`` bytes) of a level's map all at once,
    then ``check`` them (_verify): a lookup's faults then wait on reads already under way in
    parallel, not issued one by one (io.lmdb_map.will_need)."""
    will_need(mapped.ctypes.data, pages * size, size)
    _verify(check, pages)


def _advise(level: Runs | Dense, advice: int) -> None:
    """Tell the kernel how a mapped level's pages are read: at random by lookups (a page
    each: read-ahead read 32 around each), in order by a merge."""
    if level.map is not None:
        level.map._mmap.madvise(advice)


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) >= n else np.concatenate((a, np.zeros(n - len(a), dtype=a.dtype)))
