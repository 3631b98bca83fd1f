"""kill -9 of a writer of tables whose rows come and go (admission, TTL, the L2
score): what flush() reported durable survives, and nothing reads a value its row
never had since the last flush.

The writer is a real process (tests/lived_child.py) killed with SIGKILL; the
oracle is a plain model of the README's rules ("Unbounded id spaces") on dicts,
checked against every read the live store answers, and the recovered store is
read straight from LMDB (tierstore.io.LmdbBackend), with no tierstore step between.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from tierstore import TieredStore
from tierstore.io import LmdbBackend
from tierstore.spec import initial_rows

sys.path.insert(0, str(Path(__file__).parent))
import lived_child  # noqa: E402
from lived_child import D, TABLES  # noqa: E402

SPECS = {t.name: t for t in TABLES}
HOT = 4  # ids 0..HOT-1 come back often; every step also uses a new id, so tiers churn


class Writer:
    """The writer process: commands in, one answer out per command done."""
    _context = None

    def __init__(self, path: str, hbm_rows: int, ddr_rows: int):
        if Writer._context is None:  # one forkserver that has imported the store (and torch): a writer starts in ms
            Writer._context = multiprocessing.get_context("forkserver")
            # by installed names: Python 3.11's forkserver imports its preloads before it takes the parent's
            # sys.path, so "lived_child" (in tests/) failed, silently, and each writer imported torch (2.5 s)
            Writer._context.set_forkserver_preload(["tierstore.store", "tierstore.spec"])
        self.conn, theirs = Writer._context.Pipe()
        self.proc = Writer._context.Process(target=lived_child.serve, args=(theirs, path, hbm_rows, ddr_rows), daemon=True)
        self.proc.start()
        theirs.close()
        assert self.conn.recv() == "open"

    def send(self, cmd: dict) -> None:
        self.conn.send(cmd)

    def call(self, cmd: dict):
        self.send(cmd)
        return self.conn.recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=30)
        assert self.proc.exitcode == -signal.SIGKILL
        self.conn.close()

    def close(self) -> None:
        if self.proc.is_alive():
            assert self.call(None) == "closed"
            self.proc.join(timeout=60)


class Table:
    """One table under the rules: stored values and last-use steps, and its step count."""

    def __init__(self, spec, values=None, last=None, steps=0):
        self.spec = spec
        self.values: dict[int, np.ndarray] = dict(values or {})
        self.last: dict[int, int] = dict(last or {})
        self.steps = steps

    def copy(self) -> "Table":
        return Table(self.spec, self.values, self.last, self.steps)

    def view(self, ids: np.ndarray, steps: int | None = None) -> np.ndarray:
        """The rows as a step after ``steps`` steps (default: so far) reads them."""
        steps = self.steps if steps is None else steps
        rows = initial_rows(self.spec, ids)
        for i, x in enumerate(ids.tolist()):
            if x not in self.values:
                continue
            ttl = self.spec.ttl_steps
            if ttl is not None and self.last.get(x, -1) + ttl <= steps:
                continue
            v = self.values[x]
            if self.spec.evict_l2_below is not None and (v.astype(np.float32) ** 2).sum(dtype=np.float32) < np.float32(self.spec.evict_l2_below) ** 2:
                continue
            rows[i] = v
        return rows

    def step(self, ids: np.ndarray, mul: float, add: float) -> None:
        """store.read (one step), then the rows written back changed."""
        uid = np.unique(ids)
        rows = self.view(uid)
        self.steps += 1
        for x, row in zip(uid.tolist(), rows):
            self.values[x] = row * np.float32(mul) + np.float32(add)
            self.last[x] = self.steps


def recovered(path: str) -> dict[str, Table]:
    """The store at ``path`` as LMDB holds it: stored rows, last-use steps and step counts."""
    backend = LmdbBackend(path, readonly=True, create=False)
    try:
        steps = backend.read_meta().get("steps", {})
        tables = {}
        for name, spec in SPECS.items():
            backend.open_table(name, spec.dim, spec.state_dim, spec.dtype, last_use=spec.ttl_steps is not None,
                               num_rows=spec.num_rows)
            ids = backend.stored_ids(name)
            rows, found = backend.get_rows(name, ids)
            last = backend.get_last_use(name, ids) if spec.ttl_steps is not None else np.zeros(len(ids), dtype=np.int64)
            assert found.all()
            tables[name] = Table(spec, {x: rows[i, :D].copy() for i, x in enumerate(ids.tolist())},
                                 {x: int(last[i]) for i, x in enumerate(ids.tolist())}, int(steps.get(name, 0)))
        return tables
    finally:
        backend.close()


def steps_of(hot: list[int], n: int, mul: float, add: float) -> list[dict]:
    return [{"op": "step", "ids": hot, "mul": mul, "add": add}] * n


# runs of steps (of every table) reusing a few ids: rows stay cached and in use across flushes
step_runs = st.builds(steps_of, st.lists(st.integers(0, HOT - 1), min_size=1, max_size=2),
                      st.integers(1, 8), st.sampled_from([1.0, 0.5, 0.0]), st.sampled_from([0.0, 0.25, 5.0]))


class LivedCrashMachine(RuleBasedStateMachine):
    """Steps, flushes and kill -9 at random points, against the plain model."""

    @initialize(hbm=st.integers(0, 3), ddr=st.integers(0, 4))
    def start(self, hbm, ddr):
        self.tmp = tempfile.TemporaryDirectory()
        self.tiers = (hbm, ddr)
        self.fresh = HOT  # the last id a step has used
        self.model = {name: Table(spec) for name, spec in SPECS.items()}
        self.since_flush = [self._snapshot()]  # states a recovered row may show: the last flush's on
        self.flushed_steps = [self._steps()]  # step counts a recovered store may hold
        self.writer = Writer(self.tmp.name, hbm, ddr)

    def _snapshot(self) -> dict[str, Table]:
        return {name: t.copy() for name, t in self.model.items()}

    def _steps(self) -> dict[str, int]:
        return {name: t.steps for name, t in self.model.items()}

    def _with_fresh_id(self, cmd: dict) -> dict:
        """Each step also uses an id never used before: rows leave the tiers and are written back."""
        if cmd["op"] != "step":
            return cmd
        self.fresh += 1
        return {**cmd, "ids": cmd["ids"] + [self.fresh]}

    def _apply(self, cmd: dict) -> dict[str, np.ndarray] | None:
        """The command on the model; a step returns the rows each table's read sees."""
        if cmd["op"] == "flush":
            self.flushed_steps.append(self._steps())
            return None
        ids = np.asarray(cmd["ids"], dtype=np.int64)
        seen = {}
        for name, table in self.model.items():
            seen[name] = table.view(ids)
            table.step(ids, cmd["mul"], cmd["add"])
        self.since_flush.append(self._snapshot())
        return seen

    @rule(cmds=step_runs)
    def steps(self, cmds):
        for cmd in map(self._with_fresh_id, cmds):
            got = self.writer.call(cmd)
            want = self._apply(cmd)
            for name in SPECS:
                assert np.array_equal(got[name], want[name]), (name, cmd, got[name], want[name])

    @rule()
    def flush(self):
        assert self.writer.call({"op": "flush"}) == "flushed"
        self.since_flush = [self._snapshot()]
        self.flushed_steps = [self._steps()]

    @rule(runs=st.lists(st.one_of(step_runs, st.just([{"op": "flush"}])), min_size=1, max_size=3),
          delay_ms=st.integers(0, 60))
    def kill_9(self, runs, delay_ms):
        """Send commands without waiting, kill the writer at some point of them, check what LMDB
        holds, and go on from it with a new writer."""
        for cmd in (self._with_fresh_id(c) for run in runs for c in run):
            self.writer.send(cmd)
            self._apply(cmd)
        time.sleep(delay_ms / 1000)
        self.writer.kill()
        got = recovered(self.tmp.name)
        steps = {name: t.steps for name, t in got.items()}
        assert steps in self.flushed_steps, f"step counts {steps} are none of the flushes' {self.flushed_steps}"
        ids = np.arange(self.fresh + 1, dtype=np.int64)
        for name, table in got.items():
            seen = table.view(ids)
            allowed = [state[name].view(ids) for state in self.since_flush]
            for i, x in enumerate(ids.tolist()):
                assert any(np.array_equal(seen[i], a[i]) for a in allowed), (
                    f"table {name!r} row {x} reads {seen[i]} after kill -9, a value it never had since the last flush: "
                    f"{[a[i].tolist() for a in allowed]}")
        self.model = got
        self.since_flush = [self._snapshot()]
        self.flushed_steps = [self._steps()]
        self.writer = Writer(self.tmp.name, *self.tiers)

    def teardown(self):
        if hasattr(self, "writer"):
            self.writer.close()
            with TieredStore(self.tmp.name, readonly=True, device="cpu") as s:  # a clean close keeps every step
                for name, table in self.model.items():
                    ids = np.arange(self.fresh + 1, dtype=np.int64)
                    assert torch.equal(s.read(name, ids), torch.from_numpy(table.view(ids))), name
            self.tmp.cleanup()


TestLivedCrash = LivedCrashMachine.TestCase
TestLivedCrash.settings = settings(max_examples=20, stateful_step_count=12, deadline=None)


def test_a_cached_row_in_use_survives_the_sweep_and_kill_9(tmp_path):
    """A row written and flushed, then used every step from the HBM tier, is never
    written back again; the sweep must not judge it by its stale last-use step on disk."""
    writer = Writer(str(tmp_path), 2, 0)
    try:
        writer.call({"op": "step", "table": "ttl", "ids": [1], "mul": 0.0, "add": 5.0})  # row 1 = 5.0
        writer.call({"op": "flush"})
        for i in range(30):  # row 1 every step (ttl_steps=3), a new row each step leaves HBM and commits
            writer.call({"op": "step", "table": "ttl", "ids": [1, 100 + i], "mul": 1.0, "add": 0.0})
        time.sleep(0.2)  # the writer's last commits and sweeps
        with TieredStore(tmp_path, readonly=True, device="cpu") as reader:  # another process, while it trains
            assert 1 in reader.stored_ids("ttl").tolist()
            assert torch.equal(reader.read("ttl", [1]), torch.full((1, D), 5.0))
    finally:
        writer.kill()
    with TieredStore(tmp_path, device="cpu") as s:
        assert torch.equal(s.read("ttl", [1]), torch.full((1, D), 5.0))
