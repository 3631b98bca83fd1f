"""`tierstore bench scale` at a small size: its runs complete and report their figures."""
import json
import os
import re
import shutil

import pytest

from tierstore.tools import bench_floors, bench_scale, cli

FIELDS = ("lookups_per_s", "p50_s", "p90_s", "p99_s", "ddr_hit", "rows_read_per_step", "rows_written_per_step",
          "disk_read_bytes_per_step", "read_amp", "rss_peak", "x_disk_floor", "x_in_memory")


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(bench_scale, "WARMUP", 1)
    monkeypatch.setattr(bench_scale, "FLOOR_SECONDS", 0.5)
    monkeypatch.setattr(bench_scale, "BAGS", 256)  # 8,192 lookups a step


def _have_fbgemm() -> bool:
    from tierstore.tools.bench_peers import fbgemm_module
    return fbgemm_module(8, 8, "EXACT_SGD", {"lr": 0.01}, bench_scale.torch.device("cpu")) is not None


def test_small_run_under_a_memory_cgroup(tmp_path, capsys, quick):
    group, why = bench_scale.MemoryGroup.make("tierstore-test-probe")
    if group is None:
        pytest.skip(f"this machine does not let the test make a memory cgroup: {why}")
    group.remove()
    # 128 MB of rows, 10.2x the budget: the DLRM model runs too
    assert cli.main(["bench", "scale", "--rows", "500000", "--dim", "64", "--budgets", "12MiB", "--depths", "4",
                     "--repeat", "2", "--path", str(tmp_path / "store"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["cgroup"].startswith(f"cgroup v{group.version} memory group")
    assert [(r["kind"], r["depth"]) for r in res["runs"]] == [("emb", 4), ("dlrm", 4)]  # the deepest of --depths
    for r in res["runs"]:
        assert r["budget"] == 12 << 20
        assert r["limit"] == r["rss_before"] + r["budget"] + bench_scale.MARGIN
        # the limit held the child (the kernel charges pages in batches of up to 64 past it)
        assert 0 < r["cgroup_peak"] <= r["limit"] + 64 * 4096
        assert r["oom_killed"] in (True, False)
        # what the charge was made of, sampled as it ran: the child's own memory, and the store's pages in the page cache
        assert 0 < r["charged_before"] <= r["limit"]
        for sample in (r["cgroup_at_most_anon"], r["cgroup_last"]):
            assert sample["anon"] > 0 and sample["file"] > 0 and sample["anon"] + sample["file"] <= r["cgroup_peak"]
        missing = [f for f in FIELDS if r.get(f) is None and not (f == "x_in_memory" and r["kind"] == "emb" and not _have_fbgemm())]
        assert not missing, r
        assert r["rows_read_per_step"] > 0 and r["disk_read_bytes_per_step"] > 0  # a table 10x its budget misses
        assert 0 < r["parts_used"]["row_index"] <= r["parts"]["row_index"]  # the index within what it is charged
        assert r["lmdb_floor_s"] > 0  # py-lmdb's gets and puts of the run's rows, in the table's layout
        # its disk floor from the disk's speed measured as it started
        assert r["disk_iops_qd32"] > 0 and r["disk_floor_s"] == pytest.approx(r["rows_read_per_step"] / r["disk_iops_qd32"])
    assert res["floors"]["disk"]["iops_qd32"] > 0
    assert res["in_memory"]["dlrm"]["lookups_per_s"] > 0
    assert not (group.path.parent / f"tierstore-bench-scale-{os.getpid()}").exists()  # the run removed its group


def test_without_a_cgroup_or_fio_it_says_so_and_runs(tmp_path, capsys, monkeypatch, quick):
    monkeypatch.setattr(bench_scale, "CGROUP_V1", tmp_path / "no-v1")
    monkeypatch.setattr(bench_scale, "CGROUP_V2", tmp_path / "no-v2")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert cli.main(["bench", "scale", "--rows", "200000", "--dim", "16", "--budgets", "7MiB", "--depths", "0",
                     "--repeat", "1", "--dir", str(tmp_path), "--age-rows", "1000"]) == 0
    out = capsys.readouterr().out
    assert "memory limit: none: no cgroup memory controller here" in out
    assert "aged: 1,000 rows of random ids rewritten (--age-rows); 1,000 of them before these runs" in out, out
    assert "fio is not installed (apt-get install -y fio): Python O_DIRECT preads" in out
    assert "DLRM: skipped: no budget in --budgets is a tenth of the table" in out
    for field in ("M lookups/s", "p50 / p90 / p99", "hit rate HBM", "rows read", "amplification read",
                  "peak RSS", "the disk floor", "LMDB floor", "no limit", "rows read through: ", "by stage (ms): dedupe", "CPU a step by thread (ms): ",
                  "row index held "):
        assert field in out
    # threads by CPU, most first (a thread's CPU is counted in 10 ms ticks: over one step the main thread may
    # have none, and a thread that ended the most)
    line = out.split("CPU a step by thread (ms): ", 1)[1].splitlines()[0]
    threads = [re.fullmatch(r"(MainThread|native|tierstore-[a-z-]+|ended threads) (\d+\.\d)", t) for t in line.split(", ")]
    assert line and all(threads), line
    cpu = [float(t.group(2)) for t in threads]
    assert cpu == sorted(cpu, reverse=True) and cpu[0] > 0, line
    assert ("x FBGEMM in memory" in out) == _have_fbgemm()
    assert "= -x" not in out  # no ratio without its baseline
    # the capacity library, replaying the run's recorded trace, predicts the store's DDR counts to the row
    predicted = re.search(r"DDR misses replayed ([\d,]+), LRU curve ([\d,]+); the store measured ([\d,]+) \(equal\); "
                          r"hits ([\d,]+) / ([\d,]+), evictions ([\d,]+) / ([\d,]+)", out)
    assert predicted, out
    replayed, curve, measured, hits, measured_hits, evictions, measured_evictions = predicted.groups()
    assert replayed == curve == measured != "0" and hits == measured_hits and evictions == measured_evictions != "0"


def test_a_built_table_is_reused_and_another_is_refused_naming_the_fix(tmp_path):
    path = tmp_path / "store"
    assert not bench_scale.prepare_table(path, 1000, 8, 0)["reused"]
    assert bench_scale.prepare_table(path, 1000, 8, 0)["reused"]
    with pytest.raises(SystemExit, match=r"holds a bench scale table of 1,000 x 8 \(1,000 declared, rows ascending\), "
                                         r"not 2,000 x 8 \(2,000, rows ascending\); pass the same --rows/--dim/--declared-rows/--scattered"):
        bench_scale.prepare_table(path, 2000, 8, 0)
    with pytest.raises(SystemExit, match=r"not 1,000 x 8 \(10,000, rows ascending\)"):
        bench_scale.prepare_table(path, 1000, 8, 0, declared=10_000)
    with pytest.raises(SystemExit, match=r"not 1,000 x 8 \(1,000, rows scattered\)"):
        bench_scale.prepare_table(path, 1000, 8, 0, scattered=True)
    (path / bench_scale.MARKER).unlink()
    with pytest.raises(SystemExit, match="not empty and holds no finished bench scale table"):
        bench_scale.prepare_table(path, 2000, 8, 0)


def _log_layout(path, rows: int, copy: bool = False):
    """Where the log holds each of the first ``rows`` ids (bench_floors.locate_log_rows), and,
    with ``copy``, their rows' bytes read straight from LMDB."""
    import lmdb
    import numpy as np

    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=1024)
    try:
        db = env.open_db(b"s:" + bench_scale.TABLE.encode(), create=False)
        found = bench_floors.locate_log_rows(env, db, np.arange(rows))
        out = None
        if copy:
            out = np.empty((len(found.rows), found.width), dtype=np.uint8)
            bench_floors.copy_log_rows(env, db, found, out)
    finally:
        env.close()
    return found, out


def _adjacency(found) -> float:
    """The share of ids whose next id lies in the next slot."""
    import numpy as np

    return np.mean(np.diff(found.offsets) == found.width)


def test_a_scattered_table_places_each_row_apart_from_its_neighbours(tmp_path):
    """--scattered: the rows are written in a random order, a commit at a time, so that an
    id's neighbours lie elsewhere in the log, as after a long training run; every row is
    there, with the values the store reads back."""
    import numpy as np

    import tierstore

    adjacent = {}
    for scattered in (False, True):
        path = tmp_path / f"store-{scattered}"
        assert bench_scale.prepare_table(path, 5000, 8, 0, scattered=scattered)["scattered"] is scattered
        found, out = _log_layout(path, 5000, copy=True)
        assert len(found.rows) == 5000
        with tierstore.TieredStore(path, readonly=True) as store:
            assert np.array_equal(out.view(np.float32), store.read(bench_scale.TABLE, np.arange(5000)).numpy()[found.rows])
        adjacent[scattered] = _adjacency(found)  # id i + 1 in the slot after id i's
    assert adjacent[False] > 0.99 and adjacent[True] < 0.5


def test_ageing_rewrites_rows_of_random_ids_each_apart_from_its_neighbours(tmp_path):
    """--age-rows: rows of random ids rewritten under the budget, each now apart from its id's
    neighbours as a training run's write-backs leave them; every other row as it was; the rows
    written counted in the marker, and a second ageing draws other ids."""
    import numpy as np

    import tierstore

    path = tmp_path / "store"
    bench_scale.prepare_table(path, 5000, 8, 0)

    def rows_and_adjacency():
        with tierstore.TieredStore(path, readonly=True) as store:
            rows = store.read(bench_scale.TABLE, np.arange(5000)).numpy()
        return rows, _adjacency(_log_layout(path, 5000)[0])

    before, adjacent = rows_and_adjacency()
    first = bench_scale.age_table(path, 5000, 8, 2000, 0, 64 << 20)
    after, aged_adjacent = rows_and_adjacency()
    changed = np.flatnonzero((after != before).any(axis=1))
    assert first["aged_rows"] == first["rows"] == 2000 and 1500 < len(changed) < 2000  # ids drawn with repeats
    assert adjacent > 0.99 and aged_adjacent < 0.7
    second = bench_scale.age_table(path, 5000, 8, 2000, 0, 64 << 20)
    again = np.flatnonzero((rows_and_adjacency()[0] != after).any(axis=1))
    assert second["aged_rows"] == 4000 and 1500 < len(again) < 2000
    assert not np.array_equal(again, changed)
    assert bench_scale.prepare_table(path, 5000, 8, 0)["aged_rows"] == second["aged_rows"]  # the marker keeps it


def test_a_table_declaring_more_rows_than_it_writes(tmp_path):
    """--declared-rows: the table declares them (its num_rows), the first --rows are written."""
    import tierstore

    path = tmp_path / "store"
    built = bench_scale.prepare_table(path, 1000, 8, 0, declared=10**9)
    assert built["declared"] == 10**9 and bench_scale.prepare_table(path, 1000, 8, 0, declared=10**9)["reused"]
    with tierstore.TieredStore(path, readonly=True) as store:
        assert store.spec(bench_scale.TABLE).num_rows == 10**9
        assert store.stats()["rows"]["stored"] == 1000


def _disk_reads() -> int:
    return int(next(line.split()[1] for line in open("/proc/self/io") if line.startswith("read_bytes:")))


def test_a_child_opens_the_store_with_none_of_its_files_cached(tmp_path):
    """Before a child opens the store, its files are dropped from the page cache, the row
    index's as well as data.mdb: read again, each is read from the disk."""
    path = tmp_path / "store"
    bench_scale.prepare_table(path, 20_000, 8, 0)
    files = [path / "data.mdb", *path.glob("index-*.bin")]
    assert len(files) > 1  # the writer's close saved its index
    for f in files:
        f.read_bytes()  # cached
    bench_scale.drop_store_pages(path)
    for f in files:
        before = _disk_reads()
        f.read_bytes()
        read = _disk_reads() - before
        if read == 0 and f.name == "data.mdb":
            pytest.skip("this file system does not count reads in /proc/self/io (tmpfs)")
        assert read >= f.stat().st_size // 2, (f.name, read)


def test_a_runs_floor_is_its_in_memory_step_or_the_rows_no_cache_could_have(tmp_path):
    """The step against max(its in-memory step, the disk time of the rows no earlier step used)."""
    floors = {"disk": {"iops_qd32": 10_000}, "lmdb": {"put_us": None}}
    in_memory = {"dlrm": {"mean_s": 0.05, "lookups_per_s": 1e6}}
    for first_use, floor in ((1000, 0.1), (100, 0.05)):  # 0.1 s of reads; 0.01 s, under the in-memory step
        r = {"kind": "dlrm", "mean_s": 0.12, "lookups_per_s": 5e5, "rows_read_per_step": 2000, "rows_written_per_step": 0,
             "first_use_rows_per_step": first_use}
        bench_scale._ratios(r, floors, in_memory)
        assert r["floor_s"] == pytest.approx(floor) and r["x_floor"] == pytest.approx(0.12 / floor)
    r = {"kind": "emb", "mean_s": 0.12, "lookups_per_s": 5e5, "rows_read_per_step": 2000, "rows_written_per_step": 0}
    bench_scale._ratios(r, floors, {"skipped": "--no-in-memory"})
    assert r["floor_s"] is None and r["x_floor"] is None and r["x_in_memory"] is None
    assert r["disk_floor_s"] == pytest.approx(0.2)
    # the disk measured as the run started, where it was: the run's floor is that minute's
    r = {"kind": "emb", "mean_s": 0.12, "lookups_per_s": 5e5, "rows_read_per_step": 2000, "rows_written_per_step": 0,
         "disk_iops_qd32": 40_000}
    bench_scale._ratios(r, floors, {"skipped": "--no-in-memory"})
    assert r["disk_floor_s"] == pytest.approx(0.05) and r["x_disk_floor"] == pytest.approx(2.4)


def test_the_log_floor_reads_each_rows_newest_copy_with_lmdb_alone(tmp_path):
    """The LMDB floor's own reader (py-lmdb over the segments) finds the bytes the store
    reads, rewritten rows' newest copies included, and times a get and a put."""
    import lmdb
    import numpy as np

    import tierstore

    path = tmp_path / "store"
    bench_scale.prepare_table(path, 5000, 8, 0)
    rng = np.random.default_rng(1)
    rewritten = np.unique(rng.integers(0, 5000, 700))
    with tierstore.TieredStore(path, [bench_scale.table_spec(5000, 8)], hbm_rows=0, ddr_rows=0, device="cpu") as store:
        store.write(bench_scale.TABLE, rewritten, rng.standard_normal((len(rewritten), 8), dtype=np.float32))
        store.flush()
        asked = np.unique(rng.integers(0, 5000, 900))
        expected = store.read(bench_scale.TABLE, asked).numpy()
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=1024)
    try:
        db = env.open_db(b"s:" + bench_scale.TABLE.encode(), create=False)
        found = bench_floors.locate_log_rows(env, db, asked)
        out = np.empty((len(found.rows), found.width), dtype=np.uint8)
        bench_floors.copy_log_rows(env, db, found, out)
    finally:
        env.close()
    assert len(found.rows) == len(asked) and found.width == 8 * 4
    assert np.array_equal(out.view(np.float32), expected[found.rows])
    floor = bench_floors.lmdb_floor(path, bench_scale.TABLE, asked)
    assert floor["layout"] == "log" and floor["rows"] == len(asked) and floor["segments"] == len(found.segments) >= 2
    assert all(floor[k] > 0 for k in ("get_cold_us", "get_warm_us", "put_us"))
    assert not any(p.name.endswith("-lmdb-floor") for p in tmp_path.iterdir())  # the scratch put's files are gone


def test_each_run_renames_its_ids_and_counts_rows_no_earlier_step_used(tmp_path):
    """Runs on one table get different salts, so none reads a layout that an earlier run of
    the same ids wrote; a renamed batch keeps its duplicates and bags; the first-use count
    agrees with a plain set."""
    import numpy as np

    path = tmp_path / "store"
    bench_scale.prepare_table(path, 1000, 8, 0)
    salts = [bench_scale._next_salt(path) for _ in range(3)]
    assert len(set(salts)) == 3
    assert bench_scale.prepare_table(path, 1000, 8, 0)["runs"] == 3  # counted in the marker, which reuse keeps
    job = {"rows": 1000, "dim": 8, "bags": 16, "seed": 0, "steps": 6, "warmup": 2, "kind": "emb"}
    plain = bench_scale._emb_batches(1000, 6, 0, 16)
    renamed = [bench_scale._relabeled(plain, {**job, "layout_salt": s}) for s in salts[:2]]
    assert not all(bench_scale.torch.equal(a, b) for a, b in zip(*renamed))
    for a, b in zip(plain, renamed[0]):
        forward, backward = {}, {}
        for x, y in zip(a.tolist(), b.tolist()):  # a bijection between each step's ids
            assert forward.setdefault(x, y) == y and backward.setdefault(y, x) == x
    seen, new = set(), []
    for b in renamed[0]:
        ids = set(b.tolist())
        new.append(len(ids - seen))
        seen |= ids
    assert bench_scale._first_use_rows(renamed[0], 1000, 2) == sum(new[2:]) / 4 > 0
    dlrm = bench_scale._dlrm_parts({**job, "kind": "dlrm", "rows": 1000})
    out = bench_scale._relabeled(dlrm, {**job, "kind": "dlrm", "layout_salt": salts[0]})
    (d0, s0, l0), (d1, s1, l1) = dlrm[0][0], out[0][0]
    assert d0 is d1 and l0 is l1 and np.array_equal(s0["cat0"][1], s1["cat0"][1])
    assert len(set(s1["cat0"][0].tolist())) == len(set(s0["cat0"][0].tolist()))


def test_the_policy_given_is_the_stores_and_the_capacity_replay_predicts_it(tmp_path, capsys, monkeypatch, quick):
    monkeypatch.setattr(bench_scale, "CGROUP_V1", tmp_path / "no-v1")
    monkeypatch.setattr(bench_scale, "CGROUP_V2", tmp_path / "no-v2")
    runs = {}
    for policy in ("lfu", "lru"):
        assert cli.main(["bench", "scale", "--rows", "200000", "--dim", "16", "--budgets", "7MiB", "--depths", "0",
                         "--repeat", "3", "--path", str(tmp_path / "store"), "--no-in-memory", "--policy", policy,
                         "--json"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["table"]["policy"] == policy
        (run,) = res["runs"]
        runs[policy] = run
        # the replay of the run's trace under that policy gives the store's own DDR counts, to the row
        got, p = run["ddr_since_open"], run["predicted"]
        assert p["policy"] == policy and p["replay"] == got and got["evictions"] > 0
        assert ("curve" in p) == (policy == "lru")  # the one-pass curve is LRU's alone
    assert runs["lfu"]["ddr_since_open"] != runs["lru"]["ddr_since_open"]
    with pytest.raises(SystemExit):
        cli.main(["bench", "scale", "--policy", "fifo"])
    assert "invalid choice: 'fifo'" in capsys.readouterr().err
