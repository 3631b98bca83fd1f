"""``tierstore demo`` run as a real process with a tiny --steps, and its parts."""
import subprocess
import sys

import numpy as np
import pytest
import torch

import tierstore
from tierstore.tools.demo import MARKER, ClickData, DemoConfig, ZipfIds

TINY = ["--steps", "12", "--batch", "32", "--rows", "3000", "--hbm-rows", "64", "--ddr-rows", "256", "--tables", "3"]


def demo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tierstore.tools.cli", "demo", *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd)


def test_demo_trains_compares_and_leaves_a_store_and_checkpoint(tmp_path):
    d = tmp_path / "demo"
    r = demo("--dir", str(d), *TINY, "--compare")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "12 steps of 32 examples" in out
    # tierstore's Adagrad rounds its step before the add, torch fuses it: close, not bit-identical
    assert "-> AGREE" in out and ("largest per-step loss difference" in out or "bit-identical loss" in out)
    assert "loss=" in r.stderr and "served=hbm" in r.stderr  # the progress bar
    with tierstore.TieredStore(d / "store", readonly=True) as store, \
            tierstore.TieredStore(d / "checkpoint", readonly=True) as ckpt:
        specs = store.tables
        assert sorted(specs) == ["cat0", "cat1", "cat2"]
        assert all(s.num_rows == 3000 and s.state_dim == 16 for s in specs.values())  # Adagrad: one sum per weight
        ids = torch.arange(3000)
        trained = store.read("cat0", ids, with_state=True)
        assert torch.equal(trained, ckpt.read("cat0", ids, with_state=True))  # checkpoint taken after the last step
        assert int((trained[:, 16:] != 0).any(1).sum()) > 64, "rows beyond the HBM tier were trained"
        assert store.stats()["ssd"]["reads"] > 0


def test_demo_reruns_over_its_own_directory_but_refuses_a_foreign_one(tmp_path):
    d = tmp_path / "demo"
    assert demo("--dir", str(d), *TINY, "--no-progress").returncode == 0
    assert (d / MARKER).exists()
    again = demo("--dir", str(d), *TINY, "--no-progress")
    assert again.returncode == 0, again.stderr
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    r = demo("--dir", str(foreign), *TINY, "--no-progress")
    assert r.returncode == 2 and "not made by tierstore demo" in r.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"
    r = demo("--dir", str(tmp_path / "x"), "--steps", "0")
    assert r.returncode == 2 and "--steps must be a positive integer" in r.stderr


def test_default_tables_are_several_times_larger_than_the_ddr_tier():
    cfg = DemoConfig()
    assert cfg.rows >= 5 * cfg.ddr_rows and cfg.ddr_rows > cfg.hbm_rows > 0


def test_zipf_ids_follow_the_zipf_law():
    n, alpha, draws = 1000, 1.1, 200_000
    z = ZipfIds(n, alpha, torch.Generator().manual_seed(0))
    ids = z.sample(draws, torch.Generator().manual_seed(1))
    assert ids.min() >= 0 and ids.max() < n
    counts = torch.bincount(ids, minlength=n).double()
    by_rank = counts[z.perm]  # rank k (0-based) lives at id perm[k]
    expect = draws * np.arange(1, n + 1) ** -alpha / np.sum(np.arange(1, n + 1) ** -alpha)
    for k in (0, 1, 9, 99):
        assert abs(by_rank[k] - expect[k]) < 5 * np.sqrt(expect[k]) + 1, k
    assert len(torch.unique(z.perm)) == n


def test_click_data_is_a_function_of_the_generator():
    cfg = DemoConfig(rows=500, batch=16, tables=2)
    a = ClickData(cfg, torch.Generator().manual_seed(3)).batch(torch.Generator().manual_seed(4))
    b = ClickData(cfg, torch.Generator().manual_seed(3)).batch(torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert all(torch.equal(a[1][k][0], b[1][k][0]) and torch.equal(a[1][k][1], b[1][k][1]) for k in a[1])
    assert set(a[2].unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("field,value", [("steps", 0), ("lr", -1.0), ("optimizer", "adam"), ("hbm_rows", -1)])
def test_bad_config_names_the_flag(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        DemoConfig(**{field: value})


def test_demo_sharded_over_two_processes_equals_one_process(tmp_path):
    """The ranks' checkpoint stores, read directly (not through the module), hold the
    one process's trained rows bit for bit."""
    from tierstore.training.sharding import ShardingPlan

    d = tmp_path / "demo"
    r = demo("--dir", str(d), *TINY, "--world-size", "2", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "loss at every step bit-identical on every rank" in r.stdout and "-> AGREE" in r.stdout, r.stdout
    assert "rank lookups/step" in r.stdout and "planned" in r.stdout
    plan = ShardingPlan.from_json((d / "checkpoint" / "plan.json").read_text())
    assert plan.world_size == 2 and len({s.rank for tp in plan.tables.values() for s in tp.shards}) == 2
    ids = torch.arange(3000)
    with tierstore.TieredStore(d / "one-process", readonly=True) as one:
        for name, tp in plan.tables.items():
            whole = one.read(name, ids, with_state=True)
            dim = whole.shape[1] // 2  # Adagrad: one sum per weight
            for s in tp.shards:
                with tierstore.TieredStore(d / "checkpoint" / f"rank-{s.rank}", readonly=True) as shard:
                    own = ids[tp.owner(ids) == tp.shards.index(s)]
                    cols = torch.cat([torch.arange(s.col_start, s.col_stop), dim + torch.arange(s.col_start, s.col_stop)])
                    assert torch.equal(shard.read(name, own, with_state=True), whole[own][:, cols]), (name, s)


def test_demo_world_size_mistakes_are_named():
    with pytest.raises(ValueError, match=r"--batch \(32\) must be a multiple of --world-size \(3\)"):
        DemoConfig(batch=32, world_size=3)
    with pytest.raises(ValueError, match="--compare is for one process"):
        DemoConfig(world_size=2, compare=True)
    with pytest.raises(ValueError, match="--world-size must be a positive integer"):
        DemoConfig(world_size=0)
