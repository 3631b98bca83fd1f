"""``tierstore bench gpu``: everything the HBM tier promises on a GPU, measured in one
command sized to a few minutes of a GPU machine.

In turn: the machine (GPU, driver, CUDA, torch); the resident training step (every
row the batches touch in the HBM tier) with tierstore's fused SGD and Adagrad
against ``nn.EmbeddingBag(sparse=True)`` with torch's optimizers on the same
batches; ``TieredStore.read`` against ``index_select``; the ops one resident step
dispatches (and, on CUDA, the host syncs ``torch.cuda.set_sync_debug_mode`` sees);
the HBM tier as a small cache of a large table, with ``LookaheadLoader`` ahead of
the step, against the same table all resident, and whether the three runs trained
the same bits; the demo DLRM under ``torch.compile(fullgraph=True)`` and
``torch.export`` (bench_gpu_compile.py); last, the tests marked ``gpu`` (``pytest -m gpu``). A part that
fails is reported and the next one runs; ``--json`` is rewritten after each part,
so a run cut short keeps what it measured. It uses the public API only, so that it
measures whatever implements the step underneath.

``--device cpu --quick`` runs the same code at a small size on any machine: what CI
checks."""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from tierstore.tools.bench import interleaved_medians, shared
from tierstore.tools.cli import positive_int

POOLING = 32
N_BATCHES = 8  # the resident step cycles through these: their union is its working set
ALPHA = 1.05
CACHE_SHARE, DDR_SHARE, DEPTH = 0.05, 0.10, 2
CHECK_ROWS = 262_144  # rows compared across the cache runs, at most
# size settings: the full run (the figures the goals name) and --quick (seconds on a CPU)
SIZES = {
    "full": dict(rows=1_000_000, dim=128, batch=65_536, repeat=30, cache_rows=10_000_000, steps=40, warmup=8,
                 dlrm_rows=200_000, dlrm_steps=12),
    "quick": dict(rows=20_000, dim=16, batch=2_048, repeat=10, cache_rows=100_000, steps=6, warmup=2,
                  dlrm_rows=10_000, dlrm_steps=4),
}
PARTS = ("resident", "read", "cache", "compile", "tests")
# the goals of the ratios, by their key in the JSON's "goals": (kind of ratio, comparison, goal)
GOALS = {
    "resident_sgd": ("time ratio", "<=", 1.3),
    "resident_adagrad": ("time ratio", "<=", 1.0),
    "read": ("throughput ratio", ">=", 0.7),
    "cache": ("time ratio", "<=", 1.5),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    full, quick = SIZES["full"], SIZES["quick"]

    def sized(what: str, name: str) -> str:
        return f"{what} (default {full[name]}; with --quick {quick[name]})"

    shared(p, "dir", "seed", rows=None, dim=None, batch=None, repeat=None, device="cuda",
           helps={"rows": sized("rows of the resident step's and the read's tables", "rows"),
                  "dim": sized("embedding dim of every table", "dim"),
                  "batch": sized(f"ids a step (in bags of {POOLING}) and a read", "batch"),
                  "repeat": sized("timed resident steps and reads a side (the median is reported)", "repeat"),
                  "device": "the HBM tier's device: cuda (the current GPU) or cpu"})
    p.add_argument("--cache-rows", type=positive_int, default=None,
                   help=sized(f"rows of the table the HBM tier caches {round(CACHE_SHARE * 100)}%% of", "cache_rows"))
    p.add_argument("--steps", type=positive_int, default=None, help=sized("timed steps of each cache run", "steps"))
    p.add_argument("--backend", default="inductor",
                   help="torch.compile's backend in the compile part (on CUDA inductor captures the step in CUDA "
                        "graphs: mode reduce-overhead); aot_eager checks the capture alone, in seconds")
    p.add_argument("--quick", action="store_true", help="small sizes: the whole run in seconds, on a CPU too")
    p.add_argument("--only", default=",".join(PARTS),
                   help=f"the parts to run, comma-separated, of: {', '.join(PARTS)} (the machine is always reported)")
    p.add_argument("--tests", default=None,
                   help="the tests that `pytest -m gpu` runs (default: the tests/ folder of this checkout, or of the "
                        "current directory); none skips them")
    p.add_argument("--budget", type=positive_int, default=480,
                   help="seconds the whole command may take: the tests get what the figures left, at least 60")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure to PATH as JSON")


def run(args: argparse.Namespace) -> None:
    start = time.monotonic()
    # a part that hangs prints where every thread is (on stderr) a minute past the budget, before whatever
    # limit the machine's lease puts on the command ends it with nothing said
    try:
        faulthandler.dump_traceback_later(args.budget + 60, file=sys.__stderr__)
    except (AttributeError, ValueError):  # no stderr with a file descriptor (an embedding host): no dump
        pass
    try:
        _run(args, start)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run(args: argparse.Namespace, start: float) -> None:
    from tierstore.errors import SettingError

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingError("--device cuda: torch sees no GPU here; run with --device cpu (and --quick for a small run)")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SettingError(f"--only: no part {', '.join(map(repr, unknown))}; choose from {', '.join(PARTS)}")
    if "compile" in parts:  # refused now, not after the parts before it ran
        from torch._dynamo import list_backends

        if args.backend not in list_backends(exclude_tags=()):  # debug ones too: aot_eager is one
            raise SettingError(f"--backend {args.backend!r}: torch.compile has no such backend; use inductor (the default), "
                               f"aot_eager (the capture alone) or another of torch._dynamo.list_backends()")
    size = SIZES["quick" if args.quick else "full"]
    given = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "repeat": args.repeat,
             "cache_rows": args.cache_rows, "steps": args.steps}
    sz = {k: given[k] if given.get(k) is not None else v for k, v in size.items()}
    result = {"machine": _machine(device), "settings": {**sz, "pooling": POOLING, "zipf_alpha": ALPHA,
                                                          "device": str(device), "quick": args.quick, "parts": parts},
              "resident": None, "read": None, "cache": None, "compile": None, "ops": {}, "tests": None, "goals": {}, "errors": {}}
    _print_section("machine", [(k, v) for k, v in result["machine"].items()])
    _save(args.json, result)
    timer = Timer(device)
    for part, fn in (("resident", _resident), ("read", _read), ("cache", _cache)):
        if part in parts:
            _guarded(result, part, lambda: fn(args.dir, args.seed, sz, device, timer, result))
            _save(args.json, result)
    if "compile" in parts:
        _guarded(result, "compile", lambda: _compile(args.dir, args.seed, sz, device, timer, args.backend, result))
        _save(args.json, result)
    if "tests" in parts:
        _guarded(result, "tests", lambda: _tests(args.tests, start + args.budget, result))
    result["goals"] = _goals(result)
    result["seconds"] = round(time.monotonic() - start, 1)
    _save(args.json, result)
    _summary(result)


class Timer:
    """Seconds one call of a function takes: on CUDA between two events on the current
    stream, the queue emptied first (so the host's launch gaps count, as in training); on
    the CPU by the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn, *a) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn(*a)
            return time.perf_counter() - t0
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(*a)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    def interleaved(self, fns, repeat: int, warmup: int = 3) -> list[float]:
        """Median seconds of each function, called in turn each round with the round's number."""
        return interleaved_medians(fns, repeat, warmup, timed=self)


def _batches(rows: int, batch: int, n: int, seed: int) -> list[torch.Tensor]:
    from tierstore.tools.demo import ZipfIds

    gen = torch.Generator().manual_seed(seed)
    zipf = ZipfIds(rows, ALPHA, gen)
    bags = max(1, batch // POOLING)
    return [zipf.sample(bags * POOLING, gen) for _ in range(n)]


def _resident(directory, seed, sz, device, timer, result) -> None:
    """The resident step, fused SGD and Adagrad against torch's, on the same batches."""
    import tierstore

    rows, dim = sz["rows"], sz["dim"]
    batches = _batches(rows, sz["batch"], N_BATCHES, seed)
    bags = len(batches[0]) // POOLING
    working = torch.unique(torch.cat(batches))
    gen = torch.Generator().manual_seed(seed + 1)
    grads = [torch.randn(bags, dim, generator=gen).to(device) for _ in range(N_BATCHES)]
    batches = [b.to(device) for b in batches]
    offsets = (torch.arange(bags) * POOLING).to(device)
    out, lines = {"working_rows": len(working), "bags": bags}, []
    for name, ours, theirs in (("SGD", tierstore.optim.SGD, torch.optim.SGD),
                               ("Adagrad", tierstore.optim.Adagrad, torch.optim.Adagrad)):
        with tempfile.TemporaryDirectory(prefix="tierstore-bench-gpu-", dir=directory) as d:
            emb = tierstore.TieredEmbeddingBag(rows, dim, mode="sum", path=d, hbm_rows=rows, optimizer=ours(lr=0.01),
                                               init=tierstore.RowInit(), device=device)
            emb.hold_resident()  # the device step: every row in the HBM tier, no host sync
            base = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=device)
            torch.nn.init.zeros_(base.weight)  # tierstore's rows start at zero too
            base_opt = theirs(base.parameters(), lr=0.01)

            def step_torch(r):
                base_opt.zero_grad(set_to_none=True)
                base(batches[r % N_BATCHES], offsets).backward(grads[r % N_BATCHES])
                base_opt.step()

            def step_ours(r):
                emb(batches[r % N_BATCHES], offsets).backward(grads[r % N_BATCHES])

            misses = emb.store.stats()["hbm"]["misses"]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch's Adagrad, once
                t_torch, t_ours = timer.interleaved((step_torch, step_ours), sz["repeat"])
            misses = emb.store.stats()["hbm"]["misses"] - misses
            trained = working.to(device)
            diff = (emb.store.read(emb.table, trained) - base.weight.detach()[trained]).abs().max().item()
            key = f"resident_{name.lower()}"
            out[name] = {"tierstore_ms": t_ours * 1e3, "torch_ms": t_torch * 1e3, "ratio": t_ours / t_torch,
                         "hbm_misses_timed": misses, "max_abs_diff_from_torch": diff}
            lines.append((f"{name}: TieredEmbeddingBag + tierstore.optim.{name}",
                          f"{t_ours * 1e3:8.3f} ms  {t_ours / t_torch:.2f}x  {_goal_text(key)}"))
            lines.append((f"{name}: nn.EmbeddingBag(sparse=True) + torch.optim.{name}", f"{t_torch * 1e3:8.3f} ms"))
            lines.append((f"{name}: check", f"max |tierstore - torch| over trained rows {diff:.1e}; "
                                             f"HBM misses while timed {misses}"))
            if name == "SGD":
                lines.append(("ops of one resident step (SGD)", _counted(result, "resident", lambda: step_ours(0), device)))
            emb.close()
            del base, base_opt
    result["resident"] = out
    _print_section(f"resident training step: {rows} x {dim} rows, every one in the HBM tier, {bags} bags x {POOLING} "
                   f"Zipf {ALPHA} ids, {len(working)} working rows, medians of {sz['repeat']}; time ratio "
                   "tierstore / torch", lines)


def _counted(result: dict, name: str, step, device: torch.device) -> str:
    """Counts one call of ``step`` into ``result["ops"][name]``. If counting fails, the failure
    is recorded and the step runs uncounted: the runs compared afterwards trained alike."""
    try:
        result["ops"][name] = count_step(step, device)
        return _ops_text(result["ops"][name])
    except Exception as e:  # noqa: BLE001 - the step's figures do not depend on its count
        result["errors"][f"ops {name}"] = f"{type(e).__name__}: {e}"
        step()
        return f"not counted: {type(e).__name__}: {e}"


def count_step(step, device: torch.device) -> dict:
    """The ops one call of ``step`` dispatches (OpCounter's summary) and, on CUDA, the
    host syncs ``torch.cuda.set_sync_debug_mode("warn")`` reports during it."""
    from tierstore.tools.dispatch_count import OpCounter

    mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if mode is not None:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with OpCounter(inside=("tierstore",)) as counter:  # the ops inside the device step's custom ops too
                step()
        finally:
            if mode is not None:
                torch.cuda.set_sync_debug_mode(mode)
    summary = counter.summary()
    summary["sync_debug_warnings"] = (sum("synchroniz" in str(w.message) for w in seen) if mode is not None else None)
    return summary


def _read(directory, seed, sz, device, timer, result) -> None:
    """``TieredStore.read(out=)`` of every row resident against ``index_select(out=)``."""
    import tierstore
    from tierstore.tools.bench_store import read_all

    rows, dim, n = sz["rows"], sz["dim"], sz["batch"]
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-gpu-", dir=directory) as d:
        spec = tierstore.TableSpec("t", rows, dim, init=tierstore.RowInit.uniform(-1, 1, seed=seed))
        with tierstore.TieredStore(d, [spec], hbm_rows=rows, device=device) as store:
            read_all(store, rows)
            plain = store.read("t", torch.arange(rows)).to(device)
            gen = torch.Generator().manual_seed(seed)
            ids = [torch.randint(0, rows, (n,), generator=gen).to(device) for _ in range(N_BATCHES)]
            buf = torch.empty((n, dim), device=device)
            t_base, t_ours = timer.interleaved(
                (lambda r: torch.index_select(plain, 0, ids[r % N_BATCHES], out=buf),
                 lambda r: store.read("t", ids[r % N_BATCHES], out=buf)), sz["repeat"])
            same = torch.equal(store.read("t", ids[0]), plain[ids[0]])
    ratio = t_base / t_ours
    result["read"] = {"tierstore_ms": t_ours * 1e3, "index_select_ms": t_base * 1e3, "ratio": ratio,
                      "tierstore_rows_per_s": n / t_ours, "index_select_rows_per_s": n / t_base, "rows_equal": same}
    _print_section(f"read: {n} uniform ids of {rows} x {dim} rows, every one in the HBM tier; throughput ratio "
                   "tierstore / index_select", [
                       ("TieredStore.read(out=)", f"{t_ours * 1e3:8.3f} ms  {n / t_ours / 1e6:8.1f} M rows/s  "
                                                  f"{ratio:.2f}x  {_goal_text('read')}"),
                       ("torch.index_select(out=)", f"{t_base * 1e3:8.3f} ms  {n / t_base / 1e6:8.1f} M rows/s"),
                       ("check", f"rows equal: {same}")])


def _cache(directory, seed, sz, device, timer, result) -> None:
    """A large table, Adagrad, the same batches three times, each the device step: every row
    held (depth 0), the HBM tier a 5% cache resolved ahead with LookaheadLoader at depth 2,
    and at depth 0; then the
    trained rows (weights and state) compared across the three runs."""
    import tierstore

    rows, dim = sz["cache_rows"], sz["dim"]
    n = sz["warmup"] + sz["steps"] + 1  # the last step is not timed: its ops are counted
    batches = _batches(rows, sz["batch"], n, seed + 2)
    bags = len(batches[0]) // POOLING
    union = torch.unique(torch.cat(batches))
    gen = torch.Generator().manual_seed(seed + 3)
    pick = torch.randperm(len(union), generator=gen)[:CHECK_ROWS]
    check = torch.unique(torch.cat([union[pick], batches[-1]]))  # a sample of the rows, and the last step's
    grads = [torch.randn(bags, dim, generator=gen).to(device) for _ in range(N_BATCHES)]
    offsets = (torch.arange(bags) * POOLING).to(device)
    data = [(b.to(device), offsets) for b in batches]
    hbm, ddr = max(1, int(rows * CACHE_SHARE)), int(rows * DDR_SHARE)
    runs = (("every row in the HBM tier, depth 0", rows, 0, 0),
            (f"HBM tier {CACHE_SHARE:.0%}, DDR {DDR_SHARE:.0%}, depth {DEPTH}", hbm, ddr, DEPTH),
            (f"HBM tier {CACHE_SHARE:.0%}, DDR {DDR_SHARE:.0%}, depth 0", hbm, ddr, 0))
    out = {"rows": rows, "hbm_rows": hbm, "ddr_rows": ddr, "depth": DEPTH, "bags": bags, "steps": sz["steps"],
           "rows_touched": len(union), "runs": []}
    lines, first, identical, worst, ops_line = [], None, True, 0.0, None
    for label, hbm_rows, ddr_rows, depth in runs:
        with tempfile.TemporaryDirectory(prefix="tierstore-bench-gpu-", dir=directory) as d:
            emb = tierstore.TieredEmbeddingBag(rows, dim, mode="sum", path=d, hbm_rows=hbm_rows, ddr_rows=ddr_rows,
                                               optimizer=tierstore.optim.Adagrad(lr=0.01), device=device,
                                               init=tierstore.RowInit.normal(0, 0.01, seed=seed))
            # the device step: every row held, or each batch's rows resolved into the tier ahead of its step
            emb.hold_resident() if ddr_rows == 0 else emb.resolve_ahead()
            loader = tierstore.LookaheadLoader(data, emb, depth=depth) if depth else data
            times, before = [], emb.store.stats()["hbm"]
            timer.sync()
            t = time.perf_counter()
            for i, (ids, offs) in enumerate(loader):
                def step(i=i, ids=ids, offs=offs):
                    emb(ids, offs).backward(grads[i % N_BATCHES])
                if i == n - 1 and depth:
                    ops_line = (f"ops of one cached step at depth {DEPTH}", _counted(result, "cached", step, device))
                else:
                    step()
                timer.sync()
                now = time.perf_counter()
                if sz["warmup"] <= i < n - 1:
                    times.append(now - t)
                t = now
            after = emb.store.stats()["hbm"]
            up = emb.store._shared.upload  # how the misses went up: pinned staging on a side stream on CUDA
            rows_now = emb.store.read(emb.table, check.to(device), with_state=True).cpu()
            emb.close()
        p50 = statistics.median(times)
        run = {"label": label, "hbm_rows": hbm_rows, "ddr_rows": ddr_rows, "depth": depth, "p50_ms": p50 * 1e3,
               "mean_ms": statistics.mean(times) * 1e3, "hbm_hit_rate": _hit_rate(before, after),
               "side_stream": up.stream is not None, "staged_uploads": up.uploads + up.bypassed}
        if first is None:
            first = rows_now
        else:
            same = torch.equal(rows_now, first)
            identical &= same
            worst = max(worst, (rows_now - first).abs().max().item())
            run["bit_identical_to_resident"] = same
        out["runs"].append(run)
        uploads = (f"  {run['staged_uploads']} uploads from pinned staging on a side stream" if run["side_stream"]
                   else "  misses copied in place (no stream)") if ddr_rows else ""
        lines.append((label, f"p50 {p50 * 1e3:8.2f} ms  mean {run['mean_ms']:8.2f} ms  HBM hits "
                             f"{run['hbm_hit_rate']:.1%}{uploads}"))
    resident, cached = out["runs"][0]["p50_ms"], out["runs"][1]["p50_ms"]
    out.update(resident_ms=resident, cached_ms=cached, ratio=cached / resident,
               bit_identical=identical, max_abs_diff=worst, rows_compared=len(check))
    result["cache"] = out
    lines += [(f"depth {DEPTH} / every row resident", f"{cached / resident:.2f}x  {_goal_text('cache')}"),
              ("bit-identical rows across the runs", f"{identical} ({len(check)} rows with their optimizer state; "
                                                     f"max difference {worst:.1e})")] + ([ops_line] if ops_line else [])
    _print_section(f"the HBM tier as a cache: {rows} x {dim} rows, Adagrad, {bags} bags x {POOLING} Zipf {ALPHA} ids, "
                   f"{sz['steps']} timed steps after {sz['warmup']}; time ratio cached / resident", lines)


def _compile(directory, seed, sz, device, timer, backend, result) -> None:
    from tierstore.tools.bench_gpu_compile import compile_part

    result["compile"], lines = compile_part(directory, seed, sz, device, timer, backend)
    _print_section(f"compile and export: {result['compile']['model']}, {result['compile']['steps']} steps", lines)


def _hit_rate(before: dict, after: dict) -> float:
    """The HBM tier's hit rate over the steps between two of its stats()."""
    hits, misses = (after[k] - before[k] for k in ("hits", "misses"))
    return hits / (hits + misses) if hits + misses else 0.0


def _tests_path(given: str | None) -> Path | None:
    if given is not None:
        return None if given == "none" else Path(given)
    here = Path(__file__).resolve().parent.parent / "tests"  # tools/ sits beside tests/ in a checkout
    for path in (here, Path.cwd() / "tests"):
        if (path / "test_gpu.py").exists():
            return path
    return None


def _tests(given: str | None, deadline: float, result) -> None:
    """``pytest -m gpu`` in a child process, within what is left of the budget."""
    path = _tests_path(given)
    if path is None:
        result["tests"] = {"run": False, "why": "no tests folder found (pass --tests PATH)" if given != "none" else "--tests none"}
        _print_section("tests marked gpu", [("not run", result["tests"]["why"])])
        return
    limit = max(60.0, deadline - time.monotonic())
    # a module that cannot be imported here (an optional dependency missing) is one error, not the end of the run
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rfEs", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", str(path)]
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, timed_out = child.communicate(timeout=limit)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the child's own group: the processes some tests start go too
        output, timed_out = child.communicate()[0], True
    counts = {}
    summary = [line for line in output.splitlines() if re.search(r"\b\d+ (passed|failed|skipped|error|deselected)", line)]
    for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", summary[-1] if summary else ""):
        counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    failures = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    result["tests"] = {"run": True, "command": " ".join(cmd), "returncode": child.returncode, "timed_out": timed_out,
                       "seconds": round(time.monotonic() - t0, 1), "limit_s": round(limit),
                       **{k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "error", "deselected")},
                       "failures": failures, "skips": [l for l in output.splitlines() if l.startswith("SKIPPED ")],
                       "output_tail": output[-4000:]}
    t = result["tests"]
    lines = [("counts", f"{t['passed']} passed, {t['failed']} failed, {t['error']} errors, {t['skipped']} skipped in "
                        f"{t['seconds']} s" + (f" (stopped at its {t['limit_s']} s limit)" if timed_out else ""))]
    lines += [("", f) for f in failures[:30]]  # the output the device's runner returns is limited: the summary last
    if child.returncode not in (0, 5) or timed_out:  # 5: nothing selected
        lines.append(("output tail", "\n" + output[-2000:]))
    _print_section(f"tests marked gpu: {t['command']}", lines)


def _machine(device: torch.device) -> dict:
    import tierstore

    facts = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "device": str(device), "gpu": None, "gpu_memory_gib": None, "driver": None,
             "cuda": torch.version.cuda, "torch": torch.__version__, "python": platform.python_version(),
             "tierstore": tierstore.__version__, "commit": _commit(), "cpus": os.cpu_count(),
             "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), driver=_driver())
    return facts


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001 - no NVML: the driver is reported unknown
        return None


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _guarded(result: dict, part: str, fn) -> None:
    """Runs a part; an exception is reported and recorded, and the next part runs."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - one part's failure must not cost the others' figures
        result["errors"][part] = f"{type(e).__name__}: {e}"
        print(f"\n== {part}: FAILED\n{traceback.format_exc()}", flush=True)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _goals(result: dict) -> dict:
    figures = {"resident_sgd": (result["resident"] or {}).get("SGD", {}).get("ratio"),
               "resident_adagrad": (result["resident"] or {}).get("Adagrad", {}).get("ratio"),
               "read": (result["read"] or {}).get("ratio"), "cache": (result["cache"] or {}).get("ratio")}
    goals = {}
    for key, (kind, op, goal) in GOALS.items():
        value = figures[key]
        met = None if value is None else (value <= goal if op == "<=" else value >= goal)
        goals[key] = {"kind": kind, "value": value, "goal": f"{op} {goal}", "met": met}
    cache = result["cache"] or {}
    goals["bit_identical"] = {"kind": "check", "value": cache.get("bit_identical"), "goal": "true",
                              "met": cache.get("bit_identical")}
    for name in ("compile", "export"):  # the demo DLRM captured whole, computing what eager does
        done = (result["compile"] or {}).get(name)
        ok = None if done is None else bool(done["ok"] and done["equal"])
        goals[f"{name}_equals_eager"] = {"kind": "check", "value": ok, "goal": "true", "met": ok}
    for name in ("resident", "cached"):
        ops = result["ops"].get(name)
        clean = None if ops is None else (ops["host_syncs"] == 0 and ops["data_dependent"] == 0
                                          and ops["device_to_host"] == 0 and not ops["sync_debug_warnings"])
        goals[f"sync_free_{name}"] = {"kind": "check", "value": clean, "goal": "true", "met": clean}
    # the ops a table's step runs as one piece each: aten ops and compiled kernels
    n = result["ops"]["resident"]["leaf_ops"] if "resident" in result["ops"] else None
    goals["resident_ops"] = {"kind": "count", "value": n, "goal": "<= 12", "met": None if n is None else n <= 12}
    return goals


def _goal_text(key: str) -> str:
    _, op, goal = GOALS[key]
    return f"(goal {op} {goal})"


def _ops_text(ops: dict) -> str:
    syncs = "" if ops["sync_debug_warnings"] is None else f", {ops['sync_debug_warnings']} syncs seen by CUDA"
    return (f"{ops['leaf_ops']} ops ({ops['aten_ops']} aten + {ops['leaf_ops'] - ops['aten_ops']} compiled; "
            f"{ops['other_ops']} custom ops in all), {ops['host_syncs']} host syncs "
            f"(_local_scalar_dense...), {ops['data_dependent']} data-dependent (nonzero, unique...), "
            f"{ops['device_to_host']} device-to-host copies{syncs}")


def _print_section(title: str, lines) -> None:
    print(f"\n== {title}")
    width = max((len(str(k)) for k, _ in lines), default=0)
    for k, v in lines:
        print(f"   {str(k):<{width}}  {v}")
    sys.stdout.flush()


def _summary(result: dict) -> None:
    lines = []
    for key, g in result["goals"].items():
        value = g["value"]
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append((key, f"{shown:>8}  goal {g['goal']:<8}  "
                           + {True: "met", False: "NOT MET", None: "not measured"}[g["met"]]))
    t = result["tests"]
    if t and t.get("run"):
        lines.append(("pytest -m gpu", f"{t['passed']} passed, {t['failed']} failed, {t['error']} errors, "
                                       f"{t['skipped']} skipped"))
    lines += [(f"error in {part}", e) for part, e in result["errors"].items()]
    m = result["machine"]
    _print_section(f"gpu summary: {m['gpu'] or m['device']}, driver {m['driver']}, CUDA {m['cuda']}, torch "
                   f"{m['torch']}, tierstore {m['tierstore']} ({m['commit']}), {result['seconds']} s", lines)


def _save(path: str | None, result: dict) -> None:
    if path is None:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)
