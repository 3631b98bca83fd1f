"""A block of the row index's files found damaged (its CRC fails) when a write first reads it:
in the commit's index update, a delete, or a spill's merge (a collection and a sweep find
live slots in the log's bits, reading no block: the next write that reads it finds it). The
store rebuilds that table's index from its segments and loses no row, against a plain dict."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tierstore.io import rowindex, rowindex_file, rowlog

sys.path.insert(0, str(Path(__file__).parent))
from index_writer import DIM, open_writer  # noqa: E402

ROWS = 10**9
PER_SEGMENT = rowlog.rows_per_segment(4 * DIM, ROWS)
FIRST = np.arange(0, 8 * PER_SEGMENT, 2)  # four segments, a run a row
# half of what the mapped level's bits leave of it (RowIndex.marks: a few bytes): FIRST's runs pass it (the
# writer maps them), 7/8 of them do not (OVERWRITTEN, and the quarter of FIRST a collection copies)
LIMIT = 7 * FIRST.size * rowindex.RUN_BYTES // 4 + 1024
BLOCK = (PER_SEGMENT - 1) // rowindex.FENCE  # the damaged block: the last of the first segment's runs
DAMAGED = FIRST[BLOCK * rowindex.FENCE:(BLOCK + 1) * rowindex.FENCE]
# the first 3/4 of each segment's ids: their blocks are not the damaged one
OVERWRITTEN = FIRST[np.arange(FIRST.size) % PER_SEGMENT < 3 * PER_SEGMENT // 4]


def _write(b, model, ids, value):
    b.put_rows([("t", ids, np.full((len(ids), DIM), value, dtype=np.float32))])
    model.update(dict.fromkeys(ids.tolist(), float(value)))


def _damage(b) -> None:
    """Flip a bit of BLOCK of the level the writer maps, in place (its map sees it): none of
    its blocks was read since the level was mapped."""
    log = b._logs["t"]
    assert log.index.mapped and not log.index.levels[0].check.checked.any()
    path = b.path / log.index.names[0]
    header = rowindex_file.read_file(path, {})[0]
    at = header["offsets"][len(header["counts"])] + BLOCK * rowindex.FENCE * rowindex.RUN_BYTES + 3 * 8  # a start in its page
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 4]), at)
    finally:
        os.close(fd)


def _same(b, model) -> None:
    ids = np.array(sorted(model), dtype=np.int64)
    assert b.stored_ids("t").tolist() == ids.tolist()
    rows, found = b.get_rows("t", ids)
    assert found.all() and rows[:, 0].tolist() == [model[i] for i in ids.tolist()]


@pytest.mark.parametrize("path", ["commit", "delete", "collection", "sweep", "spill"])
def test_damage_found_by_a_write_rebuilds_the_index_and_loses_no_row(tmp_path, monkeypatch, path):
    model: dict[int, float] = {}
    b = open_writer(str(tmp_path), ROWS, LIMIT)
    rebuilt = []
    real = type(b)._rebuild_log
    monkeypatch.setattr(type(b), "_rebuild_log", lambda self, *a, **k: (rebuilt.append(a[0]), real(self, *a, **k))[1])
    try:
        _write(b, model, FIRST, 1)
        _damage(b)
        if path == "commit":  # the commit's index update looks up the ids it overwrites
            _write(b, model, DAMAGED[:5], 2)
        elif path == "delete":
            assert b.delete_rows("t", DAMAGED[:5]) == 5
            for i in DAMAGED[:5].tolist():
                del model[i]
        elif path == "collection":  # 3/4 of each segment overwritten: the collection copies the rest
            _write(b, model, OVERWRITTEN, 2)
        elif path == "sweep":  # rows of a small norm deleted: the sweep reads each segment's live slots
            _write(b, model, FIRST[:8], 0)
            assert b.sweep("t", None, 10 * PER_SEGMENT, l2_below=0.5) == 8
            for i in FIRST[:8].tolist():
                del model[i]
        else:  # a write elsewhere spills: its merge reads every block
            _write(b, model, ROWS // 2 + FIRST, 3)
        found_later = path in ("collection", "sweep")  # neither read the damaged block
        assert rebuilt == ([] if found_later else ["t"])  # found there, not by a read
        if found_later:  # ... a spill's merge, which reads every block, does
            _write(b, model, ROWS // 2 + FIRST, 3)
            assert rebuilt == ["t"]
        _same(b, model)
        _write(b, model, DAMAGED, 4)  # and the index goes on
        _same(b, model)
        b.publish()
    finally:
        b.close(save_index=False)  # as after kill -9: the index LMDB names is replayed from
    b = open_writer(str(tmp_path), ROWS, LIMIT)
    try:
        _same(b, model)
    finally:
        b.close()
    b = open_writer(str(tmp_path), ROWS, LIMIT)
    try:
        _same(b, model)
    finally:
        b.close()
