"""``tierstore bench index``: the row index of a table that declares far more rows than are
written. A writer process writes random rows under a memory budget, a million at a time (each
flushed), and is killed (kill -9); the store is reopened (recovery), read and trained, closed
and reopened. The ratio: the last million's write time over the first's (writing grows with
the rows written, not with their square: a spill writes what changed, io.rowindex)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tierstore.tools.bench import report, shared
from tierstore.tools.bench_store import _workdir
from tierstore.tools.cli import positive_int

TABLE = "t"
CHUNK = 1_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "batch", "dir", "seed", dim=16)
    p.add_argument("--declared-rows", type=positive_int, default=10**10, help="rows the table declares")
    p.add_argument("--written-rows", type=positive_int, default=10**7, help="random rows written, a million at a time")
    p.add_argument("--budget", default="1GiB", help="the store's memory_budget")
    p.add_argument("--steps", type=positive_int, default=20, help="training steps after the reopen")


def _open(path: str, declared: int, dim: int, budget: str):
    import tierstore
    return tierstore.TieredStore(path, [tierstore.TableSpec(TABLE, declared, dim)], memory_budget=budget, device="cpu")


def _index(store) -> dict:
    part = store.memory().parts["row_index"]
    files = list(Path(store.path).glob("index-*"))
    return {"share_mib": part.bytes / 2**20, "used_mib": part.used_bytes / 2**20, "files": len(files),
            "file_mib": sum(f.stat().st_blocks * 512 for f in files) / 2**20}


def _writer(path: str, declared: int, dim: int, budget: str, rows: int, seed: int) -> None:
    """The child: writes ``rows`` random rows, a million at a time, each flushed; a line of JSON
    a million, then waits to be killed."""
    rng = np.random.default_rng(seed)
    store = _open(path, declared, dim, budget)
    for lo in range(0, rows, CHUNK):
        ids = np.unique(rng.integers(0, declared, min(CHUNK, rows - lo)))
        t0 = time.perf_counter()
        store.write(TABLE, ids, np.full((len(ids), dim), lo / CHUNK, dtype=np.float32))
        store.flush()
        print(json.dumps({"seconds": time.perf_counter() - t0, **_index(store)}), flush=True)
    print(json.dumps({"done": True}), flush=True)
    sys.stdin.read()


def run(args: argparse.Namespace) -> None:
    import torch

    import tierstore

    declared, dim, budget = args.declared_rows, args.dim, args.budget
    with _workdir(args.dir) as d:
        _open(d, declared, dim, budget).close()
        child = subprocess.Popen([sys.executable, "-m", "tierstore.tools.bench_index", d, str(declared), str(dim), budget,
                                  str(args.written_rows), str(args.seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        millions = []
        for line in child.stdout:
            got = json.loads(line)
            if got.get("done"):
                break
            millions.append(got)
            if len(millions) % 10 == 0:  # a long run says where it is
                print(f"   {len(millions)}M rows written, the last million in {got['seconds']:.2f} s", file=sys.stderr, flush=True)
        child.send_signal(signal.SIGKILL)
        child.wait()
        if not millions:
            raise SystemExit("the writer wrote nothing")
        t0 = time.perf_counter()
        store = _open(d, declared, dim, budget)
        t_recover = time.perf_counter() - t0
        after_kill = _index(store)
        gen = torch.Generator().manual_seed(args.seed)
        t0 = time.perf_counter()
        store.read(TABLE, torch.randint(0, declared, (args.batch,), generator=gen))
        t_read = time.perf_counter() - t0
        emb = tierstore.TieredEmbeddingBag(declared, dim, mode="sum", store=store, table=TABLE, optimizer=tierstore.optim.SGD(lr=0.01))
        offsets = torch.arange(args.batch // 32) * 32
        t0 = time.perf_counter()
        for _ in range(args.steps):
            emb(torch.randint(0, declared, (args.batch,), generator=gen), offsets).sum().backward()
        t_steps = time.perf_counter() - t0
        trained = _index(store)
        t0 = time.perf_counter()
        store.close()
        t_close = time.perf_counter() - t0
        t0 = time.perf_counter()
        store = _open(d, declared, dim, budget)
        t_reopen = time.perf_counter() - t0
        store.close()
    first, last = millions[0]["seconds"], millions[-1]["seconds"]
    total = sum(m["seconds"] for m in millions)
    end = millions[-1]

    def index(i):
        return f"{i['used_mib']:.1f} of {i['share_mib']:.0f} MiB in memory, {i['files']} files, {i['file_mib']:.0f} MiB"
    report("index: a table of many declared rows, random rows written under a budget",
           {"declared": f"{declared:.0e}", "dim": dim, "budget": budget, "written": f"{args.written_rows:,} random rows"},
           [("write + flush, a million rows", f"first {first:.2f} s, last {last:.2f} s, all {total:.1f} s"),
            ("row index after the writes", index(end)),
            ("open after kill -9 (recovery)", f"{t_recover:.2f} s; {index(after_kill)}"),
            (f"read {args.batch:,} random ids", f"{t_read:.2f} s"),
            (f"{args.steps} steps of {args.batch:,} random ids", f"{t_steps:.1f} s; {index(trained)}"),
            ("close, reopen", f"{t_close:.2f} s, {t_reopen:.2f} s")],
           "last million's write / first's", last / first, "~1: writing grows with the rows written")


if __name__ == "__main__":
    a = sys.argv[1:]
    _writer(a[0], int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]))
