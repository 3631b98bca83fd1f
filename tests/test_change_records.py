"""A reader of take_changes that fails to write what it took (an incremental checkpoint's link, a
publisher's delta) hands the changes back: the next link or delta carries them, and no part of
the failed one is left. The disk filling up is injected into the rename that makes a file whole."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from tierstore import RowInit, TableSpec, TieredStore
from tierstore import restore
from tierstore.serving.stream import Publisher, Replica

SPEC = TableSpec("a", 400, 8, state_dim=8, init=RowInit.normal(0, 0.1, seed=1))


@pytest.fixture
def full_disk_once(monkeypatch):
    """The next rename to a file named ``name`` fails as on a full disk (ENOSPC), once."""
    real = os.rename
    armed = {}

    def rename(src, dst, *args, **kwargs):
        if os.path.basename(dst) == armed.get("name"):
            armed.clear()
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "rename", rename)
    return lambda name: armed.update(name=name)


def _write(store, rng, ids) -> None:
    store.write("a", ids, rng.normal(0, 1, (len(ids), SPEC.width)).astype(np.float32), with_state=True)


def test_a_link_that_fails_leaves_nothing_and_the_next_carries_its_rows(tmp_path, full_disk_once):
    rng = np.random.default_rng(0)
    with TieredStore(tmp_path / "train", tables=[SPEC], hbm_rows=16, ddr_rows=32, device="cpu") as store:
        store.checkpoint(tmp_path / "base", incremental=True)
        _write(store, rng, np.arange(0, 100))
        full_disk_once("life.bin")
        with pytest.raises(OSError, match="No space left"):
            store.checkpoint(tmp_path / "link-1", incremental=True)
        assert not (tmp_path / "link-1").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
        _write(store, rng, np.arange(300, 350))
        link = store.checkpoint(tmp_path / "link-1", incremental=True)  # the same path, now free
        expected = store.peek("a", np.arange(400), with_state=True).numpy()
    with TieredStore(restore(link, tmp_path / "back"), readonly=True, device="cpu") as back:
        got = back.peek("a", np.arange(400), with_state=True).numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_a_delta_that_fails_keeps_the_version_and_the_next_carries_its_rows(tmp_path, full_disk_once):
    rng = np.random.default_rng(1)
    with TieredStore(tmp_path / "train", tables=[SPEC], device="cpu") as store:
        pub = Publisher(store, tmp_path / "pub", dtype="float32")
        first = pub.version
        _write(store, rng, np.arange(0, 100))
        full_disk_once(f"delta-{first + 1:08d}.bin")
        with pytest.raises(OSError, match="No space left"):
            pub.publish()
        assert pub.version == first
        assert not [p.name for p in (tmp_path / "pub").iterdir() if p.name.startswith(("delta-", "."))]
        _write(store, rng, np.arange(300, 350))
        assert pub.publish() == first + 1
        replica = Replica(tmp_path / "pub", device="cpu")
        try:
            assert np.array_equal(replica.rows("a", np.arange(400)).numpy(), store.peek("a", np.arange(400)).numpy())
        finally:
            replica.close()


def test_returned_changes_merge_with_later_ones(tmp_path):
    with TieredStore(tmp_path / "s", tables=[SPEC], device="cpu") as store:
        store.take_changes("r")
        store.write("a", [5, 7], np.ones((2, 8), np.float32))
        store.flush()
        taken = store.take_changes("r")
        assert taken["a"].tolist() == [5, 7]
        store.return_changes(taken, "r")
        store.write("a", [1, 7], np.ones((2, 8), np.float32))
        store.flush()
        assert store.take_changes("r")["a"].tolist() == [1, 5, 7]
        assert store.take_changes("r") == {}
