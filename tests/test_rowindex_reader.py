"""A reader's row index (a store opened readonly) within its limit: past it, the reader spills
to a private file of its own, mapped and already unlinked, as a writer spills to its named
ones; it merged every run it replayed in memory, whatever its limit."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tierstore.io import rowindex, rowlog
from tierstore.io.lmdb_backend import LmdbBackend

sys.path.insert(0, str(Path(__file__).parent))
from index_writer import DIM, open_writer  # noqa: E402

ROWS = 10**9
LIMIT = 64 << 10  # the reader's: 4,096 runs


def open_reader(path) -> LmdbBackend:
    b = LmdbBackend(path, readonly=True)
    b.limit_index({"t": LIMIT})
    b.open_table("t", DIM, create=False, num_rows=ROWS)
    return b


def _same(b, model) -> None:
    ids = np.array(sorted(model), dtype=np.int64)
    assert b.stored_ids("t").tolist() == ids.tolist()
    rows, found = b.get_rows("t", ids)
    assert found.all() and rows[:, 0].tolist() == [model[i] for i in ids.tolist()]


@pytest.mark.parametrize("writable", [True, False])
def test_a_reader_keeps_its_index_within_its_limit(tmp_path, monkeypatch, writable):
    """A writer (no limit) writes 20,000 random rows, a run each; a reader limited to 4,096
    runs opens (it replays every segment: the writer saved no index) and follows 20,000 more
    written after: its index never holds more than its limit, its private files are gone
    from the directory (the store's, or the temporary one where it may not write the
    store's), never synced (no one reads them after a crash), and it reads every row as written."""
    spare = tmp_path / "tmp"
    spare.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    if not writable:  # as for a store on a read-only mount (root writes anywhere)
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: mode != os.W_OK and real_access(p, mode, **k))
    store = tmp_path / "s"
    held = []
    real = rowlog.RowLog.apply
    monkeypatch.setattr(rowlog.RowLog, "apply", lambda log, segments, **k: (
        real(log, segments, **k), log.index.limit == LIMIT and held.append(log.index.nbytes))[0])  # the reader's
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    writer = open_writer(str(store), ROWS, 1 << 30)
    rng = np.random.default_rng(0)
    model: dict[int, float] = {}

    def write(n, value):
        for _ in range(n):
            ids = np.unique(rng.integers(0, ROWS, 1000))
            writer.put_rows([("t", ids, np.full((len(ids), DIM), value, dtype=np.float32))])
            model.update(dict.fromkeys(ids.tolist(), float(value)))
        writer.publish()
    try:
        write(20, 1)
        files = set(store.iterdir())
        reader = open_reader(store)
        try:
            log = reader._logs["t"]
            assert log.index.mapped and log.index.nbytes <= LIMIT
            _same(reader, model)
            held.clear()
            write(20, 2)
            _same(reader, model)  # replayed the writer's new segments
            assert len(held) > 2 and max(held) <= LIMIT
            assert reader._logs["t"].index.nbytes <= LIMIT < len(model) * rowindex.RUN_BYTES
            assert set(store.iterdir()) == files and not any(spare.iterdir())  # the reader's files: unlinked once mapped
            assert not [f for f in synced if "reader-index" in f]
        finally:
            reader.close()
    finally:
        writer.close()
