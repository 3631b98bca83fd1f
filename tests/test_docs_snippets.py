"""Every ```python block of README.md and docs/*.md runs as written, and the docs site builds.

Each block runs alone, as a script in a fresh process whose working directory
is an empty temporary folder, so a block that uses a name it does not define
fails. Processes are forked from one that has imported torch and tierstore
already (a fork per block saves the ~3 s import each block would pay).

A block is skipped only by a marker on the line before its fence:
``<!-- snippet: skip REASON -->`` (it must not run here, e.g. a torchrun
launch) or ``<!-- snippet: needs MODULE -->`` (it runs where MODULE imports).
A ```bash block of ``tierstore`` commands runs too where the line before it is
``<!-- snippet: run -->`` (each command imports torch: keep such blocks few).
"""
from __future__ import annotations

import importlib.util
import os
import re
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*snippet:\s*(skip|needs|run)\b\s*(.*?)\s*-->")
SNIPPET_TIMEOUT_S = 300  # a hung block fails instead of stalling the suite

# Reads "script<TAB>cwd<TAB>log" lines; for each forks a child that runs the
# script as __main__ there (so multiprocessing's spawn can re-import it) and
# answers "pid", then "exit code".
FORK_SERVER = r"""
import os, runpy, sys, traceback
import numpy, torch, tierstore  # what every block imports: paid once
for line in sys.stdin:
    script, cwd, log = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(cwd)
        sys.argv = [script]
        code = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    marker: tuple[str, str] | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path, fence: str = "```python") -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == fence:
            start, end = i, i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"{path}:{start + 1}: a {fence} block is never closed")
            before = lines[start - 1] if start else ""
            marker = MARKER.search(before)
            blocks.append(Block(path, start + 1, "\n".join(lines[start + 1:end]) + "\n",
                                marker.groups() if marker else None))
            i = end
        i += 1
    return blocks


BLOCKS = [b for f in doc_files() for b in python_blocks(f)]
SHELL_BLOCKS = [b for f in doc_files() for b in python_blocks(f, "```bash") if b.marker and b.marker[0] == "run"]


class ForkServer:
    def __init__(self, cwd: Path):
        # not started in the repository: "-c" puts the working directory first on sys.path, and the
        # blocks must import tierstore as installed, as a user's script and its subprocesses do
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=cwd)

    def _answer(self, timeout: float | None = None) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the snippet fork server died; its stderr is in the test output")
        return line.strip()

    def run(self, script: Path, cwd: Path, log: Path) -> int:
        self.proc.stdin.write(f"{script}\t{cwd}\t{log}\n")
        self.proc.stdin.flush()
        pid = int(self._answer())
        code = self._answer(SNIPPET_TIMEOUT_S)
        if code is None:
            os.kill(pid, signal.SIGKILL)  # the block's own process; the server then reports it
            self._answer()
            raise AssertionError(f"{script.name} still running after {SNIPPET_TIMEOUT_S} s")
        return int(code)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("fork-server"))
    yield server
    server.close()


def test_blocks_are_found():
    # the collector itself: a README without runnable blocks would pass every test below
    names = {b.path.name for b in BLOCKS if b.marker is None}
    assert "README.md" in names and len(BLOCKS) >= 10, [b.name for b in BLOCKS]


def test_skipped_blocks_are_few():
    skipped = [b.name for b in BLOCKS if b.marker and b.marker[0] == "skip"]
    assert len(skipped) <= 3, f"blocks marked skip: {skipped}; make them run, or keep the skips to a few"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_runs(block: Block, fork_server: ForkServer, tmp_path: Path):
    if block.marker and block.marker[0] != "run":
        kind, what = block.marker
        if kind == "skip":
            pytest.skip(f"marked not to run: {what}")
        if importlib.util.find_spec(what) is None:
            pytest.skip(f"needs {what}, not installed")
    script, log = tmp_path / "snippet.py", tmp_path / "output.txt"
    script.write_text(block.code)
    work = tmp_path / "work"
    work.mkdir()
    code = fork_server.run(script, work, log)
    assert code == 0, f"{block.name} exited {code}:\n{log.read_text()[-4000:]}"
    if block.path.name == "README.md":  # the README's examples run again as written, and afresh
        first = log.read_text()
        code = fork_server.run(script, work, log)
        assert code == 0, f"{block.name} exited {code} when run again in its folder:\n{log.read_text()[-4000:]}"
        assert _losses(log.read_text()) == _losses(first), f"{block.name} went on training the first run's rows"


def _losses(text: str) -> list[str]:
    return [line for line in text.splitlines() if "loss" in line]


def test_ci_runs_the_readme_test_command():
    # a newcomer runs what CI runs: the quick start's second command (its lines up to one not
    # continued with a backslash) stands in .ci/run as it is
    quick_start = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    first = quick_start.index(next(x for x in quick_start if x.startswith("# 2."))) + 1
    last = next(i for i in range(first, len(quick_start)) if not quick_start[i].endswith("\\"))
    command = "\n".join(quick_start[first:last + 1])
    assert "pytest" in command and f"\n{command}\n" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.name)
def test_shell_block_runs(block: Block, tmp_path: Path):
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=SNIPPET_TIMEOUT_S)
    assert run.returncode == 0, f"{block.name} exited {run.returncode}:\n{(run.stdout + run.stderr)[-4000:]}"


def test_readme_links_exist():
    # mkdocs checks the links of docs/; the README is outside the site, so its relative links are checked here
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    relative = [link for link in links if "://" not in link]
    assert relative and [link for link in relative if not (ROOT / link).exists()] == []


def test_docs_build_strict(tmp_path: Path):
    """mkdocs.yml is strict: a broken link, a missing page or a bad API reference fails the build."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip('needs mkdocs (the docs extra: pip install -e ".[docs]")')
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, (run.stdout + run.stderr +
                                 "\n(a new page in docs/ goes into the nav of mkdocs.yml; links between pages are relative .md paths)")
