"""The benchmarks' own accounting (their figures are only as good as it is)."""
import os
import threading
import time

import pytest

from tierstore.tools import bench_prefetch


TICK = 0.01  # /proc counts CPU in ticks of 10 ms: a reading may fall short by one
HAIR = 1e-9  # and a difference of summed ticks by a float rounding (0.18 read as 0.17999999999999972)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_per_thread_goes_to_the_thread_that_spent_it():
    before = bench_prefetch._cpu_seconds()
    stop = threading.Event()
    worker = threading.Thread(target=lambda: (_spin(0.3), stop.wait()), name="tierstore-prefetch-0")
    worker.start()
    time.sleep(0.05)
    _spin(0.1)  # the trainer's own
    deadline = time.monotonic() + 30
    while bench_prefetch._cpu_seconds().get("prefetch", 0.0) - before.get("prefetch", 0.0) < 0.28 and time.monotonic() < deadline:
        time.sleep(0.01)
    spent = bench_prefetch._since(before, bench_prefetch._cpu_seconds())
    stop.set()
    worker.join()
    assert 0.28 <= spent["prefetch"] <= 0.5
    assert 0.1 - 2 * TICK - HAIR <= spent["trainer"] < 0.28  # the spin and the polling, not the worker's
    assert spent["all"] >= spent["prefetch"] + spent["trainer"] - 2 * TICK - HAIR


def test_cpu_of_a_thread_that_ended_goes_to_the_write_back_thread():
    """The write-back thread ends whenever its queue is empty: its CPU must not be lost."""
    before = bench_prefetch._cpu_seconds()
    writer = threading.Thread(target=_spin, args=(0.2,), name="tierstore-writeback")
    writer.start()
    writer.join()
    spent = bench_prefetch._since(before, bench_prefetch._cpu_seconds())
    assert 0.2 - 2 * TICK - HAIR <= spent["write-back"] <= 0.4
    assert spent["trainer"] < 0.1


def test_without_per_thread_figures_only_the_total_is_reported():
    """Where /proc is missing, the CPU is not put on any one thread."""
    spent = bench_prefetch._since({"all": 1.0}, {"all": 1.5})
    assert spent == {"all": 0.5}
    assert bench_prefetch._per_row([spent]) == "500000.0 us"


def test_instruction_counts_read_every_thread_main_first(tmp_path):
    from tierstore.tools import bench_instructions as bi
    out = tmp_path / "cg.out"
    for n, total in (("01", 1000), ("02", 20), ("10", 300)):
        (tmp_path / f"cg.out-{n}").write_text(f"# callgrind format\nversion: 1\nsummary: {total}\n")
    (tmp_path / "other.out-01").write_text("summary: 5\n")
    assert bi._thread_totals(out) == [1000, 20, 300]


def test_instruction_bench_workload_runs_and_moves_rows(tmp_path, monkeypatch):
    """The child callgrind runs (a small table: the count itself needs valgrind)."""
    import numpy as np

    import tierstore
    from tierstore.tools import bench_instructions as bi

    monkeypatch.setattr(bench_prefetch, "ROWS", 20_000)
    base = str(tmp_path / "rows")
    with tierstore.TieredStore(base, [tierstore.TableSpec("t0", 20_000, bench_prefetch.DIM)], device="cpu") as s:
        s.write("t0", np.arange(20_000), np.ones((20_000, bench_prefetch.DIM), dtype=np.float32))
    moved = bi._workload(base, 3, 2, 5)
    assert moved > 3 * bi.BAGS  # misses, evictions and write-backs of three steps over a 5% cache


def test_instruction_bench_says_so_without_valgrind(monkeypatch, capsys):
    import argparse

    from tierstore.tools import bench_instructions as bi

    monkeypatch.setattr(bi.shutil, "which", lambda name: None)
    bi.run(argparse.Namespace(dir=None))
    assert "valgrind is not installed" in capsys.readouterr().out


def test_evict_bench_reads_evict_and_prints_each_setting(tmp_path, capsys):
    import argparse

    from tierstore.tools import bench_store

    results = bench_store.bench_evict(argparse.Namespace(rows=4096, batch=1024, repeat=2, seed=0, dir=str(tmp_path)))
    assert all(evicted >= 1024 // 16 for *_, evicted in results.values())  # every evicting read's misses made room
    out = capsys.readouterr().out
    for setting in ("lru, eviction=policy", "lfu, eviction=policy", "lru, eviction=lookahead"):
        assert setting in out
    assert "worst setting" in out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bench_read_train_and_peers_run_where_they_are_told(device, capsys, tmp_path):
    """`tierstore bench read/train/peers --device`: on a GPU both sides run there (the
    store's HBM tier holds the rows); tiny sizes, so only that they run and check themselves."""
    from tierstore.tools import cli

    small = ["--rows", "20000", "--batch", "2048", "--repeat", "2", "--dir", str(tmp_path), "--device", device]
    for bench in ("read", "train", "peers"):
        assert cli.main(["bench", bench, *small]) == 0
    out = capsys.readouterr().out
    assert out.replace(":0", "").count(f"device={device}") == 3
    assert out.count("HBM misses while timed 0;") == 2  # SGD and Adagrad: the working rows stayed resident


def test_bench_prefetch_measures_lmdb_on_a_copy_of_its_table(tmp_path):
    """Its LMDB floor opens the bench's table (the log layout, which needs the row count)
    through the backend: `tierstore bench prefetch` stopped there, before any setting ran."""
    base = str(tmp_path / "rows")
    bench_prefetch.write_rows(base)
    get, put, cold = bench_prefetch.lmdb_floor(base, rows=256, rounds=1)
    assert get > 0 and put > 0 and cold >= 0  # seconds a row: measured, whatever the machine


def test_bench_scale_keeps_the_cpu_of_threads_that_ended():
    """bench scale's CPU by thread: a thread that ends between the two readings (the
    write-back thread, whenever its queue is empty) is counted, as "ended threads"."""
    from tierstore.tools import bench_scale
    before = bench_scale._thread_cpu()
    writer = threading.Thread(target=_spin, args=(0.2,), name="tierstore-writeback")
    writer.start()
    writer.join()
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/self/task/{writer.native_id}") and time.monotonic() < deadline:
        time.sleep(0.001)  # join() returns before the kernel has taken the thread off /proc
    spent = bench_scale._per_step(before, bench_scale._thread_cpu(), 1)
    assert 200 - 2e3 * (TICK + HAIR) <= spent["ended threads"] <= 400
    assert "tierstore-writeback" not in spent
