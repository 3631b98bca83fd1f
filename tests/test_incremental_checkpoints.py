"""Incremental checkpoints: TieredStore.checkpoint(path, incremental=True) writes the
rows changed since the last one; tierstore.restore replays the chain bit for bit.
Real LMDB."""
from __future__ import annotations

import numpy as np
import pytest

from tierstore import RowInit, TableSpec, TieredStore
from tierstore import restore
from tierstore.engine.chain import CheckpointChainError
from tierstore.serving.stream import decode_delta

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
    from tierstore.serving.stream import Publisher, Replica

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


# -- admission and TTL: a restored link is the store at that checkpoint ------------------------------------------
# "t": unbounded (keyed layout), float16 (stochastic rounding keyed by the update count), trained by a module;
# "u": bounded (log layout), read, written and evicted by store calls. Both admit from the 3rd use, rows idle
# for 4 steps read as initial. Small sketches: collisions happen, and are part of what must match.
LIVED = [TableSpec("t", None, 4, state_dim=1, dtype="float16", admit_after=3, admit_width=64, admit_depth=2, ttl_steps=4,
                   init=RowInit.normal(0, 0.1, seed=3)),
         TableSpec("u", 400, 4, state_dim=0, admit_after=2, admit_width=128, admit_depth=2, ttl_steps=5,
                   init=RowInit.uniform(-1, 1, seed=4))]
POOL = {"t": np.random.default_rng(7).choice(1 << 40, 60, replace=False), "u": np.arange(400)}


def lived_module(store):
    from tierstore import TieredEmbeddingBag, optim

    return TieredEmbeddingBag(None, 4, mode="sum", store=store, table="t", optimizer=optim.RowWiseAdagrad(lr=0.3))


def run_phase(store, seed: int, steps: int = 6) -> list:
    """Training steps of "t", read steps, writes and evictions of "u": what each showed (pooled outputs,
    which ids the steps admitted, rows read) is returned, to be compared bit for bit."""
    import torch

    rng = np.random.default_rng(seed)
    emb, seen = lived_module(store), []
    for _ in range(steps):
        ids = torch.from_numpy(rng.choice(POOL["t"][: 20 + 5 * seed % 40], 12))
        uid = torch.unique(ids)
        out = emb(ids, torch.arange(0, 12, 3))
        seen += [store.trainer("t").admitted(uid).numpy(), out.detach().numpy().copy()]
        ((out - 1) ** 2).sum().backward()
        u = rng.choice(40 + 10 * seed, 15)
        seen += [store.read("u", u, with_state=True).numpy(), store.trainer("u").admitted(torch.unique(torch.from_numpy(u))).numpy()]
        if rng.random() < 0.5:
            w = rng.choice(400, 5, replace=False)
            store.write("u", w, rng.normal(0, 1, (5, 4)).astype(np.float32))
        if rng.random() < 0.3:
            store.evict("u", rng.choice(400, 3, replace=False))
    return seen


def life_of(store) -> dict:
    """Everything a later step depends on: rows with state, whether stored, last-use steps, step counts, sketches,
    the update counts of stochastic rounding, the stats' counts."""
    out = {}
    for s in LIVED:
        ids = np.sort(POOL[s.name])
        stored, life = store.stored_rows(s.name, ids), store.life(s.name)
        out[s.name] = {"rows": store.peek(s.name, ids, with_state=True).numpy().view(np.uint32),
                       "stored": stored.found,
                       "last_use": stored.last_use,
                       "steps": life.steps,
                       "sketch": life.sketch,
                       "updates": life.updates,
                       "counts": store.stats(per_table=True)[s.name]["rows"]["stored"]}
    return out


def assert_same(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same(a[k], b[k], f"{what}/{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
    else:
        x, y = np.atleast_1d(a), np.atleast_1d(b)
        same = x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))
        assert same, f"{what} differs: {x.ravel()[:12]} vs {y.ravel()[:12]}"


@pytest.mark.parametrize("tiers", [dict(hbm_rows=8), dict(hbm_rows=0, ddr_rows=0)], ids=["cached", "uncached"])
def test_a_restored_link_admits_expires_and_trains_as_the_store_at_that_checkpoint(tmp_path, tiers):
    """Each link restored equals a whole checkpoint taken at the same point (rows, stored ids, last-use
    steps, step counts, sketches, update counts), and the same further steps on both show the same
    admissions, the same rows read as initial and the same trained bits. The rows a step uses reach
    LMDB from the tiers at flush, or straight from the step without tiers."""
    links, wholes = [], []
    with TieredStore(tmp_path / "train", tables=LIVED, device="cpu", **tiers) as store:
        for k in range(4):  # the base (after a phase: the steps, sketches and last uses are not zero), then 3 links
            run_phase(store, seed=k)
            links.append(store.checkpoint(tmp_path / f"ckpt-{k}", incremental=True))
            wholes.append(store.checkpoint(tmp_path / f"whole-{k}"))
    for k, link in enumerate(links):
        restored = restore(link, tmp_path / f"restored-{k}")
        with TieredStore(restored, hbm_rows=8, device="cpu") as back, \
                TieredStore(wholes[k], hbm_rows=8, device="cpu") as whole:
            assert_same(life_of(back), life_of(whole), f"link {k}")
            assert_same(run_phase(back, seed=10 + k, steps=10), run_phase(whole, seed=10 + k, steps=10), f"after link {k}")
            assert_same(life_of(back), life_of(whole), f"after link {k}")
            for name, rows in back.stats(per_table=True).items():  # the steps did admit, reject and expire rows
                assert min(rows["rows"][c] for c in ("admitted", "rejected", "expired")) > 0, (k, name, rows)


def test_a_damaged_life_section_or_another_link_format_is_refused_by_name(tmp_path):
    """life.bin cut short, missing, of a newer version; chain.json of a newer format, or a chain mixing
    formats: CheckpointChainError naming the link and the fix, and nothing at dst."""
    import json

    with TieredStore(tmp_path / "train", tables=LIVED, device="cpu") as store:
        paths = []
        for k in range(3):
            run_phase(store, seed=k, steps=2)
            paths.append(store.checkpoint(tmp_path / f"ckpt-{k}", incremental=True))
    life, chain = paths[1] / "life.bin", paths[1] / "chain.json"
    whole, meta = life.read_bytes(), json.loads(chain.read_text())
    for bad, match in [(whole[:-3], "ckpt-1's life.bin is damaged"), (whole[:7] + b"\x09" + whole[8:], "life section of version 9"),
                       (None, "ckpt-1 lacks its life.bin")]:
        life.unlink()
        if bad is not None:
            life.write_bytes(bad)
        with pytest.raises(CheckpointChainError, match=match):
            restore(paths[2], tmp_path / "x")
        assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))
    life.write_bytes(whole)
    for fmt, match in [(3, "link format 3; this tierstore reads formats 1 and 2"), (1, "ckpt-2 has link format 2, its parent")]:
        chain.write_text(json.dumps({**meta, "format": fmt}))
        with pytest.raises(CheckpointChainError, match=match):
            restore(paths[2], tmp_path / "x")
    chain.write_text(json.dumps(meta))
    restore(paths[2], tmp_path / "x")


def test_a_chain_of_format_1_restores_its_rows_as_before(tmp_path):
    """Links written before the life section (no "format" in chain.json, no life.bin) still restore
    their rows: a table without admission or TTL, bit for bit."""
    import json

    rng = np.random.default_rng(3)
    with TieredStore(tmp_path / "train", tables=SPECS, device="cpu") as store:
        paths = []
        for k in range(3):
            store.write("a", rng.choice(500, 40, replace=False), rng.normal(0, 1, (40, 16)).astype(np.float32), with_state=True)
            store.evict("a", rng.choice(500, 5, replace=False))
            paths.append(store.checkpoint(tmp_path / f"ckpt-{k}", incremental=True))
        want = every_row(store)
    for path in paths:
        (path / "life.bin").unlink(missing_ok=True)
        chain = json.loads((path / "chain.json").read_text())
        del chain["format"]
        (path / "chain.json").write_text(json.dumps(chain))
    with TieredStore(restore(paths[2], tmp_path / "back"), readonly=True, device="cpu") as back:
        got = every_row(back)
    for name in got:
        assert np.array_equal(got[name].view(np.uint32), want[name].view(np.uint32)), name
