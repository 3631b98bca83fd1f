"""The log row layout (io/rowlog.py) against a plain model and against the keyed layout.

Segments are made small (a few slots) so a few dozen operations cross every path: many
segments, collection of the emptiest, tombstones merged and dropped, a reader that falls
behind and finds segments gone, reopening from the segments alone; and a writer that
publishes (the store's flush), whose readers and next writer see the last publish."""
from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierstore.io import StoreCorruptError, liveslots, lmdb_backend, lmdb_log, lmdb_map, rowindex, rowlog
from tierstore.io.lmdb_backend import LmdbBackend

N, DIM = 40, 3


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    # 4 slots a segment (the slot is 3 float32 and a step): every path within a few writes
    monkeypatch.setattr(rowlog, "SEGMENT_BYTES", 4 * (4 * DIM + 8))
    monkeypatch.setattr(rowlog, "MIN_SEGMENT_ROWS", 1)
    monkeypatch.setattr(rowlog, "_MIN_DEAD", 2)
    monkeypatch.setattr(rowlog, "MAX_TOMBSTONE_SEGMENTS", 3)
    monkeypatch.setattr(lmdb_log, "_ADVISED_READ", 1)  # every read as a large one: direct where asked


def open_backend(path, layout, readonly=False, direct=False, publish_at_flush=False, index_limit=None, index_hold=0, spare=None):
    old = lmdb_backend.NEW_TABLE_LAYOUT
    lmdb_backend.NEW_TABLE_LAYOUT = layout
    try:
        b = LmdbBackend(path, readonly=readonly, publish_at_flush=publish_at_flush, spare=spare)
        if index_limit is not None:  # its runs spill to the index file past this, a dense level held in memory
            b.limit_index({"t": index_limit}, {"t": index_hold})
        if direct:
            b.read_directly(True, "the test asks")
            if not b.read_path.startswith("io_uring"):
                b.close()
                pytest.skip(f"this system refuses direct reads: {b.read_path}")
        if not readonly:
            b.write_meta({}, new_tables={"t": (True, N)})
        b.open_table("t", DIM, last_use=True, create=False, num_rows=N)
    finally:
        lmdb_backend.NEW_TABLE_LAYOUT = old
    return b


ids_st = st.lists(st.integers(0, N - 1), min_size=1, max_size=12, unique=True).map(sorted)


class LogAgainstModel(RuleBasedStateMachine):
    """Every operation on a log table and on a keyed one; both must read as the model."""

    DIRECT = False  # the log table's row reads through io.direct

    def __init__(self):
        super().__init__()
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.model: dict[int, tuple[np.ndarray, int]] = {}
        self.writers = {layout: open_backend(f"{self.dir}/{layout}", layout, direct=self.DIRECT and layout == "log")
                        for layout in ("log", "keyed")}
        self.reader = None  # a readonly log backend of its own index, read only now and then
        self.version = 0
        self.old_index = None  # the bytes of an index saved earlier
        self.places: dict[int, int] = {}  # where a read found each id (get_rows's places), stale or not by now
        self.places_from = None  # the writer whose reads found them: a hint is its backend's alone

    def teardown(self):
        for b in [*self.writers.values(), self.reader]:
            if b is not None:
                b.close()
        self.tmp.cleanup()

    @rule(ids=ids_st, step=st.integers(0, 20), hinted=st.booleans())
    def put(self, ids, step, hinted):
        """``hinted``: with the places reads found (read_places), which writes, collections,
        deletes and reopens may have made stale since: the live counts stay right."""
        self.version += 1
        rows = np.array([[i, self.version, step] for i in ids], dtype=np.float32)
        steps = np.full(len(ids), step, dtype=np.int64)
        known = self.places if self.places_from is self.writers["log"] else {}
        places = {"t": np.array([known.get(i, -1) for i in ids], dtype=np.int64)} if hinted else None
        for b in self.writers.values():
            b.put_rows([("t", np.array(ids), rows)], last_use={"t": steps}, places=places)
        for i, r in zip(ids, rows):
            self.model[i] = (r, step)

    @rule(ids=ids_st)
    def read_places(self, ids):
        places = np.zeros(len(ids), dtype=np.int64)
        found = self.writers["log"].get_rows("t", np.array(ids), places=places)[1]
        assert ((places >= 0) == found).all()
        if self.places_from is not self.writers["log"]:
            self.places, self.places_from = {}, self.writers["log"]
        self.places.update(zip(ids, places.tolist()))

    @rule(ids=ids_st)
    def delete(self, ids):
        counts = {layout: b.delete_rows("t", np.array(ids)) for layout, b in self.writers.items()}
        assert set(counts.values()) == {sum(i in self.model for i in ids)}
        for i in ids:
            self.model.pop(i, None)

    @rule(cutoff=st.integers(0, 20))
    def sweep_all(self, cutoff):
        expect = sum(step <= cutoff for _, step in self.model.values())
        for b in self.writers.values():
            assert b.sweep("t", cutoff, budget=10 * N) == expect
        self.model = {i: v for i, v in self.model.items() if v[1] > cutoff}

    @rule(saved=st.booleans())
    def reopen_writer(self, saved):
        """Closed (its index saved) or crashed after its last commit (not saved): the reopened
        writer starts from the last index saved, if LMDB still names it, and replays the rest."""
        self.writers["log"].close(save_index=saved)
        self.writers["log"] = open_backend(f"{self.dir}/log", "log", direct=self.DIRECT)

    @rule()
    def keep_a_copy_of_the_saved_index(self):
        files = list(Path(self.dir, "log").glob("index-*.bin"))
        if files:
            self.old_index = files[0].read_bytes()

    @precondition(lambda self: self.old_index is not None)
    @rule()
    def put_back_an_older_saved_index_and_reopen(self):
        """A saved index LMDB no longer names (a later close saved another) is never applied."""
        self.writers["log"].close(save_index=False)
        for f in Path(self.dir, "log").glob("index-*.bin"):
            f.write_bytes(self.old_index)
        self.writers["log"] = open_backend(f"{self.dir}/log", "log", direct=self.DIRECT)

    @rule()
    def open_reader(self):
        if self.reader is not None:
            self.reader.close()
        self.reader = open_backend(f"{self.dir}/log", "log", readonly=True, direct=self.DIRECT)

    @precondition(lambda self: self.reader is not None)
    @rule()
    def reader_reads(self):
        self.check(self.reader)

    @invariant()
    def writers_read_as_the_model(self):
        for b in self.writers.values():
            self.check(b)

    @invariant()
    def live_counts_are_the_rows_the_index_places(self):
        live_counts_match_the_index(self.writers["log"])

    def check(self, b):
        reads_as(b, self.model)


def reads_as(b, model):
    every = np.arange(N)
    rows, found = b.get_rows("t", every)
    assert found.tolist() == [i in model for i in range(N)]
    for i in np.flatnonzero(found):
        assert rows[i].tolist() == model[i][0].tolist(), i
    assert b.stored_ids("t").tolist() == sorted(model)
    assert b.get_last_use("t", every).tolist() == [model[i][1] if i in model else -1 for i in range(N)]
    assert b.table_stats()["t"] == len(model)


def live_counts_match_the_index(b):
    """Each segment's live count is the rows the index places in it (what a collection picks
    its victims by, and what says a segment is empty, to be deleted), and its live bits are
    the slots the index places rows in (what a collection copies)."""
    log = b._logs["t"]
    places = log.index.get(log.index.ids())
    assert (places != rowlog.NONE).all()
    segs = (places >> rowlog._SLOT_BITS).astype(np.int64)
    counts = np.bincount(segs, minlength=len(log.live))
    assert counts.tolist() == log.live.tolist()
    assert log.live_rows == len(places)
    want = np.zeros((len(log.seq), log.bits.slots), dtype=bool)
    want[segs, (places & (rowlog.MAX_SLOTS - 1)).astype(np.int64)] = True
    assert (np.unpackbits(log.bits.rows[:len(log.seq)], axis=1, bitorder="little").view(bool) == want).all()


LogAgainstModel.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLogAgainstModel = LogAgainstModel.TestCase


class DirectLogAgainstModel(LogAgainstModel):
    DIRECT = True


DirectLogAgainstModel.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestDirectLogAgainstModel = DirectLogAgainstModel.TestCase


class PublishedLogAgainstModel(LogAgainstModel):
    """A writer that publishes (the store's flush): it reads as everything it wrote, its
    readers as its last publish, and a writer reopened after a close or a crash finds the
    last publish. Segments retired between publishes stay until the next one."""

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name
        self.model: dict[int, tuple[np.ndarray, int]] = {}
        self.published = {}
        self.writers = {"log": self.open_writer()}
        self.reader = None
        self.version = 0
        self.old_index = None
        self.places, self.places_from = {}, None

    INDEX_LIMIT = None
    INDEX_HOLD = 0

    def open_writer(self):
        return open_backend(f"{self.dir}/log", "log", direct=self.DIRECT, publish_at_flush=True, index_limit=self.INDEX_LIMIT,
                            index_hold=self.INDEX_HOLD)

    @rule()
    def publish(self):
        self.writers["log"].publish()
        self.published = copy.deepcopy(self.model)

    @rule(saved=st.booleans())
    def reopen_writer(self, saved):
        self.writers["log"].close(save_index=saved)
        self.writers["log"] = self.open_writer()
        self.model = copy.deepcopy(self.published)

    @precondition(lambda self: self.old_index is not None)
    @rule()
    def put_back_an_older_saved_index_and_reopen(self):
        self.writers["log"].close(save_index=False)
        for f in Path(self.dir, "log").glob("index-*.bin"):
            f.write_bytes(self.old_index)
        self.writers["log"] = self.open_writer()
        self.model = copy.deepcopy(self.published)

    @precondition(lambda self: self.reader is not None)
    @rule()
    def reader_reads(self):
        reads_as(self.reader, self.published)


PublishedLogAgainstModel.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPublishedLogAgainstModel = PublishedLogAgainstModel.TestCase


class SpilledLogAgainstModel(PublishedLogAgainstModel):
    """The same, the writer's index limited to a few runs: it spills to its file (mapped), which
    a publish names, all the time."""

    INDEX_LIMIT = 160  # 10 runs


SpilledLogAgainstModel.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestSpilledLogAgainstModel = SpilledLogAgainstModel.TestCase


class HeldLogAgainstModel(SpilledLogAgainstModel):
    """The same, the writer's index allowed to hold a dense level in memory (its 40 ids' values
    in a page): the levels past a run for every four ids are dense, and held."""

    INDEX_HOLD = 4 * rowindex.DENSE_IDS

    @invariant()
    def holds_what_it_may(self):
        index = self.writers["log"]._logs["t"].index
        held = [level for level in index.levels if isinstance(level, rowindex.Dense) and level.map is None]
        assert sum(level.values.nbytes for level in held) <= self.INDEX_HOLD
        assert index.nbytes >= sum(level.values.nbytes for level in held)


HeldLogAgainstModel.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestHeldLogAgainstModel = HeldLogAgainstModel.TestCase


def test_overwrites_keep_the_log_within_its_spare_room(tmp_path, monkeypatch):
    """Rewriting the same rows over and over: collection keeps dead slots near the spare room
    of the live rows (SPARE, or the backend's) and the segments few, whatever the number of
    writes; more room, fewer rows copied."""
    copied = []
    live_slots = lmdb_log.LogTables._live_slots
    monkeypatch.setattr(lmdb_log.LogTables, "_live_slots", lambda *a: (got := live_slots(*a), copied.append(len(got[0])))[0])
    for spare in (None, 1.0):
        b = open_backend(tmp_path / f"s{spare}", "log", spare=spare)
        copied.clear()
        rng = np.random.default_rng(0)
        for step in range(300):
            ids = np.sort(rng.choice(N, 8, replace=False))
            b.put_rows([("t", ids, np.full((8, DIM), step, dtype=np.float32))], last_use={"t": np.full(8, step)})
        log = b._logs["t"]
        assert log.spare == (rowlog.SPARE if spare is None else spare)
        assert log.dead_slots <= log.spare * log.live_rows + log.per_segment  # 19 of 40 live, 32 of 40 at 1.0
        assert log.per_segment == 4
        assert log.index_bytes() <= rowlog.index_bytes_bound(N, log.slot_bytes)  # what the memory budget charges
        assert len(log._index) <= 2 * (-(-log.live_rows // log.per_segment)) + 16
        b.close()
        if spare is None:
            at_default = sum(copied)
    assert log.dead_slots > rowlog.SPARE * log.live_rows  # the room given is used
    assert 0 < sum(copied) < at_default  # 89 rows copied against 617


def _churn(log, rng, segments: int, hot: int) -> None:
    """Apply ``segments`` segments of random ids of the ``hot`` first ones to ``log``, as a
    writer does (its entries reserved first, emptied segments forgotten), a lookup's view
    taken between (so the next allocation copies seq and offset)."""
    seq = log.applied
    for _ in range(segments // 64):
        batch = [(seq + i + 1, rowlog.ROWS, np.sort(rng.choice(hot, log.per_segment, replace=False)), -1) for i in range(64)]
        seq += 64
        log.reserve(64)
        log.apply(batch)
        for emptied in log.emptied:
            log.forget(emptied)
        log.emptied.clear()
        log.view()


def test_what_the_index_holds_is_what_it_reports(tmp_path):
    """A RowLog's memory, traced by tracemalloc, is what index_bytes() reports (what the budget's
    row_index part shows as used), and its segments' entries take at most SEGMENT_ENTRY_BYTES
    each. A dict of seq -> entry and lists of Python ints held half as much again as was reported."""
    import gc
    import tracemalloc
    from tierstore.io.codecs import RowCodec
    _churn(rowlog.RowLog(RowCodec(DIM), 10_000, last_use=False, folder=tmp_path), np.random.default_rng(1), 640, 1_000)  # numpy's lazy imports
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.take_snapshot()
        log = rowlog.RowLog(RowCodec(DIM), 200_000, last_use=False, folder=tmp_path)
        _churn(log, np.random.default_rng(0), 40_000, 40_000)
        gc.collect()
        held = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    segments = log.index_bytes() - log.index.nbytes
    assert len(log.seq) > 10_000 and len(log._index) < len(log.seq)  # many entries, some of them freed and reused
    assert log.index_bytes() // 2 < held <= 1.05 * log.index_bytes()  # what numpy's arrays carry besides their data, and small objects
    assert segments <= rowlog.SEGMENT_ENTRY_BYTES * len(log.seq) and segments <= rowlog.segment_bytes_bound(200_000, log.slot_bytes)


def test_a_damaged_segment_is_named_damage(tmp_path):
    import lmdb
    b = open_backend(tmp_path / "s", "log")
    b.put_rows([("t", np.arange(4), np.ones((4, DIM), dtype=np.float32))], last_use={"t": np.zeros(4, dtype=np.int64)})
    b.close()
    env = lmdb.open(str(tmp_path / "s"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(rowlog.seq_key(1), b"not a segment", db=env.open_db(b"s:t", txn=txn))
    env.close()
    with pytest.raises(StoreCorruptError, match="damaged segment"):
        open_backend(tmp_path / "s", "log")


def test_a_collection_reads_only_a_segment_whose_header_is_where_the_index_places_it(tmp_path):
    """A collection reads a victim's ids from the place the index keeps for it (never the
    whole value): bytes there that are not that segment's header are damage named, not
    slots copied from elsewhere."""
    b = open_backend(tmp_path / "s", "log")
    b.put_rows([("t", np.arange(16), np.ones((16, DIM), dtype=np.float32))], last_use={"t": np.zeros(16, dtype=np.int64)})
    at, length, _ = b._logs["t"].id_span(1)
    fd = os.open(tmp_path / "s" / "data.mdb", os.O_RDWR)
    try:
        os.pwrite(fd, b"XXXX", at)
    finally:
        os.close(fd)
    ids = np.flatnonzero(np.arange(16) % 4 != 3)  # three rows of each 4-slot segment: past SPARE, a collection
    with pytest.raises(StoreCorruptError, match="not where the index places it"):
        b.put_rows([("t", ids, np.full((12, DIM), 2, dtype=np.float32))], last_use={"t": np.full(12, 2)})
    b.close()


def test_a_collection_asks_the_index_nothing_for_the_rows_it_copies(tmp_path, monkeypatch):
    """A collection finds its victims' live slots in the log's bits and copies them; the
    copies' previous places are those slots: the index is not asked for any of them (in a
    mapped level each is a page read from disk)."""
    b = open_backend(tmp_path / "s", "log")
    b.put_rows([("t", np.arange(16), np.ones((16, DIM), dtype=np.float32))], last_use={"t": np.zeros(16, dtype=np.int64)})
    log = b._logs["t"]
    ids = np.flatnonzero(np.arange(16) % 4 != 3)  # three rows of each 4-slot segment: the fourth of each left live
    with monkeypatch.context() as held_back:  # the write's own collection
        held_back.setattr(type(b), "_collect", lambda *a: None)
        b.put_rows([("t", ids, np.full((12, DIM), 2, dtype=np.float32))], last_use={"t": np.full(12, 2)})
    asked = []
    get = log.index.get
    monkeypatch.setattr(log.index, "get", lambda ids, *a: asked.append(np.array(ids)) or get(ids, *a))
    seqs_before = set(log._index)
    b._collect("t", 12)  # the two emptiest segments: ids 0-3 and 4-7, 3 and 7 live
    assert len(set(log._index) - seqs_before) == 1 and len(seqs_before - set(log._index)) >= 2  # it ran
    assert not asked
    assert sorted(b.stored_ids("t").tolist()) == list(range(16))
    live_counts_match_the_index(b)
    for i in range(3, 16, 4):
        assert b.get_rows("t", np.array([i]))[0][0].tolist() == [1.0] * DIM
    b.close()


def test_a_collection_of_a_store_reading_directly_reads_each_page_of_its_copies_once(tmp_path, monkeypatch):
    """Where the store reads directly, a collection reads the pages of its victims' live slots
    directly, each once (the two live 20-byte slots of a segment share a page), a few rows'
    pages at a time, and copies the rows they hold."""
    monkeypatch.setattr("tierstore.io.direct.PACKED_CHUNK", 3)
    monkeypatch.setattr(rowlog, "SPARE", 0.0)  # every dead slot over _MIN_DEAD calls for a collection
    b = open_backend(tmp_path / "s", "log", direct=True)
    b.put_rows([("t", np.arange(32), np.arange(32 * DIM, dtype=np.float32).reshape(32, DIM))],
               last_use={"t": np.arange(32)})
    log = b._logs["t"]
    ids = np.flatnonzero(np.arange(32) % 4 < 2)  # the last two rows of each 4-slot segment left live
    with monkeypatch.context() as held_back:  # the write's own collection
        held_back.setattr(type(b), "_collect", lambda *a: None)
        b.put_rows([("t", ids, np.full((16, DIM), -1, dtype=np.float32))], last_use={"t": np.full(16, 99)})
    victims = log.victims(16, b.txn_bytes // log.slot_bytes)
    copied = np.concatenate([log.offset[log._index[seq]] + np.flatnonzero(log.live_of([seq])) * log.slot_bytes
                             for seq in victims])
    reads = []
    real = b._shared.direct.read
    monkeypatch.setattr(b._shared.direct, "read", lambda at, width, out: reads.append((np.array(at), width)) or real(at, width, out))
    b._collect("t", 16)
    assert len(copied) > 3 and set(log._index).isdisjoint(victims)  # it ran, over more than one chunk of rows
    pages = np.sort(np.concatenate([at for at, width in reads]))
    assert all(width == lmdb_map.PAGE for _, width in reads) and len(reads) > 1
    assert np.array_equal(pages, np.unique(copied // lmdb_map.PAGE) * lmdb_map.PAGE) and len(pages) < len(copied)
    live = np.flatnonzero(np.arange(32) % 4 >= 2)
    slots, found = b._log_slots("t", live)  # every live row and its last-use step, copied or not
    assert found.all()
    assert slots[:, :4 * DIM].copy().view(np.float32).tolist() == [list(range(i * DIM, (i + 1) * DIM)) for i in live]
    assert slots[:, 4 * DIM:].copy().view("<i8").ravel().tolist() == live.tolist()
    live_counts_match_the_index(b)
    b.close()


def test_a_collection_cleans_the_segments_most_worth_it_first(tmp_path, monkeypatch):
    """LFS's cost-benefit, (1 - u) * age / (1 + u): an emptied segment first (it costs
    nothing); of segments as empty, the oldest (its rows have stayed: copied once, they stay
    put); a young segment after old ones fuller than it, where emptiest first took it first."""
    monkeypatch.setattr(rowlog, "SPARE", 0.0)  # every dead slot over _MIN_DEAD calls for a collection
    b = open_backend(tmp_path / "s", "log")
    log = b._logs["t"]
    with monkeypatch.context() as held_back:
        held_back.setattr(type(b), "_collect", lambda *a: None)
        for lo in range(0, 40, 4):  # ten segments of 4 rows: ids 0-3, 4-7, ...
            b.put_rows([("t", np.arange(lo, lo + 4), np.ones((4, DIM), dtype=np.float32))], last_use={"t": np.zeros(4, dtype=np.int64)})
        seq = {lo: max(log._index) - 9 + lo // 4 for lo in range(0, 40, 4)}  # the segment of ids lo..lo+3
        # half dead: the segments of ids 0-3 (the oldest) and 8-11; emptied: 16-19; 3 of 4 dead, the youngest: 36-39
        dead = np.array([0, 1, 8, 9, 16, 17, 18, 19, 36, 37, 38])
        b.put_rows([("t", dead, np.full((len(dead), DIM), 2, dtype=np.float32))], last_use={"t": np.ones(len(dead), dtype=np.int64)})
    # 3 segments written since: ages 13, 11 and 4; worth 4.3, 3.7 and 2.4
    assert log.victims(1000) == [seq[16], seq[0], seq[8], seq[36]]
    b.close()


def test_a_collection_copies_at_most_the_rows_it_is_allowed(tmp_path, monkeypatch):
    """A collection copies at most ``most`` rows however many were just written (the
    backend's: a write transaction's share of bytes), the emptiest segments first; the rows
    it copies read back as they were."""
    monkeypatch.setattr(rowlog, "SPARE", 0.0)  # every dead slot over _MIN_DEAD calls for a collection
    b = open_backend(tmp_path / "s", "log")
    b.put_rows([("t", np.arange(40), np.ones((40, DIM), dtype=np.float32))], last_use={"t": np.zeros(40, dtype=np.int64)})
    log = b._logs["t"]
    ids = np.flatnonzero(np.arange(40) % 4 != 3)  # one row of each 4-slot segment left live: 30 dead slots
    with monkeypatch.context() as held_back:
        held_back.setattr(type(b), "_collect", lambda *a: None)
        b.put_rows([("t", ids, np.full((30, DIM), 2, dtype=np.float32))], last_use={"t": np.full(30, 2)})

    def copied(seqs):
        return sum(int(log.live[log._index[q]]) for q in seqs)
    free = log.victims(30)
    capped = log.victims(30, most=5)
    assert copied(free) == 10 and copied(capped) == 5 < copied(free)
    assert all(log.live[log._index[q]] == 1 for q in capped)  # the emptiest: a live row each
    assert log.victims(30, most=0) and copied(log.victims(30, most=0)) <= log.per_segment  # a segment at least
    b.txn_rows = 0  # the backend's share: a transaction of no bytes allows a row
    before = len(log._index)
    b._collect("t", 30)
    assert len(log._index) < before  # it ran, one victim at a time
    assert sorted(b.stored_ids("t").tolist()) == list(range(40))
    rows = b.get_rows("t", np.arange(40))[0]
    assert np.array_equal(rows[ids], np.full((30, DIM), 2, dtype=np.float32))
    assert np.array_equal(rows[np.arange(3, 40, 4)], np.ones((10, DIM), dtype=np.float32))
    live_counts_match_the_index(b)
    b.close()


def test_an_open_replays_only_the_segments_after_the_saved_index(tmp_path, monkeypatch):
    """A writer's close saves its index; the next open loads it and replays only newer segments
    (none here), and reads the same rows; a damaged saved index costs a full replay, not a row."""
    b = open_backend(tmp_path / "s", "log")
    rng = np.random.default_rng(1)
    for step in range(30):
        ids = np.sort(rng.choice(N, 6, replace=False))
        b.put_rows([("t", ids, np.full((6, DIM), step, dtype=np.float32))], last_use={"t": np.full(6, step)})
    b.delete_rows("t", np.arange(0, N, 7))
    want = b.get_rows("t", np.arange(N))
    b.close()
    replayed = []
    real_replay = rowlog.RowLog.replay
    monkeypatch.setattr(rowlog.RowLog, "replay", lambda log, mem, values: (replayed.append(len(values)), real_replay(log, mem, values))[1])
    for readonly in (False, True):
        replayed.clear()
        b = open_backend(tmp_path / "s", "log", readonly=readonly)
        got = b.get_rows("t", np.arange(N))
        b.close(save_index=False)
        assert replayed == [0] and got[1].tolist() == want[1].tolist() and (got[0][got[1]] == want[0][want[1]]).all()
    saved = next((tmp_path / "s").glob("index-*.bin"))
    damaged = bytearray(saved.read_bytes())
    header = json.loads(damaged[len(b"TSIDX2\n"): damaged.index(b"\n", 8)])
    damaged[header["offsets"][len(header["counts"])] + 1] ^= 0xFF  # the first run's start
    saved.write_bytes(bytes(damaged))
    replayed.clear()
    b = open_backend(tmp_path / "s", "log")
    got = b.get_rows("t", np.arange(N))
    assert sum(replayed) > 1 and got[1].tolist() == want[1].tolist() and (got[0][got[1]] == want[0][want[1]]).all()
    b.close()


def test_an_index_saved_without_live_bits_is_rebuilt_from_the_segments(tmp_path, monkeypatch):
    """An index saved before the log kept each segment's live slots (its header says so) is
    not loaded: the open replays the segments, which gives the bits, and a collection then
    copies every live row."""
    b = open_backend(tmp_path / "s", "log")
    rng = np.random.default_rng(2)
    for step in range(20):
        ids = np.sort(rng.choice(N, 6, replace=False))
        b.put_rows([("t", ids, np.full((6, DIM), step, dtype=np.float32))], last_use={"t": np.full(6, step)})
    want = b.get_rows("t", np.arange(N))
    old_header = rowlog._header
    with monkeypatch.context() as older:
        older.setattr(rowlog, "_header", lambda log, token: {k: v for k, v in old_header(log, token).items() if k != "live_bits"})
        b.close()
    replayed = []
    real_replay = rowlog.RowLog.replay
    monkeypatch.setattr(rowlog.RowLog, "replay", lambda log, mem, values: (replayed.append(len(values)), real_replay(log, mem, values))[1])
    b = open_backend(tmp_path / "s", "log")
    assert sum(replayed) > 1
    live_counts_match_the_index(b)
    for step in range(20, 40):  # overwrites: collections copy what the bits say is live
        ids = np.sort(rng.choice(N, 6, replace=False))
        b.put_rows([("t", ids, np.full((6, DIM), step, dtype=np.float32))], last_use={"t": np.full(6, step)})
        want[0][ids], want[1][ids] = step, True
    got = b.get_rows("t", np.arange(N))
    assert got[1].tolist() == want[1].tolist() and (got[0][got[1]] == want[0][want[1]]).all()
    live_counts_match_the_index(b)
    b.close()


def test_the_live_bits_are_pages_of_a_file_mapped_shared_and_unlinked(tmp_path):
    """A writer's live-slot bits are pages of a sparse file beside data.mdb, mapped shared and
    unlinked at once: the page cache's, which the kernel can write out and drop (anonymous
    memory it could not), and nothing is left in the store's directory."""
    b = open_backend(tmp_path / "s", "log")
    b.put_rows([("t", np.arange(16), np.ones((16, DIM), dtype=np.float32))], last_use={"t": np.zeros(16, dtype=np.int64)})
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if f"{tmp_path / 's'}/live-slots-" in line]
    assert maps and all(line.split()[1] == "rw-s" and line.endswith("(deleted)") for line in maps)
    assert not [f for f in os.listdir(tmp_path / "s") if f.startswith("live-slots")]
    b.close()


def test_a_full_disk_under_the_live_bits_fails_the_write_before_it_commits(tmp_path, monkeypatch):
    """The disk under the live-slot bits of new segment entries is allocated before the write
    that needs them commits: where it cannot be (a full disk, injected), the write fails with
    DiskFullError, nothing of it committed, and it goes through once there is room (a page
    written over an unallocated hole of a full disk kills the process with SIGBUS)."""
    import errno
    from tierstore.io.errors import DiskFullError
    b = open_backend(tmp_path / "s", "log")
    b.put_rows([("t", np.arange(N), np.ones((N, DIM), dtype=np.float32))], last_use={"t": np.zeros(N, dtype=np.int64)})
    log = b._logs["t"]
    log._free = log._free[:5]  # 5 entries left: the next write's 10 segments need more
    applied = log.applied

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as disk:
        disk.setattr(os, "posix_fallocate", full)
        with pytest.raises(DiskFullError, match="live-slot bits"):
            b.put_rows([("t", np.arange(N), np.full((N, DIM), 2, dtype=np.float32))], last_use={"t": np.ones(N, dtype=np.int64)})
    assert log.applied == applied and (b.get_rows("t", np.arange(N))[0] == 1).all()
    b.put_rows([("t", np.arange(N), np.full((N, DIM), 2, dtype=np.float32))], last_use={"t": np.ones(N, dtype=np.int64)})
    assert (b.get_rows("t", np.arange(N))[0] == 2).all()
    live_counts_match_the_index(b)
    b.close()


def test_a_write_that_changes_nothing_leaves_log_reads_working(tmp_path, monkeypatch):
    """A write transaction that changes nothing (a sweep of another table finding no idle row)
    commits no new snapshot: the log's index must still name the snapshot readers get, or each
    read waits forever for a newer one."""
    b = open_backend(tmp_path / "s", "log")
    b.write_meta({}, new_tables={"k": (True, None)})  # keyed (num_rows=None), with last-use steps
    b.open_table("k", DIM, last_use=True, create=False)
    b.put_rows([("t", np.arange(4), np.ones((4, DIM), np.float32)), ("k", np.arange(4), np.ones((4, DIM), np.float32))],
               last_use={"t": np.full(4, 5), "k": np.full(4, 5)})
    assert b.sweep("k", cutoff=0, budget=100) == 0  # every row used at step 5: nothing deleted, nothing written
    stale = []
    real = b._sync_log

    def sync_log(table, txn):  # counts the reads that found the index ahead of their snapshot (the old loop)
        ok = real(table, txn)
        stale.append(not ok)
        if sum(stale) > 100:
            raise AssertionError(f"the index of {table!r} names a snapshot after every reader's ({txn.id()}): reads never return")
        return ok
    monkeypatch.setattr(b, "_sync_log", sync_log)
    rows, found = b.get_rows("t", np.arange(4))
    assert found.all() and (rows == 1).all() and not any(stale)
    b.close()


def test_segment_sizes():
    """SEGMENT_BYTES of slots, at least MIN_SEGMENT_ROWS, at most MAX_SLOTS; a table too large
    for the index's segment numbers at that size gets larger segments."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rowlog, "SEGMENT_BYTES", 64 << 10)
        patch.setattr(rowlog, "MIN_SEGMENT_ROWS", 256)
        assert rowlog.rows_per_segment(264, 34_000_000) == 256
        assert rowlog.rows_per_segment(64, 34_000_000) == 1024
        big = rowlog.rows_per_segment(264, 1_000_000_000)
        assert 2 * 1_000_000_000 <= big * rowlog._MAX_SEGMENTS < 2 * 1_000_000_000 + rowlog._MAX_SEGMENTS
        assert rowlog.rows_per_segment(8, 10**6) == rowlog.MAX_SLOTS


def test_a_reader_behind_a_dropped_tombstone_rebuilds_its_index(tmp_path):
    """A reader placed row 0 in segment 1; the writer then deletes row 0 (a tombstone),
    rewrites the rest of segment 1 and drops the tombstone (no older copy of row 0 is left)
    before it publishes. The reader never sees the tombstone: it must not read row 0 from
    segment 1, whose pages LMDB has freed, but rebuild its index."""
    writer = open_backend(tmp_path / "s", "log", publish_at_flush=True)
    steps = np.zeros(4, dtype=np.int64)
    writer.put_rows([("t", np.arange(4), np.ones((4, DIM), np.float32))], last_use={"t": steps})
    writer.publish()
    reader = open_backend(tmp_path / "s", "log", readonly=True)
    assert reader.get_rows("t", np.arange(4))[1].all()
    writer.delete_rows("t", np.array([0]))
    writer.put_rows([("t", np.arange(1, 4), np.full((3, DIM), 2, np.float32))], last_use={"t": steps[:3]})
    writer.put_rows([("t", np.arange(4, 8), np.full((4, DIM), 3, np.float32))], last_use={"t": steps})
    assert writer._dropped["t"] == 2  # the tombstone went, with segment 1
    writer.publish()
    rows, found = reader.get_rows("t", np.arange(8))
    assert found.tolist() == [False] + [True] * 7 and (rows[1:4] == 2).all() and (rows[4:] == 3).all()
    reader.close()
    writer.close()


def test_live_slots_of_several_segments_at_once(tmp_path):
    """live_of over several segments, in any order, marks each slot holding its id's latest
    row: the newest segment naming an id holds it, a tombstone after it holds none; with the
    same answer after the index is saved and loaded."""
    from tierstore.io.codecs import RowCodec
    log = rowlog.RowLog(RowCodec(DIM), N, last_use=False)
    segments = {1: [0, 1, 2, 3], 2: [2, 3, 4], 4: [0, 5]}
    log.apply([(1, rowlog.ROWS, np.array(segments[1]), 0), (2, rowlog.ROWS, np.array(segments[2]), 4096),
               (3, rowlog.TOMBSTONES, np.array([4]), -1), (4, rowlog.ROWS, np.array(segments[4]), 8192)])
    newest = {}  # the model: each id's latest segment, None where deleted
    for seq, ids in [(1, [0, 1, 2, 3]), (2, [2, 3, 4]), (3, [4]), (4, [0, 5])]:
        newest.update({i: (seq if seq != 3 else None) for i in ids})
    for order in ([1, 2, 4], [4, 1], [2]):
        want = [newest[i] == seq for seq in order for i in segments[seq]]
        assert log.live_of(order).tolist() == want
    assert log.live_of([]).tolist() == []
    # a segment of more slots than the log's own (written under an older segment size) widens the bits
    wide = np.arange(100, 100 + log.per_segment + 70)
    log.apply([(5, rowlog.ROWS, wide, 12288), (6, rowlog.ROWS, wide[-3:], 16384)])
    segments[5] = wide.tolist()
    newest.update({i: 5 for i in wide[:-3].tolist()})
    newest.update({i: 6 for i in wide[-3:].tolist()})
    want = [newest[i] == seq for seq in (1, 2, 4, 5) for i in segments[seq]]
    assert log.live_of([1, 2, 4, 5]).tolist() == want
    rowlog.write_index(log, tmp_path / "index.bin", "token", 0)
    loaded = rowlog.RowLog(RowCodec(DIM), N, last_use=False)
    assert rowlog.load_index(tmp_path / "index.bin", loaded, "token") is not None
    assert loaded.live_of([1, 2, 4, 5]).tolist() == want


def test_a_write_given_the_places_a_read_found_asks_the_index_only_where_they_went_stale(tmp_path, monkeypatch):
    """put_rows with get_rows's places: the rows whose place is still theirs are released
    there; those written since (a stale place) are looked up. Bookkeeping as without places."""
    b = open_backend(tmp_path / "s", "log")
    ids = np.arange(16)
    b.put_rows([("t", ids, np.ones((16, DIM), dtype=np.float32))], last_use={"t": np.zeros(16, dtype=np.int64)})
    places = np.zeros(16, dtype=np.int64)
    assert b.get_rows("t", ids, places=places)[1].all() and (places >= 0).all()
    log = b._logs["t"]
    monkeypatch.setattr(type(b), "_collect", lambda *a: None)  # a collection would move rows: kept apart here
    b.put_rows([("t", ids[:4], np.full((4, DIM), 2, dtype=np.float32))], last_use={"t": np.ones(4, dtype=np.int64)})
    asked = []
    get = log.index.get
    monkeypatch.setattr(log.index, "get", lambda q, *a: asked.append(np.array(q)) or get(q, *a))
    b.put_rows([("t", ids, np.full((16, DIM), 3, dtype=np.float32))], last_use={"t": np.full(16, 2)}, places={"t": places})
    assert np.concatenate(asked).tolist() == [0, 1, 2, 3]
    live_counts_match_the_index(b)
    assert b.get_rows("t", ids)[0].tolist() == [[3.0] * DIM] * 16
    b.close()


def test_hints_name_a_slot_of_a_segment_and_go_stale_when_its_row_moves_or_its_entry_is_taken(tmp_path):
    """RowLog.hints of rows, then valid_hints after their rows were overwritten, or their segment
    emptied and its entry taken by a later one: never negative (sequence numbers past 2^31 too),
    valid while the row is there, stale after."""
    from tierstore.io.codecs import RowCodec

    log = rowlog.RowLog(RowCodec(DIM, 0, "float32"), 100, last_use=False, folder=tmp_path)
    first = 2**31 + 7  # a hint keeps 31 bits of the sequence number: this one's would make a 32-bit one negative
    log.apply([(first, rowlog.ROWS, np.arange(4), 0)])
    segs, slots, found = log.places(np.arange(4))
    hints = log.hints(segs, slots)
    assert found.all() and (hints >= 0).all() and log.valid_hints(hints).all()
    log.apply([(first + 1, rowlog.ROWS, np.arange(2), 0)])  # rows 0 and 1 move
    assert log.valid_hints(hints).tolist() == [False, False, True, True]
    log.apply([(first + 2, rowlog.ROWS, np.arange(2, 4), 0)])  # the first segment empties
    log.forget(first)
    log.apply([(first + 3, rowlog.ROWS, np.arange(10, 14), 0)])  # and its entry is taken, its slots live again
    assert int(log.places(np.array([10]))[0][0]) == int(segs[0])
    assert not log.valid_hints(hints).any()
    assert not log.valid_hints(np.array([-1])).any()


def test_a_write_checks_its_hints_before_it_holds_the_index_alone(tmp_path, monkeypatch):
    """A write of rows with the places a read found them (hints) reads their live bits
    before its commit, where lookups go on beside it, never while it holds the index lock
    alone; the slots those hints name are released all the same."""
    b = open_backend(tmp_path / "s", "log")
    ids = np.arange(8)

    def put(version, places=None):
        rows = np.stack([ids, np.full(8, version), np.zeros(8)], axis=1).astype(np.float32)
        b.put_rows([("t", ids, rows)], last_use={"t": np.zeros(8, dtype=np.int64)}, places=places)
    put(1)
    first = set(b._logs["t"]._index)  # version 1's segments
    places = np.empty(8, dtype=np.int64)
    assert b.get_rows("t", ids, places=places)[1].all()
    alone, live_at = [], liveslots.LiveSlots.live_at

    def recorded(self, segments, slots):
        alone.append(b._index_lock._writing)
        return live_at(self, segments, slots)
    monkeypatch.setattr(liveslots.LiveSlots, "live_at", recorded)
    put(2, {"t": places})
    assert alone and not any(alone), "the hints were checked with the index lock held alone"
    log = b._logs["t"]
    assert log.live_rows == 8 and not first & set(log._index), "version 1's slots were not released"
    rows, found = b.get_rows("t", ids)
    assert found.all() and (rows[:, 1] == 2).all()
    b.close()

def test_lookups_share_the_index_while_a_writer_commits_and_spills(tmp_path, monkeypatch):
    """Readers' lookups run side by side (io.locks.SharedLock), while a writer commits,
    collects and spills its index (limited to 10 runs, mapped from its file): every row a
    reader gets is its id's, of a version written, never older than one it got before."""
    b = open_backend(tmp_path / "s", "log", index_limit=160)
    inside, most, count = [0], [0], threading.Lock()
    places = rowlog.RowLog.places

    def counted(self, ids):
        with count:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.0005)  # a lookup reading pages from disk: another may start meanwhile
            return places(self, ids)
        finally:
            with count:
                inside[0] -= 1
    monkeypatch.setattr(rowlog.RowLog, "places", counted)
    committed, done, failures = [0], threading.Event(), []

    def write():
        rng = np.random.default_rng(0)
        try:
            for version in range(1, 301):
                ids = np.sort(rng.choice(N, 8, replace=False))
                rows = np.stack([ids, np.full(8, version), np.zeros(8)], axis=1).astype(np.float32)
                b.put_rows([("t", ids, rows)], last_use={"t": np.zeros(8, dtype=np.int64)})
                committed[0] = version
        except Exception as e:
            failures.append(e)
        finally:
            done.set()

    def read(seed):
        rng, seen = np.random.default_rng(seed), np.zeros(N)
        try:
            while not done.is_set():
                ids = np.sort(rng.choice(N, 6, replace=False))
                rows, found = b.get_rows("t", ids)
                latest = committed[0]  # a commit may land before the writer counts it: latest + 1 at most
                assert (rows[found, 0] == ids[found]).all(), "a row of another id"
                assert (rows[found, 1] >= seen[ids[found]]).all() and (rows[found, 1] <= latest + 1).all()
                seen[ids[found]] = rows[found, 1]
        except Exception as e:
            failures.append(e)
    threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    assert b._logs["t"].index.levels, "the index never spilled"
    assert most[0] >= 2, "no two lookups ran at once"
    b.close()


def test_a_commit_goes_on_while_a_lookup_is_in_flight(tmp_path, monkeypatch):
    """A lookup works on a view of the index (RowLog.view), so commits go on while one is in
    flight (here held up where it would read index pages from disk), and it still reads
    the rows of its snapshot, though those commits emptied the segments its rows were in,
    deleted them and gave their entries to new segments."""
    b = open_backend(tmp_path / "s", "log")
    ids = np.arange(16)

    def put(version, which):
        rows = np.stack([which, np.full(len(which), version), np.zeros(len(which))], axis=1).astype(np.float32)
        b.put_rows([("t", which, rows)], last_use={"t": np.zeros(len(which), dtype=np.int64)})
    for lo in range(0, 16, 4):
        put(1, ids[lo:lo + 4])
    log = b._logs["t"]
    entries = dict(log._index.items())  # seq -> entry of the segments version 1 is in
    asked, go, got = threading.Event(), threading.Event(), []
    places = rowlog.RowLog.places

    def held_up(self, asked_ids):
        if threading.current_thread() is reader:
            asked.set()
            go.wait(300)  # set once the writer is done, or has waited 30 s
        return places(self, asked_ids)
    monkeypatch.setattr(rowlog.RowLog, "places", held_up)
    reader = threading.Thread(target=lambda: got.append(b.get_rows("t", ids)))
    reader.start()
    assert asked.wait(60)
    writer = threading.Thread(target=lambda: [put(v, ids[lo:lo + 4]) for v in (2, 3) for lo in range(0, 16, 4)])
    writer.start()
    writer.join(30)
    went_on = not writer.is_alive()
    go.set()
    writer.join()
    reader.join()
    assert went_on, "the commits waited for the lookup in flight"
    reused = [s for seq, s in entries.items() if seq not in log._index and s in log._index.entries().tolist()]
    assert reused, "no entry of version 1's segments went to a new segment"
    rows, found = got[0]
    assert found.all()
    assert (rows[:, 0] == ids).all(), "a row of another id: a place read through an entry given to another segment"
    assert (rows[:, 1] == 1).all(), "not the lookup's snapshot"
    rows, found = b.get_rows("t", ids)
    assert found.all() and (rows[:, 0] == ids).all() and (rows[:, 1] == 3).all()
    b.close()


@given(cleared=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 4095)), max_size=300), asked=st.integers(1, 3))
@settings(max_examples=50, deadline=None)
def test_live_bits_read_and_clear_as_a_plain_model_whatever_pages_they_span(tmp_path_factory, cleared, asked):
    """The live bits, read and cleared a part of their pages at a time (each part's pages
    asked of the kernel at once), against a plain bool array: 64 segments of 4,096 slots,
    eight a page of bits; parts of 1-3 pages."""
    bits = liveslots.LiveSlots(4096, 64, tmp_path_factory.mktemp("bits"))
    model = np.zeros((64, 4096), dtype=bool)
    for s in range(0, 64, 2):
        bits.reset(s, 4096)
        model[s] = True
    old, liveslots.LOOKUP_PAGES = liveslots.LOOKUP_PAGES, asked
    try:
        seg, slot = (np.array([c[i] for c in cleared], dtype=np.int64) for i in (0, 1))
        bits.clear(seg, slot)
        model[seg, slot] = False
        every = np.repeat(np.arange(64), 4096), np.tile(np.arange(4096), 64)
        assert np.array_equal(bits.live_at(*every), model.reshape(-1))
        assert np.array_equal(bits.live_at(seg[::-1], slot[::-1]), model[seg[::-1], slot[::-1]])
    finally:
        liveslots.LOOKUP_PAGES = old


class SeqMapAgainstDict(RuleBasedStateMachine):
    """io.rowlog.SeqMap against a dict: seqs added in increasing order, popped at random,
    looked up one and many at a time, through the compactions its growth makes."""

    def __init__(self):
        super().__init__()
        self.map, self.model, self.next = rowlog.SeqMap(), {}, 1

    @rule(gaps=st.lists(st.integers(1, 5), min_size=1, max_size=16), entry=st.integers(0, 1 << 20))
    def add(self, gaps, entry):  # several at once: past 64, to the compactions its growth makes
        for i, gap in enumerate(gaps):
            self.next += gap
            self.map.add(self.next, entry + i)
            self.model[self.next] = entry + i

    @rule(seq=st.integers(0, 1200))
    def pop(self, seq):
        assert self.map.pop(seq) == self.model.pop(seq, None)

    @rule(seq=st.integers(0, 400))
    def add_out_of_order_is_refused(self, seq):
        if self.model and seq <= self.next:
            with pytest.raises(ValueError, match="increasing order"):
                self.map.add(seq, 0)

    @rule(seqs=st.lists(st.integers(0, 1200), max_size=8))
    def lookups(self, seqs):
        for seq in seqs:
            assert self.map.get(seq) == self.model.get(seq) and (seq in self.map) == (seq in self.model)
        known = [seq for seq in seqs if seq in self.model]
        assert self.map.many(known).tolist() == [self.model[seq] for seq in known]
        if len(known) < len(seqs):
            with pytest.raises(KeyError):
                self.map.many(seqs)

    @invariant()
    def same_items(self):
        assert len(self.map) == len(self.model)
        assert list(self.map.items()) == sorted(self.model.items())


TestSeqMapAgainstDict = SeqMapAgainstDict.TestCase
TestSeqMapAgainstDict.settings = settings(max_examples=60, stateful_step_count=120, deadline=None)
