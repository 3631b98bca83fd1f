"""What a newcomer meets first: a module that would
train nothing says so, Ctrl-C ends a command with one line, the demo's summary
reads right at the edges, and the CLI's errors are in CLI terms."""
from __future__ import annotations

import importlib.metadata
import os
import select
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import tierstore
import tierstore.capacity.planner
import tierstore.tools.plan_cli
import tierstore.tools.demo
import tierstore.tools.synth
from tierstore.tools.cli import _parsers, build_parser, main, parse_size
from tierstore.tools.demo import DemoConfig, RunResult, StoreFigures, summary_lines
from tierstore.trace import Trace, TraceTable

CLI = [sys.executable, "-W", "error", "-m", "tierstore.tools.cli"]
IDS, OFFSETS = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# -- item 4: a module without an optimizer ---------------------------------------------------------
def untrained_warnings(module, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = module(*args)
    assert not (out.requires_grad if isinstance(out, torch.Tensor) else any(v.requires_grad for v in out.values()))
    return [str(w.message) for w in caught if "has no optimizer" in str(w.message)]


def test_a_training_forward_without_an_optimizer_warns_once(tmp_path):
    emb = tierstore.TieredEmbeddingBag(100, 4, path=tmp_path / "s", device="cpu")
    first = untrained_warnings(emb, IDS, OFFSETS)
    assert len(first) == 1 and "table 't0'" in first[0] and "optimizer=" in first[0] and ".eval()" in first[0]
    assert untrained_warnings(emb, IDS, OFFSETS) == []  # once per module
    emb.close()

    ebc = tierstore.TieredEmbeddingBagCollection([tierstore.TableSpec("a", 50, 4), tierstore.TableSpec("b", 50, 4)],
                                                 path=tmp_path / "c", device="cpu")
    got = untrained_warnings(ebc, {"a": (IDS, OFFSETS), "b": (IDS, OFFSETS)})
    assert len(got) == 1 and "table 'a', 'b'" in got[0]  # one warning for the collection
    ebc.close()


def test_inference_and_frozen_rows_are_said_explicitly(tmp_path):
    emb = tierstore.TieredEmbeddingBag(100, 4, path=tmp_path / "s", device="cpu")
    emb.eval()
    assert untrained_warnings(emb, IDS, OFFSETS) == []
    emb.train()
    with torch.no_grad():
        assert untrained_warnings(emb, IDS, OFFSETS) == []
    with pytest.raises(ValueError, match="needs an optimizer"):
        emb.requires_grad_(True)  # nothing could train the rows
    assert emb.requires_grad_(False) is emb
    assert untrained_warnings(emb, IDS, OFFSETS) == []
    emb.close()
    with tierstore.TieredStore(tmp_path / "s", readonly=True) as ro:
        assert untrained_warnings(tierstore.TieredEmbeddingBag(100, 4, store=ro), IDS, OFFSETS) == []
    frozen = tierstore.TieredEmbeddingBag.from_pretrained(torch.ones(10, 4), path=tmp_path / "p", device="cpu")
    assert untrained_warnings(frozen, IDS, OFFSETS) == []
    frozen.close()


def test_requires_grad_false_freezes_a_module_with_an_optimizer(tmp_path):
    """As torch freezes a module: the output has no grad and backward changes no row."""
    emb = tierstore.TieredEmbeddingBag(100, 4, mode="sum", path=tmp_path / "s", device="cpu",
                                       optimizer=tierstore.optim.SGD(lr=0.5))
    before = emb.store.read("t0", IDS).clone()
    emb.requires_grad_(False)
    dense = torch.ones(2, 4, requires_grad=True)
    (emb(IDS, OFFSETS) * dense).sum().backward()
    assert torch.equal(emb.store.read("t0", IDS), before)
    emb.requires_grad_(True)
    (emb(IDS, OFFSETS) * dense).sum().backward()
    assert not torch.equal(emb.store.read("t0", IDS), before)
    emb.close()


# -- item 5: Ctrl-C ---------------------------------------------------------------------------------
def test_ctrl_c_in_the_demo_ends_with_one_line_and_a_consistent_store(tmp_path):
    d = tmp_path / "demo"
    # Ctrl-C as at a terminal: a suite started in the background by a shell without job control
    # inherits SIGINT ignored, and Python then keeps it ignored in the demo
    proc = subprocess.Popen([*CLI, "demo", "--dir", str(d), "--steps", "1000000", "--batch", "16", "--rows", "2000",
                             "--hbm-rows", "32", "--ddr-rows", "128", "--tables", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        shown = b""
        while b"10/1" not in shown:  # progress after 10 steps: training has begun
            assert select.select([proc.stderr], [], [], 120)[0], "no progress from the demo in 120 s"
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, shown.decode()
            shown += chunk
        proc.send_signal(signal.SIGINT)
        out, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = out.decode(), (shown + rest).decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    *progress, last = err.strip().splitlines()
    assert all(line.startswith("tierstore: ") and " steps (" in line for line in progress), err
    assert last == (f"tierstore: interrupted; the store in {d} is consistent but only partly trained (the demo flushes "
                    "at its end); rerun `tierstore demo` to train afresh")
    assert out == ""
    with tierstore.TieredStore(d / "store", readonly=True) as store:  # opens, as of its last commit
        assert store.read("cat0", torch.arange(2000)).shape == (2000, 16)


def test_ctrl_c_in_the_demo_after_training_says_the_store_is_complete(tmp_path, monkeypatch, capsys):
    d = tmp_path / "demo"
    monkeypatch.setattr(tierstore.tools.demo, "serve", interrupt)  # Ctrl-C in the serving step
    assert main(["demo", "--dir", str(d), "--steps", "3", "--batch", "16", "--rows", "2000", "--hbm-rows", "32",
                 "--ddr-rows", "128", "--tables", "2", "--no-progress"]) == 130
    assert one_line(capsys) == (f"tierstore: interrupted; training had finished: the store in {d / 'store'} and its "
                                "checkpoint are complete; what followed (the serving step, --compare) was cut short: "
                                "--no-serve skips serving")
    with tierstore.TieredStore(d / "checkpoint", readonly=True) as store:
        assert store.read("cat0", torch.arange(2000)).shape == (2000, 16)


def small_trace(path: Path, rows: int = 100) -> Path:
    rng = np.random.default_rng(0)
    tables = [TraceTable("a", rows, 8), TraceTable("b", rows, 8)]
    return Trace.from_calls([(s, t, rng.choice(rows, 20, replace=False)) for s in range(4) for t in ("a", "b")],
                            tables=tables).save(path)


def interrupt(*_args, **_kwargs):
    raise KeyboardInterrupt  # what Ctrl-C raises in the main thread, wherever it is


def test_ctrl_c_in_plan_and_trace_synth_says_what_was_kept(tmp_path, monkeypatch, capsys):
    trace = small_trace(tmp_path / "t.npz")
    monkeypatch.setattr(tierstore.capacity.planner, "plan", interrupt)
    assert main(["plan", str(trace), "--world-size", "2"]) == 130
    assert one_line(capsys) == "tierstore: interrupted; no plan was printed; nothing was written"
    monkeypatch.setattr(tierstore.tools.synth, "synth", interrupt)
    assert main(["trace", "synth", str(tmp_path / "s.npz"), "--rows", "100"]) == 130
    assert one_line(capsys) == f"tierstore: interrupted; no trace was written to {tmp_path / 's.npz'}, or only part of one; rerun to write it"


# -- item 8: the demo's summary ---------------------------------------------------------------------
def stats(hbm=(0, 0), ddr=(0, 0), reads=0, initial=0) -> dict:
    tier = lambda h, m: {"hits": h, "misses": m, "evictions": 0, "writebacks": 0}  # noqa: E731
    return {"hbm": tier(*hbm), "ddr": tier(*ddr),
            "ssd": {"reads": reads, "writes": 5, "read_bytes": 0, "write_bytes": 0, "initial": initial}}


def summary(cfg: DemoConfig, losses: list[float], st: dict) -> dict[str, str]:
    run = RunResult(losses, 2.0, 0.69, 0.5)
    figures = StoreFigures(st, {n: {"hbm": 0, "ddr": 0} for n in cfg.table_names}, 128, 32, 1.0, Path("d/store"),
                           Path("d/checkpoint"))
    lines = summary_lines(cfg, run, figures)
    return {line.split()[0]: line for line in lines[1:]}


def test_summary_without_memory_tiers():
    s = summary(DemoConfig(steps=4, hbm_rows=0, ddr_rows=0), [0.7, 0.6, 0.5, 0.4], stats(reads=900, initial=800))
    assert "no HBM or DDR tier" in s["tables"] and "smaller than the table" not in s["tables"]
    assert "of 0 row lookups" not in s["served"] and "-" not in s["served"].split()
    assert "by LMDB or its write-back queue" in s["served"]
    assert "900 rows looked up (800 of them not on disk yet" in s["lmdb"]
    assert "a row in LMDB" in s["rows"]


def test_summary_tiers_name_what_they_hold():
    s = summary(DemoConfig(rows=1000, hbm_rows=0, ddr_rows=400), [0.5] * 4, stats(ddr=(30, 70)))
    assert "no HBM tier, DDR 400 rows (2.5x smaller than the table)" in s["tables"]
    assert "hbm 0% ddr 30% lmdb 70% of 100 row lookups; DDR hit rate 30%" in s["served"]  # DDR counts every lookup
    s = summary(DemoConfig(rows=1000, hbm_rows=10, ddr_rows=5000), [0.5] * 4, stats(hbm=(60, 40), ddr=(30, 10)))
    assert "HBM 10 rows, DDR 5,000 rows (holds the whole table)" in s["tables"]
    assert "of 100 row lookups; DDR hit rate on HBM misses 75%" in s["served"]


@pytest.mark.parametrize("n, expect", [
    (20, "first 10 steps 0.9775 -> last 10 steps 0.9275"),  # never the same steps at both ends
    (200, "first 50 steps 0.8775 -> last 50 steps 0.1275"),
    (3, "first step 1.0000 -> last step 0.9900"),
    (1, "loss 1.0000 (one step)"),
])
def test_summary_loss_windows_do_not_overlap(n, expect):
    losses = [1.0 - 0.005 * i for i in range(n)]
    assert f"loss       {expect};" in summary(DemoConfig(steps=n), losses, stats(hbm=(1, 1)))["loss"]


def test_summary_names_float32_row_bytes_only_for_half_weights():
    assert "(with float32 weights" not in summary(DemoConfig(), [0.5] * 4, stats(hbm=(1, 1)))["rows"]
    assert "(with float32 weights: 128)" in summary(DemoConfig(dtype="float16"), [0.5] * 4, stats(hbm=(1, 1)))["rows"]


def test_demo_progress_to_a_file_is_lines(tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as f:
        r = subprocess.run([*CLI, "demo", "--dir", str(tmp_path / "d"), "--steps", "12", "--batch", "16", "--rows", "500",
                            "--hbm-rows", "16", "--ddr-rows", "64", "--tables", "2"], stdout=subprocess.PIPE, stderr=f,
                           text=True, timeout=240)
    assert r.returncode == 0, log.read_text()
    text = log.read_text()
    assert "\r" not in text
    lines = text.strip().splitlines()
    assert lines[-1].startswith("tierstore: 12/12 steps (100%") and "done in" in lines[-1] and "loss=" in lines[-1], text
    assert "first 6 steps" in r.stdout


# -- item 10: errors in CLI terms -------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("16G", 16 * 10**9), ("1.5GiB", 3 * 2**29), ("512MB", 512 * 10**6),
                                         ("17179869184", 2**34), (" 2 k ", 2000), (".5Ki", 512)])
def test_sizes_read_every_documented_form(text, value):
    assert parse_size(text, "--hbm-bytes") == value


@pytest.mark.parametrize("bad", ["1.5.3G", "G", "-1G", "16X", "1e9", ""])
def test_a_bad_size_names_its_flag_and_the_forms(bad, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--ddr-bytes '.*' is not a size; write a number of bytes"):
        parse_size(bad, "--ddr-bytes")
    trace = small_trace(tmp_path / "t.npz")
    for verb in (["plan", str(trace), "--world-size", "2"], ["capacity", str(trace)]):
        with pytest.raises(SystemExit) as e:
            main([*verb, f"--hbm-bytes={bad}"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"argument --hbm-bytes: must be a size, got {bad!r}; write a number of bytes" in err and "e.g. 16G" in err
        assert "convert" not in err


def test_os_errors_name_the_path_and_what_to_do(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "demo"  # under a file: no directory can be made there
    assert main(["demo", "--dir", str(bad), "--steps", "1"]) == 2
    assert one_line(capsys) == (f"tierstore: error: --dir {bad}: cannot make a directory there (not a directory); pass --dir "
                                "with a path in a directory you can write to")
    assert main(["trace", "calibrate", str(tmp_path / "missing.txt")]) == 2
    assert one_line(capsys) == f"tierstore: error: {tmp_path / 'missing.txt'}: no such file or directory; check the path " \
                               "(a file to write needs its directory to exist)"


def test_a_locked_store_gets_command_line_advice_only(tmp_path, capsys):
    path = tmp_path / "s"
    tierstore.TieredStore(path, [tierstore.TableSpec("t", 10, 4)], device="cpu", registry=CollectorRegistry()).close()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, tierstore; s = tierstore.TieredStore(sys.argv[1], "
                               "device='cpu'); print('open', flush=True); sys.stdin.read()", str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        assert main(["compact", str(path)]) == 2
    finally:
        holder.communicate("", timeout=60)
    err = one_line(capsys)
    assert err == (f"tierstore: error: tierstore at {path} is open for writing by another process (pid {holder.pid}); "
                   "stop that process first, or read the store while it runs with `tierstore stats PATH`")


def test_help_is_plain_text_and_the_version_comes_from_the_package(capsys):
    for p in _parsers(build_parser()):
        for text in [p.description or ""] + [a.help or "" for a in p._actions]:
            assert "``" not in text, (p.prog, text)
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0 and "`tierstore demo`: train a small DLRM" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"tierstore {importlib.metadata.version('tierstore')}\n"


def test_version_help_and_a_bad_verb_answer_without_importing_torch():
    """They took 1.3-5 s: every verb's module, and so torch, was imported first."""
    for argv in (["--version"], ["--help"], ["nope"], []):
        code = f"""import sys
from tierstore.tools.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print('torch' in sys.modules, 'tierstore.tools.bench' in sys.modules)"""
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.stdout.splitlines()[-1] == "False False", (argv, done.stdout, done.stderr)
    assert "prefetchd" in subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60).stdout


def test_every_verb_keeps_its_help_line_when_its_module_is_not_loaded():
    full, light = build_parser(), build_parser("")
    helps = [{a.dest: a.help for a in p._subparsers._group_actions[0]._choices_actions} for p in (full, light)]
    assert helps[0] == helps[1] and len(helps[0]) == 9


def test_ctrl_c_while_a_verb_imports_torch_is_one_line(tmp_path):
    """A Ctrl-C in a command's first seconds printed a 32-58-line KeyboardInterrupt traceback."""
    proc = subprocess.Popen([*CLI, "stats", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        maps = Path(f"/proc/{proc.pid}/maps")
        while proc.poll() is None and "libtorch" not in maps.read_text(errors="replace"):
            pass  # until torch's library is mapped: its import has begun, seconds before it ends
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err.decode(), out) == (130, "tierstore: interrupted\n", b"")


def unreachable(*_args, **_kwargs):
    raise AssertionError("planned before the world size was checked")


def test_plan_checks_the_world_size_before_planning(tmp_path, monkeypatch, capsys):
    trace = small_trace(tmp_path / "t.npz", rows=100)
    monkeypatch.setattr(tierstore.capacity.planner, "plan", unreachable)  # the check comes first
    assert main(["plan", str(trace), "--world-size", "201"]) == 2
    assert one_line(capsys) == ("tierstore: error: --world-size 201 is more ranks than the trace's tables split into (200 "
                                "shards at most: a table splits by rows, or by columns if it has more); pass --world-size 200 or less")
    monkeypatch.undo()
    monkeypatch.setattr(tierstore.tools.plan_cli, "SLOW_CHECKS", 100)  # as if the trace were long
    assert main(["plan", str(trace), "--world-size", "200"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("tierstore plan: matching 160 trace accesses to 200 ranks (about 3.2e+04 id checks) may take "
                            "minutes; Ctrl-C stops it\n")
    assert "on 200 ranks" in captured.out


def test_ssd_read_counters_agree_on_what_was_read(tmp_path):
    """read_rows counts every LMDB lookup; initial_rows those LMDB did not hold; read_bytes the rest."""
    from prometheus_client import generate_latest

    reg = CollectorRegistry()
    spec = tierstore.TableSpec("t", 1000, 4)
    with tierstore.TieredStore(tmp_path / "s", [spec], device="cpu", registry=reg, name="s") as store:
        store.read("t", torch.arange(100))  # never written
        store.write("t", torch.arange(30), torch.ones(30, 4))
        store.flush()
        store.read("t", torch.arange(50))  # 30 on disk, 20 not
        ssd = store.stats()["ssd"]
        assert (ssd["reads"], ssd["initial"], ssd["read_bytes"]) == (150, 120, 30 * spec.row_bytes)
        text = generate_latest(reg).decode()
    assert 'tierstore_ssd_read_rows_total{store="s",table="t"} 150.0' in text
    assert 'tierstore_ssd_initial_rows_total{store="s",table="t"} 120.0' in text
    assert f'tierstore_ssd_read_bytes_total{{store="s",table="t"}} {30.0 * spec.row_bytes}' in text
