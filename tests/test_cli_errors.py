"""A new user's mistakes on the command line: the real CLI in subprocesses (a
real daemon, real stores, real sockets) ends each with one `tierstore: error:`
line and exit code 2, and no warning leaks out of its paths."""
from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import tierstore
import tierstore.tools.stats
from tierstore.tools.cli import _parsers, build_parser, main
from tierstore.trace import Trace

from test_daemon import ready_metrics_port

USER = tierstore.TableSpec("user", 10_000, 4)
CLI = [sys.executable, "-W", "error", "-m", "tierstore.tools.cli"]  # warnings are errors: none may leak


def make_store(path: Path) -> Path:
    tierstore.TieredStore(path, [USER], device="cpu", registry=CollectorRegistry()).close()
    return path


def start(*args: str, cwd=None) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)


def user_error(proc: subprocess.Popen) -> str:
    """The one error line a failed command ends with (no traceback)."""
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tierstore: error: "), err
    return last


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A prefetchd (warnings as errors) prefetching a trace's steps for its
    clients, on a store with a metrics port."""
    tmp = tmp_path_factory.mktemp("served")
    store = make_store(tmp / "store")
    rng = np.random.default_rng(0)
    Trace.from_calls([(s, "user", rng.choice(10_000, 50, replace=False)) for s in range(6)], tables=["user"]).save(tmp / "trace")
    sockdir = Path(tempfile.mkdtemp(prefix="tsc-"))  # short: Unix socket paths are limited to ~104 bytes
    proc = start("prefetchd", str(store), "--socket", str(sockdir / "a.sock"), "--ddr-rows", "1000",
                 "--lookahead-source", str(tmp / "trace"), "--depth", "2", "--metrics-port", "0")
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("ready"), proc.stderr.read()
        port = ready_metrics_port(ready)  # the free port it bound: nothing can take it between a pick and the bind
        yield argparse.Namespace(tmp=tmp, store=store, sockdir=sockdir, port=port, proc=proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
        shutil.rmtree(sockdir, ignore_errors=True)


def test_prefetchd_start_up_errors_are_one_line_a_cli_user_can_act_on(served, capsys):
    other = make_store(served.tmp / "other")
    serving = start("prefetchd", str(other), "--socket", str(served.sockdir / "a.sock"), "--ddr-rows", "10")
    locked = start("prefetchd", str(served.store), "--socket", str(served.sockdir / "b.sock"), "--ddr-rows", "10")
    err = user_error(serving)
    assert "already serving" in err and "--socket" in err
    err = user_error(locked)
    assert f"pid {served.proc.pid}" in err and "stop that process first" in err
    assert not (served.sockdir / "b.sock").exists()

    # the same dispatch in this process (a process each costs seconds)
    assert main(["prefetchd", str(other), "--socket", str(served.sockdir / "c.sock"), "--ddr-rows", "10",
                 "--metrics-port", str(served.port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tierstore: error: ") and "another metrics port" in err and "port=" not in err
    assert main(["prefetchd", str(served.tmp / "nostore"), "--socket", str(served.sockdir / "d.sock"), "--ddr-rows", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tierstore: error: no tierstore at") and "tierstore demo" in err and "tables=[...]" in err
    assert not (served.tmp / "nostore").exists()  # refused before anything was created


def test_prefetchd_lookahead_leaks_no_warning(served):
    """The trace's ids are memory-mapped read-only: the store copies them instead
    of letting torch warn (under -W error the lookahead thread would fail)."""
    client = tierstore.open_store(served.store, daemon=str(served.sockdir / "a.sock"), readonly=True, client="c")
    try:
        assert client.daemon_stats()["metrics_port"] == served.port
        client.report_step(0)
        deadline = time.monotonic() + 60
        while client.daemon_stats()["prefetch"]["user"]["issued_batches"] < 2:  # steps 1 and 2
            assert served.proc.poll() is None and time.monotonic() < deadline, "lookahead issued nothing"
            time.sleep(0.05)
    finally:
        client.close()
    served.proc.send_signal(signal.SIGTERM)
    _, err = served.proc.communicate(timeout=60)
    assert served.proc.returncode == 0, err
    assert "Warning" not in err and "failed" not in err, err


def test_store_takes_read_only_arrays_without_a_warning(tmp_path):
    ids = np.arange(10)
    values = np.ones((10, 4), dtype=np.float32)
    ids.flags.writeable = values.flags.writeable = False
    with tierstore.TieredStore(tmp_path / "s", [USER], device="cpu", registry=CollectorRegistry()) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            store.write("user", ids, values)
            store.prefetch("user", ids).wait()
            assert (store.read("user", ids) == 1).all()


def test_store_path_mistakes_say_how_to_get_a_store(tmp_path, capsys):
    """`tierstore stats tierstore-demo`, the README's folder: before the demo ran, and after."""
    before = user_error(start("stats", "tierstore-demo", cwd=tmp_path))
    assert "no tierstore at tierstore-demo" in before and "`tierstore demo`" in before and "open it once" not in before
    demo = tmp_path / "tierstore-demo"
    make_store(demo / "store")
    make_store(demo / "checkpoint")
    assert main(["stats", str(demo)]) == 2
    assert capsys.readouterr().err.strip() == (f"tierstore: error: no tierstore at {demo} (no data.mdb), but it holds the "
                                               f"stores {demo}/checkpoint, {demo}/store: pass one of them")


def test_a_file_of_a_trace_directory_is_named(tmp_path, capsys):
    Trace.from_calls([(0, "user", np.arange(5))], tables=["user"]).save(tmp_path / "t")
    assert main(["trace", "info", str(tmp_path / "t" / "ids.npy")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tierstore: error: {tmp_path}/t/ids.npy is neither a trace directory nor a trace .npz; "
                   f"it is one array of the trace directory {tmp_path}/t: pass that")


@pytest.mark.parametrize("argv, expect", [
    (["capacity", "t", "--hit", "1.5"], "argument --hit: must be a ratio in (0, 1], got 1.5"),
    (["capacity", "t", "--shards", "0"], "argument --shards: must be a ratio in (0, 1], got 0"),
    (["trace", "synth", "out", "--rows", "0"], "argument --rows: must be an integer >= 1, got 0"),
    (["trace", "synth", "out", "--alpha", "x"], "argument --alpha: must be a number > 0, got 'x'"),
    (["prefetchd", "s", "--socket", "x", "--ddr-rows", "1", "--policy", "mru"], "argument --policy: invalid choice: 'mru'"),
    (["demo", "--policy", "mru"], "argument --policy: invalid choice: 'mru'"),
])
def test_bad_options_are_named_as_typed(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert expect in capsys.readouterr().err.strip().splitlines()[-1]


def test_every_option_of_every_verb_has_help_and_shows_its_default(capsys):
    for p in _parsers(build_parser()):
        for a in p._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                assert a.help, f"{p.prog} {a.option_strings or a.dest} has no help"
                if a.dest == "policy":
                    assert a.choices, f"{p.prog} --policy takes free text"
    for verb in (["demo"], ["prefetchd"], ["trace", "synth"]):
        with pytest.raises(SystemExit):
            main([*verb, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "(default: " in out
    assert "POOLING ids per sample" in out and "(default: 2048)" in out  # trace synth


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    make_store(tmp_path / "s")
    monkeypatch.setattr(tierstore.tools.stats, "read_facts", lambda path: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["stats", str(tmp_path / "s")])


def test_demo_compare_leaks_no_warning(tmp_path):
    """torch's sparse-invariants warning fires once per process: a process of its own."""
    tiny = ["--steps", "4", "--batch", "16", "--rows", "500", "--hbm-rows", "16", "--ddr-rows", "64", "--tables", "2"]
    r = subprocess.run([*CLI, "demo", "--dir", str(tmp_path / "d"), *tiny, "--compare", "--no-progress"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr
    assert "-> AGREE" in r.stdout


def test_output_cut_short_by_its_reader_is_not_an_error(tmp_path):
    # `tierstore stats PATH --json | head`: more output than a pipe holds, and a reader that leaves
    tables = [tierstore.TableSpec(f"table_{i:04d}", 10, 2) for i in range(600)]
    tierstore.TieredStore(tmp_path / "s", tables, device="cpu", registry=CollectorRegistry()).close()
    p = subprocess.Popen([*CLI, "stats", str(tmp_path / "s"), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(10)
    p.stdout.close()
    assert p.wait(timeout=60) == 0
    assert p.stderr.read() == b""
