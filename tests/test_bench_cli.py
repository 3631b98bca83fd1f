"""`tierstore bench`'s command line: each benchmark its own options and help, the list of
benchmarks without torch, and several benchmarks in one command."""
from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys

import pytest

from tierstore.tools.bench import BENCHES, DEFAULT, benchmark_parser
from tierstore.tools.cli import main


def _words(text: str) -> str:
    return " ".join(text.split())


def _help(name: str) -> str:
    return benchmark_parser(name).format_help()


def test_bench_help_lists_every_benchmark_without_importing_torch():
    code = """import sys
from tierstore.tools.cli import main
try:
    main(["bench", "--help"])
except SystemExit:
    pass
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("tierstore.tools.bench_")))"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    *lines, loaded = done.stdout.splitlines()
    assert loaded == "[]", done.stderr
    out = "\n".join(lines)
    for name, bench in BENCHES.items():
        assert re.search(rf"^    {name}\b", out, re.M), name
        assert _words(bench.help) in _words(out), name
    assert f"with none named: {' '.join(DEFAULT)}" in _words(out)


def test_each_benchmark_help_lists_only_the_options_its_code_reads(capsys):
    """The flat list gave every benchmark all ~20 options (`--clients` beside `--budgets`)."""
    for name, bench in BENCHES.items():
        with pytest.raises(SystemExit) as e:
            main(["bench", name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith(f"usage: tierstore bench {name} "), name
        assert _words(bench.help) in _words(out), name  # its one-line description
        flags = set(re.findall(r"^  (--[a-z-]+)", out, re.M)) - {"--help"}
        # every option listed is one the benchmark's code reads
        module = importlib.import_module(f"tierstore.tools.{bench.module}")
        code = inspect.getsource(module if bench.run == "run" else getattr(module, bench.run))
        unread = sorted(f for f in flags if f"args.{f[2:].replace('-', '_')}" not in code)
        assert flags and not unread, (name, flags, unread)
    assert not {"--clients", "--budgets", "--tier", "--rounds"} & set(re.findall(r"--[a-z-]+", _help("read")))


def test_each_benchmark_has_its_own_defaults():
    defaults = {name: vars(benchmark_parser(name).parse_args([])) for name in ("read", "serve", "scale", "churn")}
    assert [defaults[n]["rows"] for n in ("read", "serve", "scale")] == [1_000_000, 200_000, 34_000_000]
    assert (defaults["read"]["batch"], defaults["churn"]["batch"]) == (65_536, 16_384)
    assert "(default: 34000000)" in _words(_help("scale")) and "(default: 200000)" in _words(_help("serve"))


def test_benchmarks_named_together_each_run_with_the_options_given(tmp_path, capsys):
    assert main(["bench", "read", "cold", "--rows", "4096", "--batch", "512", "--repeat", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== read: " in out and "== cold read: " in out
    assert out.count("rows=4096, dim=128, batch=512") == 2


def test_an_option_one_of_the_benchmarks_named_does_not_take_is_refused_before_any_runs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "read", "memory", "--rows", "5"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""  # read did not run either
    assert "tierstore bench memory: error: unrecognized arguments: --rows 5; benchmarks named together must each take " \
           "every option given: run memory in its own command" in captured.err
    with pytest.raises(SystemExit):
        main(["bench", "read", "--clients", "2"])
    assert "tierstore bench read: error: unrecognized arguments: --clients 2\n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "read", "nope"])
    assert "tierstore bench read: error: no benchmark 'nope'; choose from read, cold," in capsys.readouterr().err
