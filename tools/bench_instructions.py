"""``tierstore bench instructions``: machine instructions per training step, counted
by valgrind's callgrind, for the embedding-only step of ``bench prefetch`` (page
cache warm) at prefetch depth 0 and 2, reading ahead however fast LMDB is
(sync_read_us=0).

On a small shared VM a step's seconds move by 10-20% from run to run, so a change
worth a few percent cannot be told from the noise by timing it; callgrind's count
is the same whatever else the machine does. Each setting runs twice, for 2 steps
and for ``STEPS``; the difference, per step, is the steps' own work (start-up,
imports and the store's opening cancel out; both runs make the same batches). It
counts work, not time: stalls, page faults, system calls and waits for the GIL
are not in it (BENCHMARKS.md, "Cost per row moved").
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tierstore.engine.prefetch import LookaheadLoader
from tierstore.tools import bench_prefetch as bp
from tierstore.tools.bench import shared
from tierstore.errors import StateError

STEPS = 60
BAGS = 256
TOP = 12  # functions listed for the trainer's thread


def _workload(base: str, steps: int, depth: int, batches: int) -> int:
    """The embedding-only step over a copy of the store at ``base``, ``steps`` times at
    prefetch ``depth``, its write-back drained; returns the rows it moved."""
    data = bp._batches(BAGS, batches, 0)[:steps]  # the same batches made whatever the steps
    with tempfile.TemporaryDirectory(prefix="tierstore-instr-") as d:
        # always read ahead: under callgrind every read is slow, and what is counted is the prefetch path
        emb = bp._model(os.path.join(d, "c"), bp.ROWS // 20, 0, bp.WORKERS, copy_of=base, sync_read_us=0.0)
        step = bp._Step(emb, BAGS, None, 0)
        for ids, offsets in LookaheadLoader(data, emb, depth=depth):
            step(ids, offsets)
        emb.store.flush()
        moved = bp._rows_moved(emb.store.stats())
        emb.store.close()
    return moved


def _thread_totals(out: Path) -> list[int]:
    """Instructions of each thread of one callgrind run (--separate-threads=yes),
    the main thread first."""
    totals = []
    for f in sorted(out.parent.glob(out.name + "-*")):
        m = re.search(r"^(?:summary|totals): (\d+)", f.read_text(errors="replace"), re.M)
        totals.append(int(m.group(1)) if m else 0)
    return totals


def _by_function(out: Path) -> collections.Counter:
    """Instructions of each function of the main thread's run (callgrind_annotate)."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", f"{out}-01"], capture_output=True, text=True).stdout
    counts = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)", line)
        if m and m.group(2) != "PROGRAM TOTALS":
            counts[m.group(2)] += int(m.group(1).replace(",", ""))
    return counts


def _count(base: str, steps: int, depth: int, d: str) -> tuple[list[int], int, Path]:
    out = Path(d) / f"cg-{depth}-{steps}.out"
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
           sys.executable, "-m", "tierstore.tools.bench_instructions", base, str(steps), str(depth)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise StateError(f"callgrind run failed ({done.returncode}): {done.stderr[-2000:]}")
    return _thread_totals(out), int(done.stdout.split()[-1]), out


def _short(name: str) -> str:
    name = re.sub(r"\s*\[[^\]]*\]$", "", name)  # the object file
    return name if len(name) <= 110 else name[:107] + "..."


def add_arguments(p) -> None:
    shared(p, "dir")


def run(args) -> None:
    print("\n== instructions per step (callgrind): the embedding-only step of bench prefetch, page cache warm")
    if shutil.which("valgrind") is None:
        print("   skipped: valgrind is not installed (Debian/Ubuntu: apt install valgrind)")
        return
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=args.dir) as d:
        base = os.path.join(d, "rows")
        bp.write_rows(base)
        print(f"   rows={bp.ROWS}, dim={bp.DIM}, bags={BAGS} x pooling {bp.POOLING} (Zipf 1.05), ddr_rows={bp.ROWS // 20}; "
              f"{STEPS} steps less 2 steps, per step; 'others' are the prefetch and write-back threads")
        for depth in (0, 2):
            short, _, short_out = _count(base, 2, depth, d)
            long, moved, long_out = _count(base, STEPS, depth, d)
            per = STEPS - 2
            trainer = (long[0] - short[0]) / per
            others = (sum(long[1:]) - sum(short[1:])) / per
            print(f"   depth {depth}: trainer {trainer / 1e6:.1f}M, others {others / 1e6:.1f}M, all {(trainer + others) / 1e6:.1f}M "
                  f"instructions a step; {(trainer + others) * STEPS / max(moved, 1):,.0f} a row moved ({moved / STEPS:,.0f} rows a step)")
            if depth == 2 and shutil.which("callgrind_annotate"):
                a, b = _by_function(short_out), _by_function(long_out)
                print(f"   depth {depth}, the trainer's thread, top {TOP} functions (instructions a step):")
                for name in sorted(b, key=lambda k: a[k] - b[k])[:TOP]:
                    print(f"      {(b[name] - a[name]) / per / 1e3:8,.0f}k  {_short(name)}")


if __name__ == "__main__":  # the child that callgrind runs: base steps depth
    torch.set_num_threads(1)
    print(_workload(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), STEPS))
