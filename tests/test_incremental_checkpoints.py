"""Incremental checkpoints (issue #34): TieredStore.checkpoint(path, incremental=True) writes the
rows changed since the last one; tierstore.checkpointing.restore replays the chain bit for bit.
Real LMDB."""
from __future__ import annotations

import numpy as np
import pytest

from tierstore import RowInit, TableSpec, TieredStore
from tierstore.checkpointing import CheckpointChainError, restore
from tierstore.serving_stream import decode_delta

SPECS = [TableSpec("a", 500, 8, state_dim=8, init=RowInit.normal(0, 0.1, seed=1)),
         TableSpec("b", 300, 4, state_dim=1, dtype="float16", init=RowInit.uniform(-1, 1, seed=2))]


def every_row(store) -> dict[str, np.ndarray]:
    return {s.name: store.peek(s.name, np.arange(s.num_rows), with_state=True).numpy() for s in SPECS}


def test_a_chain_of_incremental_checkpoints_restores_bit_for_bit(tmp_path):
    rng = np.random.default_rng(0)
    states, links = [], []
    with TieredStore(tmp_path / "train", tables=SPECS, hbm_rows=32, device="cpu") as store:
        for k in range(4):  # the base, then 3 links
            for s in SPECS:
                ids = rng.choice(s.num_rows, 60, replace=False)
                store.write(s.name, ids, rng.normal(0, 1, (60, s.width)).astype(np.float32), with_state=True)
            if k:
                store.evict("a", rng.choice(500, 10, replace=False))
            links.append(store.checkpoint(tmp_path / f"ckpt-{k}", incremental=True))
            states.append(every_row(store))
        store.write("a", [0], np.ones((1, 16), np.float32), with_state=True)  # after the last checkpoint: not in any
    for k, path in enumerate(links):
        with TieredStore(restore(path, tmp_path / f"restored-{k}"), readonly=True, device="cpu") as back:
            got = every_row(back)
        for name in got:
            assert np.array_equal(got[name].view(np.uint32), states[k][name].view(np.uint32)), (k, name)
    _, tables = decode_delta(links[1] / "link.bin")
    assert 0 < sum(len(ids) + len(gone) for ids, _, gone in tables.values()) <= 2 * 60 + 10 + 32  # changed rows only


def test_a_damaged_or_missing_link_is_refused_by_name(tmp_path):
    with TieredStore(tmp_path / "train", tables=SPECS, device="cpu") as store:
        paths = []
        for k in range(3):
            store.write("a", [k], np.full((1, 16), k, np.float32), with_state=True)
            paths.append(store.checkpoint(tmp_path / f"ckpt-{k}", incremental=True))
    link = paths[1] / "link.bin"
    whole = link.read_bytes()
    link.write_bytes(whole[:-10])
    with pytest.raises(CheckpointChainError, match="ckpt-1's link.bin is damaged"):
        restore(paths[2], tmp_path / "x")
    assert not (tmp_path / "x").exists()
    link.write_bytes(whole)
    (paths[1] / "chain.json").rename(tmp_path / "aside.json")
    with pytest.raises(CheckpointChainError, match="ckpt-1, which is missing or another checkpoint"):
        restore(paths[2], tmp_path / "x")
    (tmp_path / "aside.json").rename(paths[1] / "chain.json")
    with TieredStore(restore(paths[2], tmp_path / "x"), readonly=True, device="cpu") as back:
        assert back.peek("a", [0, 1, 2]).numpy()[:, 0].tolist() == [0, 1, 2]


def test_a_publisher_and_a_chain_each_get_every_change(tmp_path):
    """take_changes keeps a record per reader: publishing does not take rows from the next link."""
    from tierstore.serving_stream import Publisher, Replica

    with TieredStore(tmp_path / "train", tables=SPECS[:1], device="cpu") as store:
        store.checkpoint(tmp_path / "base", incremental=True)
        pub = Publisher(store, tmp_path / "pub", dtype="float32")
        store.write("a", np.arange(20), np.full((20, 8), 3.0, np.float32))
        pub.publish()
        link = store.checkpoint(tmp_path / "link", incremental=True)
        with TieredStore(restore(link, tmp_path / "back"), readonly=True, device="cpu") as back:
            assert np.array_equal(back.peek("a", np.arange(500)).numpy(), store.peek("a", np.arange(500)).numpy())
        replica = Replica(tmp_path / "pub", device="cpu")
        assert np.array_equal(replica.rows("a", np.arange(500)).numpy(), store.peek("a", np.arange(500)).numpy())
        replica.close()
