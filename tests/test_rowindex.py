"""The row index (io.rowindex): runs that grow with the rows written, against a plain dict,
in memory and spilled to its file; a writer killed at any point reopens as its last publish;
its memory under the budget, whatever the rows a table declares."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierstore.io import rowindex, rowindex_file, rowlog
from tierstore.io.errors import RowIndexDamagedError
from tierstore.io.rowindex import NONE, RowIndex

sys.path.insert(0, str(Path(__file__).parent))
from index_writer import DIM, open_writer  # noqa: E402

ROWS = 10**9  # declared; a few hundred written
CHUNK_RUNS, MAX_LEVELS, FENCE, DENSE_IDS = rowindex._CHUNK_RUNS, rowindex.MAX_LEVELS, rowindex.FENCE, rowindex.DENSE_IDS
MAPPED_DENSE_RUNS = rowindex.MAPPED_DENSE_RUNS


def ids_of(draw_sparse, draw_range):
    """Ids of a write: scattered over the whole id space, or a range near one of a few bases
    (so that runs meet, split and cover one another)."""
    return st.one_of(draw_sparse, draw_range).map(lambda ids: sorted(set(ids)))


BASES = (0, 1000, ROWS // 2, ROWS - 64)
sparse_ids = st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=20)
range_ids = st.builds(lambda base, lo, n: list(range(base + lo, min(base + lo + n, ROWS))),
                      st.sampled_from(BASES), st.integers(0, 48), st.integers(1, 16))
near_ids = st.lists(st.builds(lambda base, off: base + off, st.sampled_from(BASES), st.integers(0, 63)), min_size=1, max_size=20)
write_ids = ids_of(st.one_of(sparse_ids, near_ids), range_ids)


class IndexAgainstDict(RuleBasedStateMachine):
    """RowIndex in memory and spilled (levels mapped from files, merged as they grow), against
    a dict; a damaged file is refused at open. Its ids scattered over 10^9 declared: every
    level is runs."""

    rows = ROWS
    hold = 0  # the bytes of dense levels the index holds in memory (RowIndex.hold)
    mapped_dense_runs = MAPPED_DENSE_RUNS

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = Path(self.tmp.name)
        self.index = RowIndex(self.rows, limit=400, hold=self.hold)  # 25 runs: spills within a few writes
        rowindex._CHUNK_RUNS = 4  # a save merges a few runs of each level at a time: runs cut at each piece's line
        rowindex.MAX_LEVELS = 3  # levels merged for their number too
        rowindex.FENCE = 4  # a mapped level's lookups search pages of a few starts
        rowindex.DENSE_IDS = 16  # a dense level's pages of a few ids
        rowindex.MAPPED_DENSE_RUNS = self.mapped_dense_runs
        self.model: dict[int, int] = {}
        self.segment = 0
        self.saves = 0

    def teardown(self):
        rowindex._CHUNK_RUNS, rowindex.MAX_LEVELS = CHUNK_RUNS, MAX_LEVELS
        rowindex.FENCE, rowindex.DENSE_IDS, rowindex.MAPPED_DENSE_RUNS = FENCE, DENSE_IDS, MAPPED_DENSE_RUNS
        self.tmp.cleanup()

    def _ids(self, ids: list[int]) -> list[int]:
        return sorted({i % self.rows for i in ids})

    @rule(ids=write_ids)
    def put(self, ids):
        ids = self._ids(ids)
        self.segment += 1
        places = (self.segment << rowindex.SLOT_BITS) | np.arange(len(ids), dtype=np.uint32)
        order = np.random.default_rng(self.segment).permutation(len(ids))  # a segment's ids in any order
        self.index.put(np.array(ids)[order], places[order])
        self.model.update(zip(np.array(ids)[order].tolist(), places[order].tolist()))

    @rule(ids=write_ids)
    def delete(self, ids):
        ids = self._ids(ids)
        self.index.put(np.array(ids), None)
        for i in ids:
            self.model.pop(i, None)

    @rule(data=st.data())
    def segments_gone(self, data):
        dead = np.array(data.draw(st.lists(st.booleans(), min_size=self.segment + 1, max_size=self.segment + 1)))
        self.index.drop(dead)
        self.model = {i: p for i, p in self.model.items() if not dead[p >> rowindex.SLOT_BITS]}

    @rule()
    def spill_when_asked(self):
        if self.index.wants_spill():
            self.save()

    @rule()
    def save(self):
        """What a writer's backend does: write a level of memory's runs and the mapped levels
        its plan merges, take the runs from it (mapped past the limit or over mapped levels)."""
        self.saves += 1
        path = self.dir / f"i{self.saves}"
        levels, k = len(self.index.levels), self.index.plan()
        header = rowindex_file.write_file(self.index, path, {"n": self.saves}, [np.arange(3)], k)
        assert rowindex_file.take_runs(self.index, path, header, k)
        assert len(header["levels"]) == levels - k and len(self.index.levels) <= rowindex.MAX_LEVELS
        in_memory = k == levels and header["runs"] * rowindex.RUN_BYTES <= self.index.limit // 2 and not header.get("dense")
        assert self.index.mapped == (not in_memory and (header["runs"] > 0 or k < levels))
        # a mapped level's fence and CRCs are the page cache's, as its runs are: memory holds a bit a block of
        # its runs and a page of its filter (a dense level's: a page); a dense level held in memory, its values
        bits = sum(-(-len(level.check.crcs) // 8) + (0 if getattr(level, "filter", None) is None else -(-len(level.filter.check.crcs) // 8))
                   for level in self.index.levels if level.map is not None)
        values = sum(level.values.nbytes for level in self.index.levels if rowindex.in_memory(level))
        assert self.index.nbytes == bits + values or not self.index.mapped
        assert bits <= rowindex.mapped_bytes_bound(self.rows)
        sizes = [len(level) for level in self.index.levels]  # each level GROWTH times the runs of those above it, about
        assert all(b > rowindex.GROWTH * a for a, b in zip(sizes[:-1], sizes[1:])) or len(sizes) <= rowindex.MAX_LEVELS

    @rule()
    def reload(self):
        """An open: the last file read back (its levels mapped or in memory) reads the same."""
        if self.saves:
            path = self.dir / f"i{self.saves}"
            got = rowindex_file.read_file(path, {"n": self.saves})
            assert got is not None and got[1][0].tolist() == [0, 1, 2]
            fresh = RowIndex(self.rows, limit=self.index.limit, hold=self.hold)
            assert rowindex_file.load_runs(fresh, path, got[0], {})
            saved = {i: p for i, p in zip(fresh.ids().tolist(), fresh.get(fresh.ids()).tolist())}
            assert fresh.get(np.array(self._ids(BASES))).dtype == np.uint32
            self.index, self.model = fresh, saved  # what the file holds is what was saved: checked by the invariant next

    @rule(data=st.data())
    def damaged_file_is_refused(self, data):
        """A byte of a level's runs changed (or its file cut short): the open refuses the index,
        or, where it maps the level, the first read of the block holding that byte raises."""
        if not self.saves:
            return
        path = self.dir / f"i{self.saves}"
        header = rowindex_file.read_file(path, {})[0]
        files = [(path, header)] + [(self.dir / name, rowindex_file.read_file(self.dir / name, {})[0]) for name, _ in header["levels"]]
        files = [(p, h) for p, h in files if h["runs"]]
        if not files:
            return
        p, h = data.draw(st.sampled_from(files))
        block_bytes = 4 * rowindex.DENSE_IDS if h.get("dense") else rowindex.RUN_BYTES * rowindex.FENCE
        level_bytes = -(-self.rows // rowindex.DENSE_IDS) * block_bytes if h.get("dense") else h["runs"] * rowindex.RUN_BYTES
        at = h["offsets"][len(h["counts"])] + data.draw(st.integers(0, level_bytes - 1))  # a byte of a page of runs (of ids' values)
        original = p.read_bytes()
        damaged = bytearray(original)
        damaged[at] ^= 1 << data.draw(st.integers(0, 7))
        cut = data.draw(st.booleans())
        p.write_bytes(bytes(damaged[:at] if cut else damaged))
        try:
            fresh = RowIndex(self.rows, limit=self.index.limit, hold=self.hold)
            if rowindex_file.load_runs(fresh, path, header, {}):
                assert not cut and fresh.mapped
                block = (at - h["offsets"][len(h["counts"])]) // block_bytes
                level = fresh.levels[fresh.names.index(p.name)]
                assert not _held(level)  # a level held in memory has every page checked as it is read
                others = np.flatnonzero(np.arange(len(level.check.crcs)) != block)
                level.verify(others)  # the other blocks read as written
                with pytest.raises(RowIndexDamagedError, match="fails its CRC"):
                    fresh.ids()  # reads every block
        finally:
            p.write_bytes(original)

    @rule()
    def settle(self):
        self.index.settle()

    @invariant()
    def reads_as_the_dict(self):
        asked = np.array(sorted(set(self.model) | set(self._ids(BASES)) | set(self._ids([b + 5 for b in BASES]))), dtype=np.int64)
        assert self.index.get(asked).tolist() == [self.model.get(i, int(NONE)) for i in asked.tolist()]
        assert self.index.ids().tolist() == sorted(self.model)
        for level in (self.index.main, self.index.recent, *[level for level in self.index.levels if isinstance(level, rowindex.Runs)]):
            start = np.asarray(level.start)
            assert (np.diff(start) > 0).all() and (start[1:] >= level.end[:-1]).all()
            assert (np.asarray(level.length) > 0).all()


IndexAgainstDict.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestIndexAgainstDict = IndexAgainstDict.TestCase


class DenseIndexAgainstDict(IndexAgainstDict):
    """The same, of a table of 40 ids declared: the levels that would hold more than 10 runs
    are dense (io.rowindex.Dense), mapped ones too."""

    rows = 40
    mapped_dense_runs = 0

    @invariant()
    def dense_where_smaller(self):
        for level in self.index.levels:
            assert isinstance(level, rowindex.Runs) or len(level.values) == -(-self.rows // rowindex.DENSE_IDS) * rowindex.DENSE_IDS


DenseIndexAgainstDict.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestDenseIndexAgainstDict = DenseIndexAgainstDict.TestCase


def _held(level) -> bool:
    return isinstance(level, rowindex.Dense) and level.map is None


class HeldDenseIndexAgainstDict(DenseIndexAgainstDict):
    """The same, the index allowed to hold one dense level in memory (RowIndex.hold, as a budget
    gives it): merged into in place, read whole at open, never two held at once; a damaged
    page of a held level's file is found at open."""

    hold = 4 * 48  # the values of 40 ids in pages of 16

    @invariant()
    def holds_one_dense_level_at_most(self):
        held = [level for level in self.index.levels if _held(level)]
        assert sum(level.values.nbytes for level in held) <= self.hold
        assert all(level.check is None for level in held)
        assert self.index.current is (held[0] if held else None)  # lookups ask no level over it


HeldDenseIndexAgainstDict.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestHeldDenseIndexAgainstDict = HeldDenseIndexAgainstDict.TestCase


def test_a_write_in_id_order_is_a_run_a_segment():
    """A table loaded in id order holds a run for each segment, a scattered write a run a row."""
    index = RowIndex(ROWS)
    for s in range(100):
        index.put(np.arange(s * 256, (s + 1) * 256), (s << rowindex.SLOT_BITS) | np.arange(256, dtype=np.uint32))
    index.settle()
    assert len(index.main) == 100 and index.nbytes == 100 * rowindex.RUN_BYTES
    index.put(np.array([5, 700, 20_000]), (100 << rowindex.SLOT_BITS) | np.arange(3, dtype=np.uint32))
    index.settle()
    assert len(index.main) == 100 + 3 + 3  # each of the three rows cuts a run in two, and is one
    assert index.get(np.array([4, 5, 6, 25_599, 25_600])).tolist() == [4, 100 << 12, 6, (99 << 12) | 255, int(NONE)]


def test_a_mapped_levels_fence_and_crcs_are_the_page_caches_and_its_bit_a_block_counts_in_the_limit(tmp_path, monkeypatch):
    """A mapped level's fence and CRCs are mapped from its file as its runs are (read into
    memory, 12 bytes a block, they grew with the mapped runs, past the index's limit): memory
    holds a bit a block (checked or not), within mapped_bytes_bound, counted in the index's
    limit: a spill could not free it, and the runs in memory get the rest."""
    monkeypatch.setattr(rowindex, "FENCE", 1)  # a block a run
    index = RowIndex(ROWS, limit=2048)
    index.put(np.arange(0, 4000, 2), (1 << rowindex.SLOT_BITS) | np.arange(2000, dtype=np.uint32))  # 2,000 runs
    assert index.wants_spill()
    header = rowindex_file.write_file(index, tmp_path / "i", {}, [], index.plan())
    assert rowindex_file.take_runs(index, tmp_path / "i", header, 0)
    level = index.levels[0]
    assert all(isinstance(a, np.ndarray) and isinstance(a.base, np.memmap) for a in (level.fence, level.check.crcs, level.filter.check.crcs))
    pages = -(-2000 // rowindex.filter_blocks())
    assert index.nbytes == index.marks == 2000 // 8 + -(-pages // 8) <= rowindex.mapped_bytes_bound(ROWS)
    assert not index.wants_spill()
    # the runs in memory get what the bits leave of the limit: 60 runs pass half of that, not half the limit
    index.put(np.arange(10_000, 10_120, 2), (2 << rowindex.SLOT_BITS) | np.arange(60, dtype=np.uint32))
    assert 60 * rowindex.RUN_BYTES <= index.limit // 2 and index.wants_spill()
    assert index.get(np.array([0, 1, 3998])).tolist() == [1 << rowindex.SLOT_BITS, int(NONE), (1 << rowindex.SLOT_BITS) | 1999]
    assert level.check.checked.sum() == 2 and level.check.checked[[0, 1999]].all()  # the two blocks read, checked


def test_a_table_written_at_random_spills_dense_at_4_bytes_an_id(tmp_path):
    """Rows written in random order (as training writes them: a run a row, 16 bytes) spill to
    a dense level: 4 bytes an id declared on disk, a bit a page in memory, and a
    lookup reads the one page its id names."""
    n = 300_000
    index = RowIndex(n, limit=64 << 10)
    ids = np.random.default_rng(0).permutation(n)
    for s in range(0, n, 4096):
        index.put(ids[s:s + 4096], ((s // 4096) << rowindex.SLOT_BITS) | np.arange(len(ids[s:s + 4096]), dtype=np.uint32))
    header = rowindex_file.write_file(index, tmp_path / "i", {}, [], index.plan())
    assert header["dense"] and header["runs"] == n
    assert rowindex_file.take_runs(index, tmp_path / "i", header, 0) and isinstance(index.levels[0], rowindex.Dense)
    pages = -(-n // rowindex.DENSE_IDS)
    assert os.stat(tmp_path / "i").st_blocks * 512 <= 4 * n + 3 * 4096 + 4 * pages
    assert index.nbytes == -(-pages // 8)  # a bit a page: checked or not (its CRCs are mapped)
    want = np.empty(n, dtype=np.uint32)
    want[ids] = ((np.arange(n) // 4096) << rowindex.SLOT_BITS) | (np.arange(n) % 4096)
    fd = os.open(tmp_path / "i", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # no page of it mapped yet: all dropped
        asked = np.random.default_rng(1).permutation(pages)[:100] * rowindex.DENSE_IDS + 5  # 100 pages, one id each
        before = _disk_reads()
        assert (index.get(asked) == want[asked]).all()
        read = _disk_reads() - before
    finally:
        os.close(fd)
    assert read <= len(asked) * 4096 * 1.1, read / len(asked) / 4096  # (tmpfs counts no mapped reads: 0)
    assert (index.get(np.arange(n)) == want).all()


@pytest.mark.parametrize("held", [True, False])
def test_rows_moved_over_part_of_the_ids_stay_runs_where_a_dense_level_would_be_mapped(tmp_path, held):
    """Rows written at random over 40% of the ids: their runs take more than the ids' values
    would, so a spill writes them dense where the index may hold that in memory; where it
    would be mapped (every lookup a page of it), as runs with their filters, which a lookup of
    an id they do not hold passes over (3% of them) without reading a page of runs."""
    n = 1 << 18
    index = RowIndex(n, limit=64 << 10, hold=4 * n if held else 0)
    rng = np.random.default_rng(0)
    moved = rng.permutation(n)[: n * 2 // 5]
    for s in range(0, len(moved), 4096):
        index.put(moved[s:s + 4096], ((s // 4096) << rowindex.SLOT_BITS) | np.arange(len(moved[s:s + 4096]), dtype=np.uint32))
    header = rowindex_file.write_file(index, tmp_path / "i", {}, [], index.plan())
    assert rowindex_file.take_runs(index, tmp_path / "i", header, 0)
    level = index.levels[0]
    assert isinstance(level, rowindex.Dense if held else rowindex.Runs) and header.get("dense", False) == held
    want = np.full(n, rowindex.NONE, dtype=np.uint32)
    want[moved] = ((np.arange(len(moved)) // 4096) << rowindex.SLOT_BITS) | (np.arange(len(moved)) % 4096)
    assert (index.get(np.arange(n)) == want).all()
    if not held:
        others = np.setdiff1d(np.arange(n), moved)
        page = np.searchsorted(level.fence, others, side="right") - 1
        assert level.filter.may_hold(others, page).mean() < 0.05


def test_a_dense_level_is_merged_once_the_runs_over_it_hold_a_quarter_of_its_bytes(tmp_path):
    """A spill merges a dense level as a level of the runs its bytes would hold (a quarter of its
    ids), not of the ids it covers: the levels over it stay small enough for the page cache
    (counted by its ids, they grew to 113 MB over the bench-scale table's 136 MB)."""
    n = 4096
    index = RowIndex(n, limit=1024)
    index.put(np.random.default_rng(0).permutation(n), (1 << rowindex.SLOT_BITS) | np.arange(n, dtype=np.uint32) % 4000)
    header = rowindex_file.write_file(index, tmp_path / "i", {}, [], index.plan())
    assert header["dense"] and rowindex_file.take_runs(index, tmp_path / "i", header, 0)
    weight = n * 4 // rowindex.RUN_BYTES  # 1,024 runs' bytes; it covers 4,096 ids
    assert index.levels[0].weight == weight and len(index.levels[0]) == n
    scattered = np.arange(0, n, 4)  # a run each
    index.put(scattered[: weight // rowindex.GROWTH - 1], (2 << rowindex.SLOT_BITS) | np.arange(weight // rowindex.GROWTH - 1, dtype=np.uint32))
    assert index.plan() == 0
    index.put(scattered[weight // rowindex.GROWTH - 1: weight // rowindex.GROWTH], np.array([3 << rowindex.SLOT_BITS], dtype=np.uint32))
    assert index.plan() == 1


@pytest.mark.parametrize("held", [True, False])
def test_a_level_of_long_runs_is_kept_apart_from_the_scattered_runs_written_over_it(tmp_path, held):
    """A table loaded in id order (a run a segment, mapped), then rows written one at a time at
    random ids (as training moves them): the spills stack levels of those runs over the load's
    and merge them among themselves, where merging them into it cut its runs (a lookup of a row
    never moved then read a page of the merged level, its filters passing every id of its long
    runs). The load's level weighs its ids, and is merged once the runs over it weigh that
    over GROWTH (when the merge writes a dense level) where the index holds a dense level in
    memory; where it would map one, not at twice that; every lookup answers as a dict."""
    n, per = 1 << 18, 1024
    index = RowIndex(n, limit=4096, hold=4 * rowindex.DENSE_IDS * rowindex.dense_page_count(n) if held else 0)  # spills past 128 runs
    model = np.arange(n, dtype=np.int64)  # id -> place
    for s in range(n // per):
        index.put(np.arange(s * per, (s + 1) * per), (s << rowindex.SLOT_BITS) | np.arange(per, dtype=np.uint32))
    saves = 0

    def spill():
        nonlocal saves
        saves += 1
        k = index.plan()
        header = rowindex_file.write_file(index, tmp_path / f"i{saves}", {}, [], k)
        assert rowindex_file.take_runs(index, tmp_path / f"i{saves}", header, k)

    model = (model // per << rowindex.SLOT_BITS) | model % per
    spill()
    load = index.levels[-1]
    assert len(load) == n // per and load.covers == n and load.weight == n
    rng = np.random.default_rng(0)
    moved = 0

    def move():  # a segment of 100 rows at random ids, spilled where the index asks
        nonlocal moved
        ids = rng.choice(n, 100, replace=False)
        places = ((n // per + moved // 100) << rowindex.SLOT_BITS) | np.arange(100, dtype=np.uint32)
        index.put(ids, places)
        model[ids] = places
        moved += 100
        if index.wants_spill():
            spill()

    while moved * rowindex.GROWTH < load.weight // 2:
        move()
        assert index.levels[-1] is load and len(index.levels) <= rowindex.MAX_LEVELS
    assert saves > 100 and index.get(np.arange(n)).tolist() == model.tolist()
    if not held:  # a dense level would be mapped: every lookup would read a page of it
        while moved * rowindex.GROWTH < 2 * load.weight:
            move()
            assert index.levels[-1] is load
        assert index.get(np.arange(n)).tolist() == model.tolist()
        return
    while index.levels[-1] is load:  # the runs over it weigh its ids over GROWTH: merged into it
        move()
    assert moved * rowindex.GROWTH >= load.weight * 0.9
    assert index.get(np.arange(n)).tolist() == model.tolist()


def _not_mapped(find):
    """Runs.find, raising where the level is mapped."""
    def checked(self, ids):
        assert self.fence is None, "a mapped level was asked"
        return find(self, ids)
    return checked


def test_a_dense_level_held_in_memory_is_merged_into_in_place_and_read_whole_at_open(tmp_path, monkeypatch):
    """Where the index may hold it (RowIndex.hold), a dense level is in memory: counted in its
    bytes, merged into in place (the same values, no second copy, no read of the file it
    wrote), read whole and checked at open; kept current (a lookup asks no mapped level over
    it, and an open sets their runs in it); a page of its file damaged refuses the file at
    open; with no room, the same file is mapped."""
    n = 300_000
    dense = 4 * -(-n // rowindex.DENSE_IDS) * rowindex.DENSE_IDS
    index = RowIndex(n, limit=64 << 10, hold=dense)
    rng = np.random.default_rng(0)
    model = np.full(n, NONE, dtype=np.uint32)

    def put(ids, segment):
        places = (segment << rowindex.SLOT_BITS) | np.arange(len(ids), dtype=np.uint32)
        index.put(ids, places)
        model[ids] = places

    ids = rng.permutation(n)
    for s in range(0, n, 4096):
        put(ids[s:s + 4096], s // 4096)
    header = rowindex_file.write_file(index, tmp_path / "i1", {}, [], index.plan())
    assert header["dense"] and rowindex_file.take_runs(index, tmp_path / "i1", header, 0)
    held = index.levels[0]
    assert _held(held) and index.current is held and index.nbytes == dense
    put(np.sort(rng.choice(n, 40_000, replace=False)), 1000)  # over it: a level merged into it
    gone = rng.choice(n, 100, replace=False)
    index.put(gone, None)
    model[gone] = NONE
    k = len(index.levels)
    header = rowindex_file.write_file(index, tmp_path / "i2", {}, [], k)
    assert header["dense"] and rowindex_file.take_runs(index, tmp_path / "i2", header, k)
    assert index.levels == [index.levels[0]] and index.levels[0].values is held.values and index.nbytes == dense
    assert (index.get(np.arange(n)) == model).all()

    fresh = RowIndex(n, limit=64 << 10, hold=dense)
    assert rowindex_file.load_runs(fresh, tmp_path / "i2", header, {}) and _held(fresh.levels[0])
    assert (fresh.get(np.arange(n)) == model).all() and fresh.nbytes == dense
    mapped = RowIndex(n, limit=64 << 10, hold=dense - 1)
    assert rowindex_file.load_runs(mapped, tmp_path / "i2", header, {}) and not _held(mapped.levels[0])
    assert (mapped.get(np.arange(n)) == model).all() and mapped.nbytes < dense // 100 and mapped.current is None

    put(np.sort(rng.choice(n, 5_000, replace=False)), 1001)  # a level of runs over it, mapped
    over = rowindex_file.write_file(index, tmp_path / "i3", {}, [], 0)
    assert not over.get("dense") and rowindex_file.take_runs(index, tmp_path / "i3", over, 0)
    assert index.current is index.levels[1] and not _held(index.levels[0])
    saved = model.copy()
    put(np.sort(rng.choice(n, 100, replace=False)), 1002)
    with monkeypatch.context() as m:
        m.setattr(rowindex.Runs, "find", _not_mapped(rowindex.Runs.find))
        assert (index.get(np.arange(n)) == model).all()
        fresh = RowIndex(n, limit=64 << 10, hold=dense)
        assert rowindex_file.load_runs(fresh, tmp_path / "i3", over, {}) and fresh.current is fresh.levels[1]
        assert (fresh.get(np.arange(n)) == saved).all()
    raw = bytearray((tmp_path / "i3").read_bytes())
    raw[over["offsets"][0] + 9] ^= 1  # a byte of the first block of runs over the held level: the open reads it
    (tmp_path / "i3").write_bytes(bytes(raw))
    assert not rowindex_file.load_runs(RowIndex(n, limit=64 << 10, hold=dense), tmp_path / "i3", over, {})

    raw = bytearray((tmp_path / "i2").read_bytes())
    raw[header["offsets"][0] + 4096 * 7 + 5] ^= 1  # a byte of the eighth page of values
    (tmp_path / "i2").write_bytes(bytes(raw))
    assert not rowindex_file.load_runs(RowIndex(n, limit=64 << 10, hold=dense), tmp_path / "i2", header, {})


def _merge_peak(tmp_path, n: int) -> int:
    """Peak bytes (tracemalloc: numpy's arrays included) a full merge of a mapped level of ``n``
    runs, a run of recent over it, takes to write its file."""
    index = RowIndex(ROWS, limit=4096)
    index.put(np.arange(0, 2 * n, 2), (1 << rowindex.SLOT_BITS) | np.arange(n, dtype=np.uint32) % 4000)
    path = tmp_path / f"i{n}"
    header = rowindex_file.write_file(index, path, {}, [], 0)
    assert rowindex_file.take_runs(index, path, header, 0) and index.mapped
    index.put(np.array([n]), np.array([7], dtype=np.uint32))
    tracemalloc.start()
    try:
        header = rowindex_file.write_file(index, tmp_path / f"all{n}", {}, [], len(index.levels))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert header["runs"] == n
    return peak


def test_a_full_merge_takes_memory_of_a_few_pieces_whatever_the_index(tmp_path, monkeypatch):
    """A spill merging every mapped level streams them a piece of _CHUNK_RUNS runs at a time: its
    memory is a few pieces, and the fence and CRCs it writes (12 bytes a block of FENCE runs),
    not the level (a fence of views kept each piece's starts: 8 bytes a run, 195 MiB for 24M)."""
    monkeypatch.setattr(rowindex, "_CHUNK_RUNS", 8192)
    small, large = (_merge_peak(tmp_path, n) for n in (100_000, 400_000))
    blocks = 400_000 // rowindex.FENCE
    assert large - small < 12 * blocks + (64 << 10), (small, large)


def _read_chars() -> int:
    """Bytes this process has read by read(2) and the like (a mapped page is not counted)."""
    return int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("rchar:")))


def test_an_open_reads_a_mapped_level_by_its_header_and_a_damaged_block_raises_when_read(tmp_path):
    """Opening a level of 3.2 MB of runs reads its header, fence and blocks' CRCs (some KB),
    not its runs; a bit flipped in one block is found when a lookup first reads that block,
    and the other blocks still read as written."""
    n = 200_000
    index = RowIndex(ROWS, limit=4096)
    index.put(np.arange(0, 2 * n, 2), (1 << rowindex.SLOT_BITS) | np.arange(n, dtype=np.uint32) % 4000)
    path = tmp_path / "i"
    header = rowindex_file.write_file(index, path, {}, [np.arange(3)], index.plan())
    assert header["runs"] == n
    fresh = RowIndex(ROWS, limit=4096)
    before = _read_chars()
    assert rowindex_file.load_runs(fresh, path, header, {}) and fresh.mapped
    assert _read_chars() - before < n * rowindex.RUN_BYTES // 50
    data = bytearray(path.read_bytes())
    block = 300
    data[header["offsets"][1] + block * rowindex.FENCE * rowindex.RUN_BYTES + 7 * 8] ^= 4  # a start in block 300
    path.write_bytes(bytes(data))
    fresh = RowIndex(ROWS, limit=4096)
    assert rowindex_file.load_runs(fresh, path, header, {})
    elsewhere = np.array([0, 2 * 10 * rowindex.FENCE + 2, 2 * (n - 1)])  # blocks 0, 10 and the last
    assert fresh.get(elsewhere).tolist() == index.get(elsewhere).tolist()
    with pytest.raises(RowIndexDamagedError, match="block 300 of its level fails its CRC"):
        fresh.get(np.array([2 * block * rowindex.FENCE + 4]))
    with pytest.raises(RowIndexDamagedError):  # and again: never a place read from it
        fresh.get(np.array([2 * block * rowindex.FENCE + 4]))


def test_a_damaged_page_of_a_levels_filter_raises_when_read_and_a_level_without_one_reads_whole(tmp_path):
    """A bit flipped in a page of a mapped level's filters is found when a lookup first reads
    that page (never an id turned away by a damaged filter: it would read an older level's
    place); a file whose header names no filter (written before filters) is read as it was,
    every block asked."""
    n = 200_000
    index = RowIndex(ROWS, limit=4096)
    index.put(np.arange(0, 2 * n, 2), (1 << rowindex.SLOT_BITS) | np.arange(n, dtype=np.uint32) % 4000)
    path = tmp_path / "i"
    header = rowindex_file.write_file(index, path, {}, [], index.plan())
    ids = np.arange(0, 2 * n, 2)
    places = ((1 << rowindex.SLOT_BITS) | np.arange(n, dtype=np.uint32) % 4000).tolist()
    clean = path.read_bytes()
    data = bytearray(clean)
    page = 3  # of the filters: the blocks 3 x filter_blocks() ..
    data[header["offsets"][3] + page * 4096 + 100] ^= 1
    path.write_bytes(bytes(data))
    fresh = RowIndex(ROWS, limit=4096)
    assert rowindex_file.load_runs(fresh, path, header, {})
    first_block = page * rowindex.filter_blocks()
    assert fresh.get(ids[:FENCE]).tolist() == places[:FENCE]  # block 0: filter page 0
    with pytest.raises(RowIndexDamagedError, match="filter page 3 of its level fails its CRC"):
        fresh.get(ids[first_block * FENCE: first_block * FENCE + 3])

    path.write_bytes(clean)
    older = {k: v for k, v in header.items() if k != "filter_crc"}
    fresh = RowIndex(ROWS, limit=4096)
    assert rowindex_file.load_runs(fresh, path, older, {}) and fresh.levels[0].filter is None
    assert fresh.get(ids).tolist() == places and (fresh.get(ids + 1) == NONE).all()


def test_an_older_level_whose_bytes_are_another_files_is_not_that_level(tmp_path):
    """A header names its older levels by file name and runs, and a writer names each file by
    the token its header holds: another index file of as many runs copied over an older
    level's name (a store's directory restored in part from an older copy) is refused at
    open, never read as that level (its places are another index's)."""
    ids = np.arange(0, 200, 2)  # a run each
    under, named = tmp_path / "index-t-aaaa.bin", tmp_path / "index-t-bbbb.bin"
    index = RowIndex(ROWS, limit=64)
    index.put(ids, np.arange(len(ids), dtype=np.uint32))
    assert rowindex_file.take_runs(index, under, rowindex_file.write_file(index, under, {"token": "aaaa"}, [], 0), 0)
    index.put(np.array([1]), np.array([500], dtype=np.uint32))
    header = rowindex_file.write_file(index, named, {"token": "bbbb"}, [], 0)  # over the level of `under`
    assert header["levels"] == [[under.name, len(ids)]]
    other = RowIndex(ROWS, limit=64)
    other.put(ids, np.arange(len(ids), dtype=np.uint32) + 1000)  # as many runs, other places
    assert rowindex_file.write_file(other, tmp_path / "index-t-cccc.bin", {"token": "cccc"}, [], 0)["runs"] == len(ids)

    fresh = RowIndex(ROWS, limit=64)
    assert rowindex_file.load_runs(fresh, named, header, {})
    assert fresh.get(ids).tolist() == list(range(len(ids)))
    under.write_bytes((tmp_path / "index-t-cccc.bin").read_bytes())
    fresh = RowIndex(ROWS, limit=64)
    assert not rowindex_file.load_runs(fresh, named, header, {}) and not len(fresh.ids())


def _disk_reads() -> int:
    """Bytes this process has had read from the disk (mapped pages faulted in included)."""
    return int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("read_bytes:")))


def _mapped_level(tmp_path, n: int, declared: int = ROWS) -> RowIndex:
    """An index of ``n`` rows at the even ids 0 .. 2n - 2, a run each, mapped from its file."""
    index = RowIndex(declared, limit=4096)
    index.put(np.arange(0, 2 * n, 2), (1 << rowindex.SLOT_BITS) | np.arange(n, dtype=np.uint32) % 4000)
    path = tmp_path / "i"
    header = rowindex_file.write_file(index, path, {}, [], index.plan())
    assert rowindex_file.take_runs(index, path, header, index.plan()) and index.mapped
    return index


def _cold_lookup(index: RowIndex, ids: np.ndarray) -> tuple[np.ndarray, int]:
    """(places, bytes read from disk) of a lookup of ``ids``, the level's file out of the page cache."""
    fd = os.open(index.levels[0].map.filename, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the file's clean pages out of the page cache
        before = _disk_reads()
        got = index.get(ids)
        read = _disk_reads() - before
    finally:
        os.close(fd)
    if read == 0:
        pytest.skip("this file system does not count a mapped file's reads in /proc/self/io (tmpfs)")
    return got, read


def test_a_lookup_of_a_mapped_level_reads_one_page_an_id(tmp_path):
    """Ids scattered over a mapped level, its pages out of the page cache: a lookup reads one
    page of runs an id (the page its fence names, starts, lengths and places side by side),
    where the starts and the places in pages of their own took two, and the pages of the
    blocks' filters it asks (a sixteenth as many as the runs', kept by the page cache)."""
    n = 400_000
    index = _mapped_level(tmp_path, n)
    blocks = np.random.default_rng(0).permutation(n // rowindex.FENCE)[:200]
    asked = 2 * (blocks * rowindex.FENCE + 7)  # 200 blocks, one id each
    got, read = _cold_lookup(index, asked)
    assert got.tolist() == ((1 << rowindex.SLOT_BITS) | (asked // 2) % 4000).tolist()
    filter_pages = len(np.unique(blocks // rowindex.filter_blocks()))
    assert read <= (len(asked) + filter_pages) * 4096 * 1.1, read / len(asked) / 4096


def test_a_level_over_most_of_the_ids_is_looked_up_without_its_filter(tmp_path):
    """A mapped level whose runs cover more than FILTERED_IDS of the ids declared (rows moved
    over most of a table) is mapped without its filter, as a spill leaves it and as an open
    reads it: most ids asked are held, and the filter's page would be one more read each. Its
    lookups read one page an id and find every place; over a few of the ids (the test above)
    a level keeps its filter."""
    n = 400_000
    index = _mapped_level(tmp_path, n, declared=2 * n - 1)  # n of 2n - 1 ids covered
    assert index.levels[0].filter is None
    blocks = np.random.default_rng(0).permutation(n // rowindex.FENCE)[:200]
    asked = 2 * (blocks * rowindex.FENCE + 7)
    got, read = _cold_lookup(index, asked)
    assert got.tolist() == ((1 << rowindex.SLOT_BITS) | (asked // 2) % 4000).tolist()
    assert read <= len(asked) * 4096 * 1.1, read / len(asked) / 4096
    path = tmp_path / "i"
    for declared, filtered in ((2 * n - 1, False), (2 * n, True)):  # covering half the ids, the filter is asked
        fresh = RowIndex(declared, limit=4096)
        assert rowindex_file.load_runs(fresh, path, rowindex_file.read_file(path, {})[0], {})
        assert (fresh.levels[0].filter is not None) == filtered
        assert fresh.get(asked).tolist() == got.tolist() and (fresh.get(asked + 1) == NONE).all()


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=300), gaps=st.data(), deleted=st.data(),
       fence=st.sampled_from([1, 4, 8, 256]))
def test_a_blocks_filter_passes_every_id_its_runs_hold(lengths, gaps, deleted, fence):
    """Whatever the runs (of one id or long, a place or a deletion, blocks of any FENCE), a
    block's filter passes every id a run of that block holds: a lookup it turns away is one no
    run of the block answers (an id turned away wrongly would read an older level's place)."""
    gap = gaps.draw(st.lists(st.integers(0, 50), min_size=len(lengths), max_size=len(lengths)))
    start = np.cumsum(np.array(gap) + np.concatenate(([0], lengths[:-1]))).astype(np.int64) + 10**9
    loc = np.where(deleted.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths))), NONE,
                   np.arange(len(lengths), dtype=np.uint32) * 64).astype(np.uint32)
    runs = rowindex.Runs(start, np.array(lengths, dtype=np.uint32), loc)
    old = rowindex.FENCE
    rowindex.FENCE = fence
    try:
        filters = rowindex.Filter(rowindex.block_filters(runs))
        held = np.concatenate([np.arange(a, a + n) for a, n in zip(start.tolist(), lengths)])  # deletions' ids too
        block = (np.searchsorted(runs.start, held, side="right") - 1) // fence
        assert filters.may_hold(held, block).all()
    finally:
        rowindex.FENCE = old


def test_a_lookup_of_ids_a_mapped_level_does_not_hold_reads_its_filter_not_its_runs(tmp_path):
    """Ids no run of a mapped level holds (the odd ids between its rows): the blocks' filters
    (8 bits a run) turn away all but a few percent, so that the lookup reads the filter's pages
    and almost none of the runs' (each of a level over the one holding an id cost a page a
    lookup); the ids it holds all pass (a filter never turns away an id its block holds)."""
    n = 400_000
    index = _mapped_level(tmp_path, n)
    level = index.levels[0]
    blocks = np.random.default_rng(1).permutation(n // rowindex.FENCE)[:1000]
    absent = 2 * (blocks * rowindex.FENCE + 7) + 1
    got, read = _cold_lookup(index, absent)
    assert (got == NONE).all()
    runs_read = int(level.check.checked.sum())  # blocks of runs a lookup read (their CRCs checked)
    assert runs_read <= 0.06 * len(absent), runs_read
    filter_pages = len(np.unique(blocks // rowindex.filter_blocks()))
    assert read <= (filter_pages + runs_read) * 4096 * 1.1, (read // 4096, filter_pages, runs_read)
    present = np.arange(0, 2 * n, 2)
    assert level.filter.may_hold(present, np.arange(n) // rowindex.FENCE).all()
    assert index.get(present[::97]).tolist() == ((1 << rowindex.SLOT_BITS) | (present[::97] // 2) % 4000).tolist()


def test_a_lookup_of_many_ids_asks_for_a_few_pages_of_a_mapped_level_at_a_time(tmp_path, monkeypatch):
    """A lookup of more ids than LOOKUP_PAGES over a mapped level asks the kernel for their
    pages a part at a time (all at once, under a memory limit, they were reclaimed before they
    were read), and finds every place."""
    monkeypatch.setattr(rowindex, "LOOKUP_PAGES", 16)
    n = 50_000
    index = RowIndex(ROWS, limit=4096)
    index.put(np.arange(0, 2 * n, 2), (1 << rowindex.SLOT_BITS) | np.arange(n, dtype=np.uint32) % 4000)
    header = rowindex_file.write_file(index, tmp_path / "i", {}, [], index.plan())
    assert rowindex_file.take_runs(index, tmp_path / "i", header, index.plan()) and index.mapped
    asked = []
    real = rowindex.will_need
    monkeypatch.setattr(rowindex, "will_need", lambda base, offsets, width: (asked.append(len(offsets)), real(base, offsets, width))[1])
    ids = np.sort(np.random.default_rng(1).choice(2 * n, 3000, replace=False))
    got = index.get(ids)
    assert got.tolist() == [((1 << rowindex.SLOT_BITS) | (i // 2) % 4000) if i % 2 == 0 else int(NONE) for i in ids.tolist()]
    assert len(asked) >= 3000 // 16 and max(asked) <= 16


# -- a writer killed at any point -----------------------------------------------------------------
LIMIT = 400  # the child's index runs: 25 at most, so that it spills all the time


class Child:
    def __init__(self, path: str):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "index_writer.py"), path, str(ROWS), str(LIMIT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "ready\n"

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, **cmd) -> None:
        self.send(**cmd)
        line = self.proc.stdout.readline()
        assert line == "ok\n", f"the writer answered {line!r}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


class KilledWriterAgainstDict(RuleBasedStateMachine):
    """A writer in another process, its index spilling, killed (kill -9) at any point, even
    within a publish: it reopens as the last publish that returned, or as the one under way."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.path = self.tmp.name
        self.child = Child(self.path)
        self.model: dict[int, float] = {}
        self.published: dict[int, float] = {}
        self.version = 0

    def teardown(self):
        self.child.kill()
        self.tmp.cleanup()

    def _put(self, ids, wait=True):
        self.version += 1
        rows = [[float(i % 1000), float(self.version)] for i in ids]
        (self.child.ask if wait else self.child.send)(op="put", ids=ids, rows=rows)
        self.model.update({i: float(self.version) for i in ids})

    @rule(ids=write_ids)
    def put(self, ids):
        self._put(ids)

    @rule(ids=write_ids)
    def delete(self, ids):
        self.child.ask(op="delete", ids=ids)
        for i in ids:
            self.model.pop(i, None)

    @rule()
    def publish(self):
        self.child.ask(op="publish")
        self.published = dict(self.model)

    @rule(ids=write_ids, publishing=st.booleans(), after=st.floats(0, 0.03), damage=st.integers(0, 3), at=st.floats(0, 1))
    def kill_9(self, ids, publishing, after, damage, at):
        """A write (and a publish) sent, the writer killed ``after`` seconds later, done or not;
        then, where ``damage`` is 1 or 2, a bit of its index files' runs flipped, or the files
        cut there (a torn or damaged file: the open replays the segments instead)."""
        before = dict(self.published)
        self._put(ids, wait=False)
        if publishing:
            self.child.send(op="publish")
        time.sleep(after)
        self.child.kill()
        if damage in (1, 2):
            damage_the_index_files(Path(self.path), at, cut=damage == 2)
        b = open_writer(self.path, ROWS, LIMIT)
        try:
            stored = b.stored_ids("t").tolist()
            rows, found = b.get_rows("t", np.array(stored, dtype=np.int64))
        finally:
            b.close(save_index=bool(self.version % 2))
        now = {i: float(v) for i, v in zip(stored, rows[:, 1].tolist())}
        assert found.all() and (rows[:, 0] == np.array(stored) % 1000).all()
        assert now == before or publishing and now == self.model
        self.model = dict(now)
        self.published = dict(now)
        self.child = Child(self.path)

    @precondition(lambda self: self.version % 3 == 0)
    @invariant()
    def index_files_are_few(self):
        # the one LMDB names and the one the writer maps, and maybe one being written
        assert len(list(Path(self.path).glob("index-*"))) <= 3


def damage_the_index_files(path: Path, at: float, cut: bool) -> None:
    """Flip a bit of the runs of each index file at ``path`` holding runs (``at``: where, from
    0 to 1, in its starts), or cut the file there."""
    for f in path.glob("index-*.bin"):
        got = rowindex_file.read_file(f, {})
        if got is None or not got[0]["runs"]:
            continue
        header = got[0]
        pos = header["offsets"][len(header["counts"])] + int(at * (header["runs"] * rowindex.RUN_BYTES - 1))
        data = bytearray(f.read_bytes())
        data[pos] ^= 1
        f.write_bytes(bytes(data[:pos] if cut else data))


KilledWriterAgainstDict.TestCase.settings = settings(max_examples=6, stateful_step_count=20, deadline=None)
TestKilledWriterAgainstDict = KilledWriterAgainstDict.TestCase


def _put_random(b, rng, step: int, n: int) -> None:
    """Write up to ``n`` rows of table t at random ids, each of value ``step``."""
    ids = np.unique(rng.integers(0, ROWS, n))
    b.put_rows([("t", ids, np.full((len(ids), DIM), step, dtype=np.float32))])


def test_recovery_replays_only_what_came_after_the_index_last_named(tmp_path, monkeypatch):
    """A writer whose index spilled (mapped from its files) and was saved and named at a
    publish, then killed: the next open maps those files and replays only the segments written
    after the save."""
    monkeypatch.setattr(rowlog, "SAVE_ROWS", 64)
    monkeypatch.setattr(rowlog, "_SAVED_BYTES_A_ROW", 1 << 30)  # saves every SAVE_ROWS, whatever the bookkeeping
    b = open_writer(str(tmp_path), ROWS, LIMIT)
    rng = np.random.default_rng(0)
    for step in range(12):
        _put_random(b, rng, step, 16)
    b.publish()  # names the last save
    log = b._logs["t"]
    assert log.index.mapped and b._index_named["t"] == b._index_current["t"]
    named = tmp_path / rowindex_file.file_name("index-" + "t".encode().hex(), b._index_named["t"])
    applied = rowindex_file.read_file(named, {})[0]["applied"]
    b.put_rows([("t", np.array([7, 8]), np.full((2, DIM), 99, dtype=np.float32))])
    b.publish()
    want = b.stored_ids("t")
    b.close(save_index=False)  # as after kill -9: nothing saved at close
    replayed = []
    real = rowlog.RowLog.replay
    monkeypatch.setattr(rowlog.RowLog, "replay", lambda log, mem, values: (replayed.extend(v[0] for v in values), real(log, mem, values))[1])
    b = open_writer(str(tmp_path), ROWS, LIMIT)
    try:
        assert replayed and min(replayed) == applied + 1  # only the segments after the named save
        assert b.stored_ids("t").tolist() == want.tolist()
        assert b.get_rows("t", np.array([7, 8]))[0][:, 0].tolist() == [99, 99]
    finally:
        b.close()


def test_a_spill_between_saves_writes_its_runs_alone_and_saves_grow_apart_with_their_bookkeeping(tmp_path, monkeypatch):
    """A save writes the segments' bookkeeping whole (an entry and the live bits of its slots a
    segment): a writer saves once the rows applied since pass SAVE_ROWS and that bookkeeping's
    bytes over _SAVED_BYTES_A_ROW, and the spills its runs' limit asks for meanwhile write their
    runs alone, a level the next save names (the 200M x 16 table's 40 MB of bookkeeping was
    written by every spill). Killed between saves, the writer reopens from the last one, every
    row there."""
    monkeypatch.setattr(rowlog, "SAVE_ROWS", 64)
    writes = []  # (a save, rows applied since the last save, the bookkeeping's bound then)
    real = rowlog.write_index
    monkeypatch.setattr(rowlog, "write_index", lambda log, *a, saved=True, **k: (writes.append(
        (saved, log.unsaved, log.bookkeeping_bytes() // rowlog._SAVED_BYTES_A_ROW)), real(log, *a, saved=saved, **k))[1])
    b = open_writer(str(tmp_path), ROWS, LIMIT)
    rng = np.random.default_rng(5)
    try:
        for step in range(60):
            _put_random(b, rng, step, 16)
        saves = [(unsaved, bound) for saved, unsaved, bound in writes if saved]
        assert saves and len(writes) > 2 * len(saves), writes  # spills between the saves
        assert all(bound > rowlog.SAVE_ROWS and unsaved >= bound for unsaved, bound in saves), saves
        b.publish()
        want = b.stored_ids("t")
        rows, _ = b.get_rows("t", want)
    finally:
        b.close(save_index=False)  # as after kill -9
    b = open_writer(str(tmp_path), ROWS, LIMIT)
    try:
        assert b.stored_ids("t").tolist() == want.tolist()
        assert np.array_equal(b.get_rows("t", want)[0], rows)
    finally:
        b.close()


def test_spills_write_about_what_changed(tmp_path, monkeypatch):
    """A writer whose index spills again and again writes a level of what changed and merges
    the levels geometrically: the runs its spills write stay a few times the rows written
    (rewriting every run at each spill wrote 17 times them here, and more the more rows),
    and its levels stay few."""
    written = []
    real = rowindex_file.write_file
    monkeypatch.setattr(rowindex_file, "write_file", lambda *a: (h := real(*a), written.append(h["runs"]))[0])
    per_segment = rowlog.rows_per_segment(4 * DIM, ROWS)  # full segments: no collection moves the rows
    b = open_writer(str(tmp_path), ROWS, 4 * per_segment * rowindex.RUN_BYTES)  # spills every other write
    rng = np.random.default_rng(2)
    rows, every = 0, []
    try:
        for step in range(100):
            ids = np.unique(rng.integers(0, ROWS, per_segment))
            b.put_rows([("t", ids, np.full((len(ids), DIM), step, dtype=np.float32))])
            rows += len(ids)
            every.append(ids)
        log = b._logs["t"]
        assert len(written) >= 30 and sum(written) < 6 * rows, (len(written), sum(written) / rows)
        assert 1 < len(log.index.levels) <= rowindex.MAX_LEVELS
        assert b.stored_ids("t").tolist() == np.unique(np.concatenate(every)).tolist()
        rows_read, found = b.get_rows("t", every[-1])
        assert found.all() and (rows_read == 99).all()
    finally:
        b.close()


def test_replay_at_open_stays_within_the_limit(tmp_path, monkeypatch):
    """An open that replays many segments (no saved index) into an index of a small limit
    applies a few at a time and spills as it goes: memory never holds more than the limit
    (it held every run replayed, merged in memory)."""
    per_segment = rowlog.rows_per_segment(4 * DIM, ROWS)
    b = open_writer(str(tmp_path), ROWS, 1 << 30)
    rng = np.random.default_rng(3)
    for step in range(40):
        ids = np.unique(rng.integers(0, ROWS, per_segment))
        b.put_rows([("t", ids, np.full((len(ids), DIM), step, dtype=np.float32))])
    b.publish()
    want = b.stored_ids("t")
    b.close(save_index=False)
    held = []
    real = rowlog.RowLog.apply
    monkeypatch.setattr(rowlog.RowLog, "apply", lambda log, segments, **k: (real(log, segments, **k), held.append(log.index.nbytes))[0])
    limit = 8 * per_segment * rowindex.RUN_BYTES
    b = open_writer(str(tmp_path), ROWS, limit)
    try:
        assert len(held) > 8 and max(held) <= limit
        assert b._logs["t"].index.mapped
        assert b.stored_ids("t").tolist() == want.tolist()
    finally:
        b.close()


def test_recovery_replays_about_save_rows_at_most(tmp_path, monkeypatch):
    """A writer whose index stays in memory saves it once enough rows were applied since: after
    kill -9 an open replays about that many (it replayed every row written since the last close)."""
    monkeypatch.setattr(rowlog, "SAVE_ROWS", 500)
    b = open_writer(str(tmp_path), ROWS, 1 << 30)
    rng = np.random.default_rng(4)
    for step in range(40):
        _put_random(b, rng, step, 64)
        b.publish()
    assert not b._logs["t"].index.mapped
    want = b.stored_ids("t")
    b.close(save_index=False)  # as after kill -9
    replayed = []
    real = rowlog.RowLog.apply
    monkeypatch.setattr(rowlog.RowLog, "apply", lambda log, segments, **k: (replayed.extend(len(v[2]) for v in segments), real(log, segments, **k))[1])
    b = open_writer(str(tmp_path), ROWS, 1 << 30)
    try:
        assert sum(replayed) < 500 + 64
        assert b.stored_ids("t").tolist() == want.tolist()
    finally:
        b.close()


# -- the budget -------------------------------------------------------------------------------
def test_a_table_of_a_billion_rows_opens_and_its_index_grows_with_the_rows_written(tmp_path):
    """10^9 declared rows under a 256 MiB budget: the index is charged half a sixteenth of it for
    its runs and the most its segments' entries can take (it was 4 bytes a declared row:
    refused), holds nothing until rows are written, then about a run per row written, within
    what it was charged."""
    from tierstore import TableSpec, TieredStore
    with TieredStore(tmp_path, [TableSpec("t", 10**9, 16)], memory_budget="256MiB", device="cpu") as s:
        part = s.memory().parts["row_index"]
        assert part.bytes == (256 << 20) // 32 + rowlog.segment_bytes_bound(10**9, 64) < (256 << 20) // 3
        assert part.used_bytes < 64 << 10
        ids = np.unique(np.random.default_rng(0).integers(0, 10**9, 5000))
        s.write("t", ids, np.ones((len(ids), 16), dtype=np.float32))
        s.flush()
        part = s.memory().parts["row_index"]
        assert len(ids) * rowindex.RUN_BYTES <= part.used_bytes <= part.bytes
    assert sum(f.stat().st_blocks * 512 for f in tmp_path.glob("index-*")) < 1 << 20  # the saved index: its runs only


def test_an_index_past_its_limit_is_mapped_and_memory_stays_within_it(tmp_path):
    """A writer whose runs pass their limit maps them from its file: what it holds in memory
    stays within the limit (and the segments' entries), whatever it wrote."""
    limit = 4096
    b = open_writer(str(tmp_path), ROWS, limit)
    rng = np.random.default_rng(1)
    try:
        for step in range(40):
            _put_random(b, rng, step, 64)
            log = b._logs["t"]
            assert log.index.nbytes <= limit
        assert log.index.mapped and sum(len(level) for level in log.index.levels) > limit // rowindex.RUN_BYTES
        assert b.index_bytes() == log.index.nbytes + log.segment_bytes() <= limit + rowlog.SEGMENT_ENTRY_BYTES * len(log.seq)
    finally:
        b.close()


def test_a_spill_that_fails_leaves_the_write_committed_and_the_index_in_memory(tmp_path, monkeypatch):
    """The index file cannot be written (a full disk, injected): the write that made the
    index pass its limit still returns, its rows read back, and the index stays in memory."""
    import errno
    import warnings

    b = open_writer(str(tmp_path), ROWS, 256)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(rowindex_file, "write_file", full)
    ids = np.arange(0, 4000, 2)  # a run a row: past the limit
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b.put_rows([("t", ids, np.full((len(ids), DIM), 3, dtype=np.float32))])
        assert any("could not write the row index" in str(w.message) for w in caught)
        log = b._logs["t"]
        assert not log.index.mapped and log.index.wants_spill()
        rows, found = b.get_rows("t", ids)
        assert found.all() and (rows == 3).all()
    finally:
        monkeypatch.undo()
        b.publish()  # the disk has room again: the spill goes through
        assert b._logs["t"].index.mapped
        b.close()


@pytest.mark.parametrize("writes", ["train", "put"])
def test_bench_index_writes_kills_recovers_and_reports(tmp_path, capsys, writes):
    """`tierstore bench index`, small: its writer process (training, or store.write) is killed,
    the store recovers with every row flushed, trains and reopens."""
    from tierstore.tools.cli import main
    main(["bench", "index", "--declared-rows", "1000000000", "--written-rows", "3000", "--steps", "1", "--batch", "256",
          "--budget", "256MiB", "--dir", str(tmp_path), "--writes", writes])
    out = capsys.readouterr().out
    assert "rows stored as flushed" in out and "last million's write / first's: 1.00x" in out
    assert "memory by part after the writes, MiB used/given  ddr" in out and "row_index" in out
