"""``tierstore bench index``: the row index of a table that declares far more rows than are
written. A writer process writes rows under a memory budget, a million at a time, each
flushed: by training (``--writes train``: steps of TieredEmbeddingBag with SGD over a
million fresh random ids each, the trained rows reaching LMDB through the write-back) or by
``store.write`` (``--writes put``); it is killed (kill -9), and the store is reopened
(recovery), read and trained, closed and reopened. The ratio: the last million's write time
over the first's once the DDR tier is full, each the mean of a tenth of the chunks (writing
grows with the rows written, not with their square: a spill writes what changed,
io.rowindex)."""
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
CHUNK = 1 << 20  # rows a write (or a step's ids) and its flush
BAG = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "batch", "dir", "seed", dim=16)
    p.add_argument("--declared-rows", type=positive_int, default=10**10, help="rows the table declares")
    p.add_argument("--written-rows", type=positive_int, default=10**7, help=f"random rows written, {CHUNK:,} at a time")
    p.add_argument("--writes", choices=("train", "put"), default="train",
                   help="how the rows are written: training steps (SGD) over fresh random ids, or store.write")
    p.add_argument("--budget", default="1GiB", help="the store's memory_budget")
    p.add_argument("--steps", type=positive_int, default=20, help="training steps after the reopen")


def _open(path: str, declared: int, dim: int, budget: str):
    import tierstore
    return tierstore.TieredStore(path, [tierstore.TableSpec(TABLE, declared, dim)], memory_budget=budget, device="cpu")


def _bag(store, declared: int, dim: int):
    import tierstore
    return tierstore.TieredEmbeddingBag(declared, dim, mode="sum", store=store, table=TABLE,
                                        optimizer=tierstore.optim.SGD(lr=0.01))


def _step(emb, ids) -> None:
    import torch
    emb(ids, torch.arange(0, len(ids), BAG)).sum().backward()


def _memory(store) -> dict:
    """Each part of the store's memory (store.memory()): [MiB used or None, MiB given]; and the
    row index's files."""
    parts = {name: [None if p.used_bytes is None else p.used_bytes / 2**20, p.bytes / 2**20]
             for name, p in store.memory().parts.items()}
    files = list(Path(store.path).glob("index-*"))
    return {"parts": parts, "files": len(files), "file_mib": sum(f.stat().st_blocks * 512 for f in files) / 2**20,
            "stored": store.stats()["rows"]["stored"]}


def _writer(path: str, declared: int, dim: int, budget: str, rows: int, seed: int, writes: str) -> None:
    """The child: writes ``rows`` random rows, CHUNK at a time, each flushed; a line of JSON
    a chunk, then waits to be killed."""
    import torch
    rng = np.random.default_rng(seed)
    store = _open(path, declared, dim, budget)
    emb = _bag(store, declared, dim) if writes == "train" else None
    for lo in range(0, rows, CHUNK):
        ids = rng.integers(0, declared, min(CHUNK, rows - lo))
        full = store.resident_rows(TABLE)["ddr"] >= store.memory().ddr_rows[TABLE]
        t0 = time.perf_counter()
        if emb is not None:
            _step(emb, torch.from_numpy(ids))
        else:
            ids = np.unique(ids)
            store.write(TABLE, ids, np.full((len(ids), dim), lo / CHUNK, dtype=np.float32))
        store.flush()
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "rows": len(ids), "full": bool(full), **_memory(store)}), flush=True)
    print(json.dumps({"done": True}), flush=True)
    sys.stdin.read()


def _parts(m: dict) -> str:
    return ", ".join(f"{name} {used:.1f}/{given:.1f}" if used is not None else f"{name} -/{given:.1f}"
                     for name, (used, given) in m["parts"].items() if given or used)


def run(args: argparse.Namespace) -> None:
    import torch

    declared, dim, budget = args.declared_rows, args.dim, args.budget
    with _workdir(args.dir) as d:
        _open(d, declared, dim, budget).close()
        child = subprocess.Popen([sys.executable, "-m", "tierstore.tools.bench_index", d, str(declared), str(dim), budget,
                                  str(args.written_rows), str(args.seed), args.writes],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        chunks = []
        t_all = time.perf_counter()
        for line in child.stdout:
            got = json.loads(line)
            if got.get("done"):
                break
            chunks.append(got)
            if len(chunks) % 10 == 0:  # a long run says where it is
                print(f"   {len(chunks)} x {CHUNK:,} ids written, the last in {got['seconds']:.2f} s",
                      file=sys.stderr, flush=True)
        t_all = time.perf_counter() - t_all
        child.send_signal(signal.SIGKILL)
        child.wait()
        if not chunks:
            raise SystemExit("the writer wrote nothing")
        t0 = time.perf_counter()
        store = _open(d, declared, dim, budget)
        t_recover = time.perf_counter() - t0
        after_kill = _memory(store)
        if after_kill["stored"] != chunks[-1]["stored"]:
            raise SystemExit(f"{chunks[-1]['stored']:,} rows were flushed before kill -9, "
                             f"{after_kill['stored']:,} stored after it")
        gen = torch.Generator().manual_seed(args.seed)
        t0 = time.perf_counter()
        store.read(TABLE, torch.randint(0, declared, (args.batch,), generator=gen))
        t_read = time.perf_counter() - t0
        emb = _bag(store, declared, dim)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            _step(emb, torch.randint(0, declared, (args.batch,), generator=gen))
        t_steps = time.perf_counter() - t0
        trained = _memory(store)
        t0 = time.perf_counter()
        store.close()
        t_close = time.perf_counter() - t0
        t0 = time.perf_counter()
        store = _open(d, declared, dim, budget)
        t_reopen = time.perf_counter() - t0
        reopened = _memory(store)
        store.close()
    warm = [c for c in chunks if c["full"]] or chunks
    tenth = max(1, len(warm) // 10)  # a mean over several: a chunk alone varies with the machine's other work

    def per_million(some):
        return sum(c["seconds"] for c in some) / sum(c["rows"] for c in some) * 1e6
    first, last = per_million(warm[:tenth]), per_million(warm[-tenth:])
    total = sum(c["seconds"] for c in chunks)
    end = chunks[-1]

    def index(m):
        used, given = m["parts"]["row_index"]
        return f"{used:.1f} of {given:.0f} MiB in memory, {m['files']} files, {m['file_mib']:.0f} MiB"
    how = "trained (SGD) and flushed" if args.writes == "train" else "written + flushed"
    report(f"index: a table of many declared rows, random rows {how} under a budget",
           {"declared": f"{declared:.0e}", "dim": dim, "budget": budget, "written": f"{args.written_rows:,} random ids",
            "writes": args.writes},
           [(f"a million rows {how}", f"first {first:.2f} s, last {last:.2f} s (the mean of the first and last {tenth} of "
                                      f"{len(warm)} chunks once the DDR tier is full), all {total:.1f} s ({t_all:.1f} s wall)"),
            ("rows stored", f"{end['stored']:,}"),
            ("row index after the writes", index(end)),
            ("memory by part after the writes, MiB used/given", _parts(end)),
            ("open after kill -9 (recovery)", f"{t_recover:.2f} s; {index(after_kill)}; rows stored as flushed"),
            (f"read {args.batch:,} random ids", f"{t_read:.2f} s"),
            (f"{args.steps} steps of {args.batch:,} random ids", f"{t_steps:.1f} s; {index(trained)}"),
            ("memory by part after the steps, MiB used/given", _parts(trained)),
            ("close, reopen", f"{t_close:.2f} s, {t_reopen:.2f} s; {index(reopened)}")],
           "last million's write / first's", last / first, "~1: writing grows with the rows written")


if __name__ == "__main__":
    a = sys.argv[1:]
    _writer(a[0], int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), a[6])
