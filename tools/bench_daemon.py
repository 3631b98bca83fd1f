"""``tierstore bench daemon``: reads through ``tierstore prefetchd`` against an in-process
DDR tier, and two client processes reading at once against one."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from tierstore.tools.bench import median_seconds, report, shared

ROWS_AT_MOST = 1 << 20


def add_arguments(p) -> None:
    shared(p, "rows", "dim", "batch", "repeat", "dir", "seed",
           helps={"rows": f"table rows (at most {ROWS_AT_MOST:,})"})


def run(args) -> None:
    """Reads through the daemon vs an in-process DDR tier; two clients vs one.

    Both comparisons run at torch's default thread count and at 1 thread (daemon,
    clients and baseline alike), because on a small shared machine the thread
    count decides more than the transport does. Client processes time their own
    reads (process start and exit are not counted); rounds alternate one and two
    clients and the median ratio is reported. "Independent readers" is the
    machine's own ceiling for the second ratio: processes gathering from their
    own tensors with no daemon and no lock at all.
    """
    import statistics
    import subprocess
    import sys
    import tempfile

    import tierstore
    from tierstore.tools.bench_store import read_all

    n, dim, batch = min(args.rows, ROWS_AT_MOST), args.dim, args.batch
    rounds = max(3, args.repeat // 3)
    default_threads = torch.get_num_threads()
    load_before = os.getloadavg()
    local, through, pairs, ceiling = {}, {}, {}, []
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-", dir=args.dir) as d:
        path = Path(d) / "store"
        spec = tierstore.TableSpec("t", n, dim, init=tierstore.RowInit.uniform(-1, 1, seed=args.seed))
        gen = torch.Generator().manual_seed(args.seed)
        batches = [torch.randint(0, n, (batch,), generator=gen) for _ in range(8)]
        buf = torch.empty((batch, dim))
        tierstore.TieredStore(path, [spec], device="cpu", registry=CollectorRegistry()).close()
        # baseline: the same DDR tier in this process, opened as the daemon opens it (an existing store)
        with tierstore.TieredStore(path, hbm_rows=0, ddr_rows=n, device="cpu", registry=CollectorRegistry()) as store:
            read_all(store, n)
            for threads in (default_threads, 1):
                torch.set_num_threads(threads)
                it = iter(range(10**9))
                local[threads] = median_seconds(lambda: store.read("t", batches[next(it) % 8], out=buf), args.repeat)
            expect = store.read("t", batches[0])
        for threads in (default_threads, 1):
            torch.set_num_threads(threads)
            sock = Path(tempfile.mkdtemp(prefix="tsd-")) / "d.sock"
            proc = subprocess.Popen([sys.executable, "-m", "tierstore.tools.cli", "prefetchd", str(path), "--socket", str(sock),
                                     "--ddr-rows", str(n), "--threads", str(threads)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            try:
                assert proc.stdout.readline().startswith("ready"), "the daemon did not start"
                client = tierstore.open_store(path, daemon=str(sock), readonly=True, device="cpu")
                read_all(client, n)
                it = iter(range(10**9))
                through[threads] = median_seconds(lambda: client.read("t", batches[next(it) % 8], out=buf), args.repeat)
                assert torch.equal(client.read("t", batches[0]), expect), "the daemon's rows differ from the in-process store's"
                client.close()
                pairs[threads] = [(_rate(_READER, [path, sock], n, batch, args, threads, 1),
                                   _rate(_READER, [path, sock], n, batch, args, threads, 2)) for _ in range(rounds)]
            finally:
                proc.terminate()
                proc.wait(30)
                sock.parent.rmdir()
        ceiling = [(_rate(_GATHER, [dim], n, batch, args, 1, 1), _rate(_GATHER, [dim], n, batch, args, 1, 2)) for _ in range(rounds)]
    torch.set_num_threads(default_threads)
    load = f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    params = {"rows": n, "dim": dim, "batch": batch, "repeat": args.repeat, "transport": "unix socket + shared memory",
              "cpus": os.cpu_count(), "load average": load}

    def ms(t: float) -> str:
        return f"{t * 1e3:8.2f} ms  {batch / t / 1e6:6.2f} M rows/s"

    rows = []
    for threads in (default_threads, 1):
        rows += [(f"in-process read(out=), {threads} thread(s)", ms(local[threads])),
                 (f"through the daemon, {threads} thread(s)", f"{ms(through[threads])}  ({local[threads] / through[threads]:.2f}x)")]
    best = min(local.values())
    rows.append(("daemon at its best / in-process at its best", f"{best / min(through.values()):.2f}x"))
    report(f"daemon: {batch}-id read(out=), every row in the daemon's DDR tier", params, rows,
           f"daemon / in-process throughput, {default_threads} threads on both sides",
           local[default_threads] / through[default_threads], ">= 0.50")

    def ratios(p):
        return [two / one for one, two in p]

    rows = []
    for threads in (default_threads, 1):
        rs = ratios(pairs[threads])
        rows.append((f"daemon, {threads} thread(s) each: one client", f"{statistics.median(o for o, _ in pairs[threads]) / 1e6:6.2f} M rows/s"))
        rows.append((f"daemon, {threads} thread(s) each: two clients", f"{statistics.median(t for _, t in pairs[threads]) / 1e6:6.2f} M rows/s  "
                     f"(two/one per round: {', '.join(f'{r:.2f}' for r in rs)})"))
    rows.append(("independent readers, no daemon (ceiling)", f"two/one per round: {', '.join(f'{r:.2f}' for r in ratios(ceiling))}"))
    best = max(default_threads, 1, key=lambda th: statistics.median(ratios(pairs[th])))
    report("daemon: client processes reading at once", {**params, "rounds": rounds}, rows,
           f"two / one aggregate throughput, median of rounds ({best} thread(s); "
           f"ceiling {statistics.median(ratios(ceiling)):.2f}x)", statistics.median(ratios(pairs[best])), ">= 1.50")


# a client process: reads `reps` batches with read(out=) and prints its own start, end
_READER = """
import sys, time, torch, tierstore
path, sock, n, batch, reps, seed, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
torch.set_num_threads(threads)
c = tierstore.open_store(path, daemon=sock, readonly=True, device="cpu")
g = torch.Generator().manual_seed(seed)
bs = [torch.randint(0, n, (batch,), generator=g) for _ in range(4)]
out = torch.empty((batch, c.tables["t"].dim))
c.read("t", bs[0], out=out)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
for i in range(reps):
    c.read("t", bs[i % 4], out=out)
print(t0, time.perf_counter(), flush=True)
c.close()
"""

# the ceiling: the same gather from a tensor of the process's own, no daemon
_GATHER = """
import sys, time, torch
dim, n, batch, reps, seed, threads = map(int, sys.argv[1:])
torch.set_num_threads(threads)
data = torch.rand(n, dim)
g = torch.Generator().manual_seed(seed)
bs = [torch.randint(0, n, (batch,), generator=g) for _ in range(4)]
out = torch.empty((batch, dim))
torch.index_select(data, 0, bs[0], out=out)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
for i in range(reps):
    torch.index_select(data, 0, bs[i % 4], out=out)
print(t0, time.perf_counter(), flush=True)
"""


def _rate(script: str, head: list, n: int, batch: int, args, threads: int, clients: int) -> float:
    """Aggregate rows/s of ``clients`` processes running ``script`` at once, from
    their own clocks (perf_counter is CLOCK_MONOTONIC: one clock for all processes)."""
    import subprocess
    import sys

    reps = max(8, args.repeat)
    procs = [subprocess.Popen([sys.executable, "-c", script, *map(str, head), str(n), str(batch), str(reps), str(args.seed + i), str(threads)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(clients)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", "a bench client did not start"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        spans = [tuple(map(float, p.stdout.readline().split())) for p in procs]
    finally:
        for p in procs:
            p.wait(60)
    return clients * reps * batch / (max(e for _, e in spans) - min(s for s, _ in spans))
