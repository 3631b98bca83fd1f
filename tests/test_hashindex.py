"""HashIndex against a dict: inserts, removes (tombstones), rebuilds, and probe
sequences longer than one window, on tables small enough to collide a lot. Each
runs on numpy's arrays (the host's) and on torch's (a GPU's code path, here on the CPU)."""
from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore.engine.hashindex as hashindex
from tierstore.engine.hashindex import PROBE_WINDOW, DenseIndex, HashIndex, make_index

ARRAYS = ["numpy", "torch"]


@contextmanager
def arrays(kind: str):
    """Maps made inside use ``kind``'s arrays: torch's are what a GPU tier's use."""
    if kind == "numpy":
        yield
        return
    with mock.patch.object(hashindex, "_arrays", lambda device: hashindex._DeviceArrays(torch.device(device))):
        yield

ops = st.lists(
    st.tuples(st.sampled_from(["insert", "remove", "lookup"]), st.lists(st.integers(0, 2**62), min_size=1, max_size=12)),
    max_size=40,
)


@pytest.mark.parametrize("kind", ARRAYS)
@given(capacity=st.integers(1, 24), ops=ops)
@settings(max_examples=200, deadline=None)
def test_hash_index_agrees_with_a_dict(kind, capacity, ops):
    with arrays(kind):
        index, model, next_slot = HashIndex(capacity), {}, 0
    for op, ids in ops:
        ids = list(dict.fromkeys(ids))
        if op == "insert":
            new = [i for i in ids if i not in model][: capacity - len(model)]
            index.insert(torch.tensor(new, dtype=torch.int64), torch.arange(next_slot, next_slot + len(new)))
            model.update({i: next_slot + k for k, i in enumerate(new)})
            next_slot += len(new)
        elif op == "remove":
            gone = [i for i in ids if i in model]
            index.remove(torch.tensor(gone, dtype=torch.int64))
            for i in gone:
                del model[i]
        q = torch.tensor(ids + list(model), dtype=torch.int64)
        assert index.lookup(q).tolist() == [model.get(i, -1) for i in q.tolist()]
        assert len(index) == len(model)
    keys, vals = index.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == model


@pytest.mark.parametrize("kind", ARRAYS)
def test_probe_sequences_longer_than_a_window_are_followed(kind):
    with arrays(kind):
        index = HashIndex(64)  # 128 slots
    home = index.home_slots(torch.arange(200_000))
    same = torch.nonzero(home == home[0]).squeeze(1)[: 3 * PROBE_WINDOW]  # ids that all hash to one slot
    assert len(same) == 3 * PROBE_WINDOW
    index.insert(same, torch.arange(len(same)))
    assert index.lookup(same).tolist() == list(range(len(same)))
    index.remove(same[:PROBE_WINDOW])  # tombstones at the start of the run must not end the probe
    assert index.lookup(same).tolist() == [-1] * PROBE_WINDOW + list(range(PROBE_WINDOW, len(same)))


@pytest.mark.parametrize("kind", ARRAYS)
def test_dense_index_maps_and_forgets(kind):
    with arrays(kind):
        index = DenseIndex(100)
    index.insert(torch.tensor([5, 99, 0]), torch.tensor([2, 0, 1]))
    index.remove(torch.tensor([99]))
    assert index.lookup(torch.tensor([0, 5, 99, 7])).tolist() == [1, 2, -1, -1] and len(index) == 2
    assert [t.tolist() for t in index.items()] == [[0, 5], [1, 2]]


def test_dense_only_where_it_costs_at_most_128_bytes_per_slot():
    assert isinstance(make_index(1000, 32_000), DenseIndex)
    assert isinstance(make_index(1000, 32_001), HashIndex)
    assert isinstance(make_index(1000, None), HashIndex)


@pytest.mark.parametrize("kind", ARRAYS)
def test_a_rebuild_keeps_every_id_including_a_run_that_wraps_past_the_end(kind):
    """Tombstones fill the table until a rebuild places the live ids afresh; ids that
    all hash to the last slot make a run that wraps to the table's start."""
    with arrays(kind):
        index = HashIndex(64)  # 128 slots
    home = index.home_slots(torch.arange(400_000))
    last = torch.nonzero(home == 127).squeeze(1)[:PROBE_WINDOW + 3]
    others = torch.nonzero(home != 127).squeeze(1)
    index.insert(last, torch.arange(len(last)))
    model = dict(zip(last.tolist(), range(len(last))))
    rebuilt, at, before = False, 0, others[:0]
    for _ in range(40):  # at most 11 + 2 x 20 ids live, of 64
        batch = others[at: at + 20]
        at += 20
        index.insert(batch, batch)
        rebuilt |= index.tombstones == 0 and len(before) > 0
        model.update(zip(batch.tolist(), batch.tolist()))
        index.remove(before)
        for i in before.tolist():
            del model[i]
        before = batch
    assert rebuilt
    q = torch.tensor(list(model) + others[at: at + 50].tolist())
    assert index.lookup(q).tolist() == [model.get(i, -1) for i in q.tolist()]
    keys, vals = index.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == model
