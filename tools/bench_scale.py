"""``tierstore bench scale``: a table many times larger than the memory a trainer is
given, trained under a real memory limit.

One run builds (or reuses, ``--path``) a table of ``--rows`` x ``--dim`` float32 rows
(8.1 GiB of rows by default), then, in the same run:

- the floors (tools/bench_floors.py): the disk's 4 KiB random reads at queue depth 32
  and 1 on the store's own data.mdb, and py-lmdb alone doing a step's gets and puts;
- the in-memory steps on the same batches, outside any limit: FBGEMM's fused CPU
  TBE holding the whole table (where fbgemm-gpu-cpu is installed), and the DLRM demo
  model (tools/demo.py) with nn.EmbeddingBag holding it;
- the embedding-only step (2048 bags x 32 ids, Zipf ranks scattered over the ids, SGD,
  1 thread) at each ``--budgets`` x ``--depths`` (LookaheadLoader), and the DLRM model
  at the largest budget a tenth of the table or less, each in a child process. The
  child builds its batches (the DLRM's also runs a step of a throwaway model, so that
  torch's own first-step memory is held before: _warm_torch), is limited to its RSS +
  the budget + MARGIN by a memory cgroup (v1 or v2, where the machine lets this process
  make one), the store's pages are dropped from the page cache, and then it opens the
  store with memory_budget=. The cgroup's memory.stat is sampled as the child runs.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tierstore.eviction import POLICIES
from tierstore.io.rowlog import SPARE
from tierstore.tools.bench import shared
from tierstore.tools.bench_floors import disk_floor, drop_page_cache, lmdb_floor
from tierstore.tools.bench_scale_report import print_report
from tierstore.tools.cli import nonneg_int

ROWS, DIM = 34_000_000, 64  # 34M x 64 float32: 8.1 GiB of rows
BUDGETS = ("512MiB", "1GiB", "2GiB")
DEPTHS = (0, 4)
# the DLRM runs at the deepest of --depths, at least this: the lookahead a trainer would give it (`--depths 2`
# measures it at 2). Its own child on the 34M scattered table at 0.5 GiB took 204 ms a step at depth 4 against
# 226 at 2 (three and two runs, LRU): its batches' rows, fetched two steps ahead, kept it waiting
DLRM_MIN_DEPTH = 2
BAGS, POOLING, ALPHA, LR = 2048, 32, 1.05, 0.01
WARMUP = 60  # untimed steps before the timed ones (--warmup): the 0.5 GiB DDR tier is full by then (22% after 5)
MARGIN = 16 << 20  # over the child's RSS + the budget: the interpreter's own growth
FLOOR_SECONDS = 3.0  # per queue depth
TABLE = "t0"  # TieredEmbeddingBag's default table name
MARKER = "bench-scale.json"  # written once every row is durable: a store that may be reused
AGE_CHUNK = 1 << 15  # rows a write of --age-rows writes: about what a write-back's commit writes
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
# memory.stat's counters the report keeps, v1's name -> v2's: anonymous memory (the process's own), the page
# cache's, and of it the dirty pages and those being written (which reclaim cannot drop until written)
STAT_V1 = {"rss": "anon", "cache": "file", "mapped_file": "file_mapped", "dirty": "file_dirty",
           "writeback": "file_writeback", "shmem": "shmem"}
STAT_PERIOD = 0.1  # seconds between samples of the group's memory.stat while its child runs


# -- the table ---------------------------------------------------------------------------------
def table_spec(rows: int, dim: int):
    import tierstore

    # what TieredEmbeddingBag(rows, dim, optimizer=SGD) declares, so that it reopens the table
    return tierstore.TableSpec(TABLE, rows, dim, init=tierstore.RowInit.normal(0.0, 1.0))


def prepare_table(path: Path, rows: int, dim: int, seed: int, declared: int | None = None,
                  scattered: bool = False) -> dict:
    """Reuse the table at ``path`` if a finished build of the same shape is there, else
    build it: every row written and flushed, ascending (as a bulk load) or, ``scattered``, in
    a random order, each row placed apart from its neighbours as a long training run's
    write-backs leave them (the evicted rows, side by side at the log's end): its row index
    then holds a run a row, as an aged table's does. ``declared``: the rows the table
    declares (num_rows), at least ``rows``; ids from ``rows`` up are never written."""
    declared = rows if declared is None else declared
    marker = path / MARKER
    if marker.exists():
        built = json.loads(marker.read_text())
        shape = (built["rows"], built["dim"], built.get("declared", built["rows"]), built.get("scattered", False))
        if shape != (rows, dim, declared, scattered):
            raise SystemExit(f"--path {path} holds a bench scale table of {built['rows']:,} x {built['dim']} "
                             f"({built.get('declared', built['rows']):,} declared, {_order(shape[3])}), not {rows:,} x {dim} "
                             f"({declared:,}, {_order(scattered)}); pass the same --rows/--dim/--declared-rows/--scattered, "
                             "or another --path")
        return {**built, "reused": True}
    if path.exists() and any(path.iterdir()):
        raise SystemExit(f"--path {path} is not empty and holds no finished bench scale table ({MARKER}); "
                         "pass an empty or new directory")
    import tierstore

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    order = rng.permutation(rows) if scattered else None
    # a commit places its rows by id, so a scattered build commits at least 64 times: an id's
    # neighbours then lie in other commits' pages
    chunk = max(1, min(1 << 18, rows // 64)) if scattered else 1 << 18
    with tierstore.TieredStore(path, [table_spec(declared, dim)], hbm_rows=0, ddr_rows=0, device="cpu") as store:
        for lo in range(0, rows, chunk):
            n = min(rows, lo + chunk) - lo
            ids = order[lo:lo + n] if scattered else np.arange(lo, lo + n)
            store.write(TABLE, ids, rng.standard_normal((n, dim), dtype=np.float32) * 0.01)
            if scattered:
                store.flush()
        store.flush()
    built = {"rows": rows, "dim": dim, "declared": declared, "scattered": scattered,
             "build_s": round(time.perf_counter() - t0, 1), "data_mdb_bytes": (path / "data.mdb").stat().st_size}
    marker.write_text(json.dumps(built))
    return {**built, "reused": False}


def age_table(path: Path, rows: int, dim: int, n: int, seed: int, budget: int) -> dict:
    """Rewrite ``n`` rows of ids drawn uniformly over the table's ``rows`` (seeded by ``seed``
    and a number no run on the table had before), AGE_CHUNK a write, under
    ``memory_budget=budget``: what the write-backs of a long training run leave, each row they
    move a run of its own in the row index (io.rowindex), in minutes rather than hours (40M
    rows of the 200M x 16 table: 257 s). Counted in the table's marker (``aged_rows``),
    which reuse keeps: each command with ``--age-rows`` ages the table further. Returns the
    rows written, the seconds taken, and the table's ``aged_rows`` since it was built."""
    import tierstore

    rng = np.random.default_rng([seed, _next_salt(path)])
    t0, written = time.perf_counter(), 0
    with tierstore.TieredStore(path, device="cpu", memory_budget=budget) as store:
        while written < n:
            ids = np.unique(rng.integers(0, rows, min(AGE_CHUNK, n - written)))
            store.write(TABLE, ids, rng.standard_normal((len(ids), dim), dtype=np.float32) * 0.01)
            written += len(ids)
        store.flush()
    return {"rows": written, "seconds": round(time.perf_counter() - t0, 1), "aged_rows": _counted(path, "aged_rows", written)}


def _order(scattered: bool) -> str:
    return "rows scattered" if scattered else "rows ascending"


# -- the memory cgroup -------------------------------------------------------------------------
_RUNS = itertools.count()


class MemoryGroup:
    """A memory cgroup this process made (v1 ``memory`` controller or v2), for one child."""

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version
        self.procs = path / "cgroup.procs"

    @classmethod
    def make(cls, name: str) -> tuple["MemoryGroup | None", str]:
        """The group, or None and why none could be made."""
        if (CGROUP_V1 / "memory.limit_in_bytes").exists():
            where, version = CGROUP_V1, 1
        elif "memory" in _read(CGROUP_V2 / "cgroup.controllers").split():
            where, version = CGROUP_V2, 2
        else:
            return None, f"no cgroup memory controller here ({CGROUP_V1} nor memory in {CGROUP_V2}/cgroup.controllers)"
        try:
            if version == 2 and "memory" not in _read(where / "cgroup.subtree_control").split():
                (where / "cgroup.subtree_control").write_text("+memory")
            path = where / name
            path.mkdir(exist_ok=True)
        except OSError as e:
            return None, (f"cannot make a memory cgroup under {where} ({e.strerror}; it needs root or a delegated "
                          "cgroup)")
        return cls(path, version), f"cgroup v{version} memory group {path}"

    def limit(self, nbytes: int) -> None:
        """Set the limit, and start the peak afresh where the kernel can (v1; v2 from Linux 6.12)."""
        (self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")).write_text(str(nbytes))
        try:
            (self.path / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")).write_text("0")
        except OSError:
            pass  # v2 before 6.12: the peak includes the batches' building

    def peak(self) -> int | None:
        text = _read(self.path / ("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"))
        return int(text) if text.strip().isdigit() else None

    def usage(self) -> int | None:
        """Bytes charged to the group now."""
        text = _read(self.path / ("memory.usage_in_bytes" if self.version == 1 else "memory.current"))
        return int(text) if text.strip().isdigit() else None

    def stat(self) -> dict[str, int]:
        """What the group's charge is made of, in v2's names (v1's renamed, its totals left out)."""
        counts = dict(line.split() for line in _read(self.path / "memory.stat").splitlines() if len(line.split()) == 2)
        names = STAT_V1 if self.version == 1 else {k: k for k in STAT_V1.values()}
        return {ours: int(counts[theirs]) for theirs, ours in names.items() if theirs in counts}

    def oom_kills(self) -> int | None:
        """OOM kills in the group (v1's oom_control has the count on kernels >= 4.13)."""
        text = _read(self.path / ("memory.oom_control" if self.version == 1 else "memory.events"))
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts["oom_kill"]) if "oom_kill" in counts else None

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass  # a child left in it: the group stays, empty once it ends


class StatWatch(threading.Thread):
    """Samples a group's memory.stat every STAT_PERIOD until stopped; keeps the sample of most
    anonymous memory and the last one (a child OOM-killed: what the group held just before)."""

    def __init__(self, group: MemoryGroup):
        super().__init__(name="tierstore-bench-memstat", daemon=True)
        self.group, self.done = group, threading.Event()
        self.most_anon: dict[str, int] = {}
        self.last: dict[str, int] = {}

    def run(self) -> None:
        while not self.done.wait(STAT_PERIOD):
            sample = self.group.stat()
            if not sample.get("anon"):  # the group is gone, or its child ended (its page cache may stay charged) or is not in it yet
                continue
            self.last = sample
            if sample.get("anon", 0) >= self.most_anon.get("anon", -1):
                self.most_anon = sample

    def stop(self) -> dict:
        self.done.set()
        self.join()
        return {"cgroup_at_most_anon": self.most_anon, "cgroup_last": self.last}


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# -- a child: one timed run --------------------------------------------------------------------
def _rss(field: str = "VmRSS") -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    """VmHWM from now on: the run's peak, not the batch building's (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # the peak then includes the batches' building


def _disk_io() -> tuple[int, int]:
    d = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


def _emb_batches(rows: int, n: int, seed: int, bags: int) -> list[torch.Tensor]:
    from tierstore.tools.demo import ZipfIds

    gen = torch.Generator().manual_seed(seed)
    zipf = ZipfIds(rows, ALPHA, gen)
    return [zipf.sample(bags * POOLING, gen) for _ in range(n)]


def _dlrm_parts(job: dict):
    """The DLRM demo's batches (one table, job["bags"] examples, POOLING ids a bag on average)
    and a function making its model over an embeddings callable."""
    from tierstore.tools.demo import DLRM, ClickData, DemoConfig, seeded

    cfg = DemoConfig(tables=1, rows=job["rows"], dim=job["dim"], batch=job["bags"], pooling=POOLING, optimizer="sgd", lr=LR,
                     seed=job["seed"], progress=False)
    gen = seeded(cfg.seed)
    data = ClickData(cfg, gen)
    batches = [data.batch(gen) for _ in range(job["steps"])]
    name = cfg.table_names[0]
    return batches, name, lambda embeddings: DLRM(embeddings, [name], cfg.dim, seeded(cfg.seed + 1))


def _dlrm_step(model, emb_opt=None):
    dense_opt = torch.optim.Adagrad([*model.bottom.parameters(), *model.top.parameters()], lr=LR)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step(batch):
        dense, sparse, labels = batch
        loss = loss_fn(model(dense, sparse), labels)
        dense_opt.zero_grad(set_to_none=True)
        if emb_opt is not None:
            emb_opt.zero_grad(set_to_none=True)
        loss.backward()
        dense_opt.step()
        if emb_opt is not None:
            with torch.sparse.check_sparse_tensor_invariants(enable=False):
                emb_opt.step()
    return step


def _times(step, batches, warmup: int, at_start=lambda: None):
    """Seconds of each step after ``warmup`` untimed ones; ``at_start()`` runs before the timed.
    A step's time includes taking its batch from ``batches``: a LookaheadLoader announces the
    batches ahead then, in the trainer's thread."""
    it = iter(batches)
    for _ in range(warmup):
        step(next(it))
    start = at_start()
    times = []
    t0 = time.perf_counter()
    for batch in it:
        step(batch)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times, start


def _summary(times: list[float], lookups: int) -> dict:
    t = np.array(times)
    return {"steps": len(t), "p50_s": float(np.median(t)), "p90_s": float(np.percentile(t, 90)),
            "p99_s": float(np.percentile(t, 99)), "mean_s": float(t.mean()), "lookups_per_s": lookups / float(t.sum())}


def _ids(batch) -> torch.Tensor:
    """A batch's ids: the embedding step's tensor, or the DLRM batch's one table's."""
    return batch if isinstance(batch, torch.Tensor) else batch[1][next(iter(batch[1]))][0]


def _lookups(batch) -> int:
    return _ids(batch).numel()


def _in_memory(job: dict) -> dict:
    """FBGEMM's embedding-only step and the DLRM model with nn.EmbeddingBag, each holding
    the whole table in memory, on the tiered runs' batches."""
    from tierstore.tools.bench_peers import fbgemm_module
    from tierstore.tools.demo import InMemoryBags

    rows, dim, warmup = job["rows"], job["dim"], job["warmup"]
    out = {}
    fb = fbgemm_module(rows, dim, "EXACT_SGD", {"lr": LR}, torch.device("cpu"))
    if fb is not None:
        batches = _emb_batches(rows, job["steps"], job["seed"], job["bags"])
        offsets = torch.arange(job["bags"] + 1) * POOLING  # FBGEMM takes the bags' end offset too
        times, _ = _times(lambda ids: fb(ids, offsets).sum().backward(), batches, warmup)
        out["fbgemm"] = _summary(times, sum(map(_lookups, batches[warmup:])))
        del fb
        gc.collect()
    batches, name, make = _dlrm_parts(job)
    bags = InMemoryBags({name: torch.zeros(rows, dim)})
    step = _dlrm_step(make(bags), torch.optim.SGD(bags.parameters(), lr=LR))
    times, _ = _times(step, batches, warmup)
    out["dlrm"] = _summary(times, sum(map(_lookups, batches[warmup:])))
    return out


def _tiered(job: dict, batches, go, first_use: float | None = None) -> dict:
    """The embedding-only step or the DLRM model over TieredEmbeddingBag(memory_budget=)."""
    import tierstore
    from tierstore.engine.prefetch import LookaheadLoader

    dlrm = job["kind"] == "dlrm"
    go()  # the limit is set and the page cache dropped: open the store now
    # a trace recorded where asked, for the capacity tools' prediction of this run (_predicted)
    opened = tierstore.TieredStore(job["path"], [table_spec(job["declared"], job["dim"])], device="cpu", memory_budget=job["budget"],
                                   record_trace=job.get("trace"), spare_space=job["spare_space"], policy=job["policy"])
    emb = tierstore.TieredEmbeddingBag(job["declared"], job["dim"], mode="sum", store=opened, table=TABLE,
                                       optimizer=tierstore.optim.SGD(lr=LR))
    if dlrm:
        data, name, make = batches
        step = _dlrm_step(make(lambda sparse: {name: emb(*sparse[name])}))
        loader = LookaheadLoader(data, emb, depth=job["depth"], ids=lambda b: {TABLE: b[1][name][0]})
        timed = data[job["warmup"]:]
    else:
        offsets = torch.arange(job["bags"]) * POOLING
        loader = LookaheadLoader(batches, emb, depth=job["depth"], ids=lambda ids: {TABLE: ids})
        timed = batches[job["warmup"]:]

        def step(ids):
            emb(ids, offsets).sum().backward()

    store = emb.store
    times, (s0, io0, ddr0, st0, cpu0) = _times(step, loader, job["warmup"], lambda: (
        store.stats(), _disk_io(), store.memory().parts["ddr"], store.stage_seconds(), _thread_cpu()))
    s1, io1, st1, cpu1 = store.stats(), _disk_io(), store.stage_seconds(), _thread_cpu()
    n = len(times)
    ssd = {k: s1["ssd"][k] - s0["ssd"][k] for k in ("reads", "writes", "read_bytes", "write_bytes")}
    read, written = io1[0] - io0[0], io1[1] - io0[1]

    def hit_rate(tier):
        hits, misses = (s1[tier][k] - s0[tier][k] for k in ("hits", "misses"))
        return hits / (hits + misses) if hits + misses else None

    memory = store.memory()
    result = {**_summary(times, sum(map(_lookups, timed))), "hbm_hit": hit_rate("hbm"), "ddr_hit": hit_rate("ddr"),
              "ddr_full_at_start": ddr0.used_rows / ddr0.rows if ddr0.rows else None,
              "ddr_evictions": s1["ddr"]["evictions"] - s0["ddr"]["evictions"], "rows_read_per_step": ssd["reads"] / n, "rows_written_per_step": ssd["writes"] / n,
              "disk_read_bytes_per_step": read / n, "disk_written_bytes_per_step": written / n,
              "read_amp": read / ssd["read_bytes"] if ssd["read_bytes"] else None,
              "write_amp": written / ssd["write_bytes"] if ssd["write_bytes"] else None,
              "rss_peak": _rss("VmHWM"), "store_host_bytes": memory.host_bytes,
              "parts": {k: p.bytes for k, p in memory.parts.items()}, "ddr_rows": memory.parts["ddr"].rows,
              "parts_used": {k: p.used_bytes for k, p in memory.parts.items()},
              "ddr_since_open": {k: s1["ddr"][k] for k in ("hits", "misses", "evictions")},
              "stage_ms_per_step": {k: 1e3 * (v - st0.get(k, 0.0)) / n for k, v in st1.items()},
              "thread_cpu_ms_per_step": _per_step(cpu0, cpu1, n), "first_use_rows_per_step": first_use,
              "read_path": s1["read_path"]}
    print(json.dumps(result), flush=True)  # before close: its flush may be what the limit kills
    emb.close()
    store.close()  # where the module was given it, closing the module leaves it open
    return result


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """{thread id: (name, CPU seconds)} of this process's threads: Python's names where the
    thread is Python's (tierstore names its own), "native" for torch's, LMDB's and others;
    and under id 0 the whole process's ("process"), which keeps the CPU of threads that
    have ended (the write-back thread leaves whenever its queue is empty)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {0: ("process", _cpu_seconds(_read(Path("/proc/self/stat")), tick))}
    for tid in os.listdir("/proc/self/task"):
        stat = _read(Path(f"/proc/self/task/{tid}/stat"))
        if not stat:  # it ended meanwhile
            continue
        out[int(tid)] = (re.sub(r"_\d+$", "", names.get(int(tid), "native")), _cpu_seconds(stat, tick))
    return out


def _cpu_seconds(stat: str, tick: int) -> float:
    utime, stime = stat[stat.rindex(")") + 2:].split()[11:13]
    return (int(utime) + int(stime)) / tick


def _per_step(before: dict, after: dict, steps: int) -> dict[str, float]:
    """CPU ms a step by thread name (pools' threads together) between two _thread_cpu();
    "ended threads": what threads that ended meanwhile took (the process's less the live ones')."""
    out: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        if tid:
            out[name] = out.get(name, 0.0) + 1e3 * (seconds - before.get(tid, (name, 0.0))[1]) / steps
    ended = 1e3 * (after[0][1] - before[0][1]) / steps - sum(out.values())
    out["ended threads"] = max(0.0, ended)
    return out


def child(job: dict) -> None:
    """One run in this process: build the batches, say the RSS, wait for the parent's go."""
    torch.set_num_threads(1)
    if job["kind"] == "inmem":
        print(json.dumps({"rss": _rss()}), flush=True)
        print(json.dumps(_in_memory(job)), flush=True)
        return
    batches = _dlrm_parts(job) if job["kind"] == "dlrm" else _emb_batches(job["rows"], job["steps"], job["seed"], job["bags"])
    batches = _relabeled(batches, job)
    first_use = _first_use_rows(batches, job["rows"], job["warmup"])
    if job["kind"] == "dlrm":
        _warm_torch(batches, job["dim"])
    gc.collect()
    _reset_peak_rss()
    print(json.dumps({"rss": _rss()}), flush=True)
    _tiered(job, batches, lambda: sys.stdin.readline(), first_use)


def _warm_torch(parts, dim: int) -> None:
    """One step of a throwaway DLRM model on zero embeddings: torch's own memory of a first
    forward and backward (56 MiB here: its autograd engine and kernels' buffers, the same
    for any model of this size) is then the trainer's, held before the store opens, not
    charged against the store's budget by the limit."""
    batches, name, make = parts
    examples = len(batches[0][0])
    _dlrm_step(make(lambda sparse: {name: torch.zeros(examples, dim)}))(batches[0])


def _relabeled(batches, job: dict):
    """The batches with their ids renamed by a permutation of the table's own (seeded by
    job["layout_salt"]). Each run writes back the rows it evicts, packed side by side at the
    log's end, so a run on the same ids as one before would find the rows it uses clustered
    in pages that the one before wrote: its reads would be fewer than a table whose layout
    owes nothing to the trace gives. A renamed batch has the same duplicates, bags and
    ranks: only which rows they fall on changes."""
    if job.get("layout_salt") is None:
        return batches
    rename = torch.randperm(job["rows"], generator=torch.Generator().manual_seed(job["layout_salt"]))
    if job["kind"] == "dlrm":
        out = [(dense, {k: (rename[ids], offsets) for k, (ids, offsets) in sparse.items()}, labels)
               for dense, sparse, labels in batches[0]]
        return (out, *batches[1:])
    return [rename[ids] for ids in batches]


def _first_use_rows(batches, rows: int, warmup: int) -> float:
    """Rows a timed step uses that no step before it used, on average: the store opens with
    empty tiers, so any cache of any size reads each of them from disk at least once."""
    ids = map(_ids, batches[0] if isinstance(batches, tuple) else batches)
    seen = torch.zeros(rows, dtype=torch.bool)
    new = []
    for b in ids:  # a loop per step
        u = torch.unique(b)
        new.append(int((~seen[u]).sum()))
        seen[u] = True
    timed = new[warmup:]
    return sum(timed) / len(timed) if timed else 0.0


# -- the parent --------------------------------------------------------------------------------
def _spawn(job: dict, path: Path, limited: bool = False) -> dict:
    """Run ``child(job)``; with ``limited``, in a memory cgroup of its own from its start
    (where one can be made), limited once its batches are built to their RSS + the
    budget + MARGIN. Returns its result and what it held."""
    what = {k: job[k] for k in ("kind", "budget", "depth") if k in job}
    print(f"bench scale: running {what}", file=sys.stderr, flush=True)
    group = MemoryGroup.make(f"tierstore-bench-scale-{os.getpid()}-{next(_RUNS)}")[0] if limited else None
    try:
        return _run_child(job, path, group)
    finally:
        if group is not None:
            group.remove()


def drop_store_pages(path: Path) -> None:
    """Drop every file of the store at ``path`` from the page cache: the row index's too, whose
    pages a run before left cached served the next run's lookups from memory charged to no
    limit of its (0.002-0.05 pages read an id where a cold index reads 0.55)."""
    for file in [path / "data.mdb", *path.glob("index-*.bin")]:
        drop_page_cache(file)


def _run_child(job: dict, path: Path, group: MemoryGroup | None) -> dict:
    cmd = [sys.executable, "-m", "tierstore.tools.bench_scale", json.dumps(job)]
    if group is not None:  # joins before exec, so every page it touches is charged to the group
        cmd = ["sh", "-c", f'echo $$ > {shlex.quote(str(group.procs))} && exec "$@"', "sh", *cmd]
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        ready = p.stdout.readline()
        out = {"rss_before": json.loads(ready)["rss"] if ready else None}
        watch = None
        if ready and job["kind"] != "inmem":
            if group is not None:
                # charged: less than the RSS where the libraries' pages were charged to the parent, which loaded them first
                out["charged_before"] = group.usage()
                out["limit"] = out["rss_before"] + job["budget"] + MARGIN
                group.limit(out["limit"])
                watch = StatWatch(group)
                watch.start()
            drop_store_pages(path)
            # the disk's speed the minute the run starts, its floor's: on a VM it moved from 10k to 96k
            # reads/s at depth 32 within an hour, and a floor measured at the start said little of a later run
            out["disk_iops_qd32"] = disk_floor(path / "data.mdb", FLOOR_SECONDS, depths=(32,))["iops_qd32"]
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = p.stdout.read().splitlines()
        p.wait()
        if watch is not None:
            out.update(watch.stop())
        err.seek(0)
        tail = err.read()[-2000:]
    out["exit"] = p.returncode
    if lines:
        out.update(json.loads(lines[-1]))
    elif p.returncode:
        out["error"] = tail.strip().splitlines()[-1] if tail.strip() else f"exit {p.returncode}"
    if group is not None:
        out["cgroup_peak"], kills = group.peak(), group.oom_kills()
        out["oom_killed"] = bool(kills) if kills is not None else p.returncode == -9
    return out


def _budgets(texts) -> list[int]:
    from tierstore.engine.memory import parse_bytes

    try:
        return [parse_bytes(t, "--budgets") for t in texts]
    except ValueError as e:
        raise SystemExit(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "dir", "seed", rows=ROWS, dim=DIM, repeat=100,
           helps={"repeat": "timed steps of each run", "dir": "directory for the table's store without --path "
                                                             "(default: a temporary one)"})
    p.add_argument("--path", default=None,
                   help="the table's store, built there once and reused (default: a temporary one)")
    p.add_argument("--budgets", nargs="+", default=list(BUDGETS),
                   help="memory budgets (memory_budget=): the embedding step runs at each, at each depth")
    p.add_argument("--depths", nargs="+", type=nonneg_int, default=list(DEPTHS),
                   help="LookaheadLoader depths of the embedding step")
    p.add_argument("--declared-rows", type=nonneg_int, default=None,
                   help="rows the table declares (num_rows), of which --rows are written and trained (default: --rows)")
    p.add_argument("--scattered", action="store_true",
                   help="build the table with its rows written in a random order, each placed apart from its "
                        "neighbours as a long training run leaves them (a row index of a run a row)")
    p.add_argument("--spare-space", type=float, default=SPARE,
                   help="the store's spare_space=: dead rows its table keeps at most, as a fraction of the live rows, "
                        "before its writes also copy rows to reclaim them (at most 1.0; a larger one copies fewer rows)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="lru",
                   help="the store's eviction policy= (LFU keeps rows by their uses while cached: under a stationary "
                        "Zipf stream it evicts the rows a step used once before those used again)")
    p.add_argument("--age-rows", type=nonneg_int, default=0,
                   help="before the runs, rewrite this many rows of random ids under the smallest budget, as a long "
                        "training run's write-backs leave a table (each command ages it further)")
    p.add_argument("--no-in-memory", action="store_true",
                   help="skip the in-memory steps (they hold the whole table in memory): no ratio to them is printed")
    p.add_argument("--warmup", type=nonneg_int, default=WARMUP, help="untimed steps before the timed ones")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> dict:
    budgets = _budgets(args.budgets)
    temp = None
    if args.path:
        path = Path(args.path)
    else:
        temp = tempfile.TemporaryDirectory(prefix="tierstore-bench-scale-", dir=args.dir)
        path = Path(temp.name) / "store"
    try:
        if args.declared_rows is not None and args.declared_rows < args.rows:
            raise SystemExit(f"--declared-rows {args.declared_rows:,} is fewer than --rows {args.rows:,}: a table declares "
                             "at least the rows written")
        result = _run(path, args.rows, args.dim, args.seed, budgets, args.depths, args.repeat, args.warmup, args.declared_rows,
                      not args.no_in_memory, args.scattered, args.spare_space, args.policy, args.age_rows)
    finally:
        if temp is not None:
            temp.cleanup()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result)
    return result


def _run(path: Path, rows: int, dim: int, seed: int, budgets: list[int], depths: list[int], repeat: int, warmup: int,
         declared: int | None = None, in_memory: bool = True, scattered: bool = False, spare_space: float = SPARE,
         policy: str = "lru", age_rows: int = 0) -> dict:
    from tierstore.config import StoreConfig
    StoreConfig(spare_space=spare_space)  # refused here, before the table is built, where it is not a spare_space
    table = prepare_table(path, rows, dim, seed, declared, scattered)
    if age_rows:
        print(f"bench scale: ageing the table by {age_rows:,} rows", file=sys.stderr, flush=True)
        aged = age_table(path, rows, dim, age_rows, seed, min(budgets))
        table["aged_rows"], table["aged"] = aged.pop("aged_rows"), aged
    table_bytes = rows * dim * 4
    job = {"rows": rows, "declared": table["declared"], "dim": dim, "seed": seed, "path": str(path), "warmup": warmup, "steps": warmup + repeat,
           "bags": BAGS, "spare_space": spare_space, "policy": policy}
    floors = {"disk": disk_floor(path / "data.mdb", FLOOR_SECONDS),
              "lmdb": lmdb_floor(path, TABLE, _emb_batches(rows, 1, seed, BAGS)[0].numpy())}
    probe, cgroup = MemoryGroup.make(f"tierstore-bench-scale-{os.getpid()}")
    if probe is not None:
        probe.remove()
    in_memory = _spawn({**job, "kind": "inmem"}, path) if in_memory else {"skipped": "--no-in-memory"}
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-scale-traces-") as traces:
        runs = []
        for b in budgets:
            for d in depths:
                emb = {**job, "kind": "emb", "budget": b, "depth": d}
                if d == 0:  # what the capacity tools predict is the store without prefetch
                    emb["trace"] = str(Path(traces) / f"trace-{b}")
                runs.append({"kind": "emb", "budget": b, "depth": d, **_spawn({**emb, "layout_salt": _next_salt(path)}, path, True)})
                if "trace" in emb and "ddr_since_open" in runs[-1]:
                    runs[-1]["predicted"] = _predicted(Path(emb["trace"]), runs[-1]["ddr_rows"], policy)
    fits = [b for b in budgets if table_bytes >= 10 * b]
    if fits:
        b = max(fits)
        depth = max(DLRM_MIN_DEPTH, *depths)
        runs.append({"kind": "dlrm", "budget": b, "depth": depth,
                     **_spawn({**job, "kind": "dlrm", "budget": b, "depth": depth, "layout_salt": _next_salt(path)}, path, True)})
    for r in runs:
        _ratios(r, floors, in_memory)
    return {"table": {**table, "path": str(path), "row_bytes": dim * 4, "table_bytes": table_bytes, "spare_space": spare_space,
                      "policy": policy},
            "batch": {"bags": job["bags"], "pooling": POOLING, "zipf": ALPHA, "warmup": warmup, "timed_steps": repeat, "threads": 1},
            "cgroup": cgroup.replace(f"-{os.getpid()}", "-PID-N") if probe is not None else f"none: {cgroup}; ran without a memory limit",
            "dlrm": None if fits else f"skipped: no budget in --budgets is a tenth of the table ({table_bytes:,} bytes) or less",
            "floors": floors, "in_memory": in_memory, "runs": runs}


def _next_salt(path: Path) -> int:
    """A number no run on this table had before (counted in its marker): each run renames
    its ids by it (_relabeled), so that no run reads a layout an earlier run of the same
    ids wrote."""
    return _counted(path, "runs", 1)


def _counted(path: Path, key: str, n: int) -> int:
    """Add ``n`` to the count ``key`` of the table's marker (kept on reuse); the new count."""
    marker = path / MARKER
    built = json.loads(marker.read_text())
    built[key] = built.get(key, 0) + n
    marker.write_text(json.dumps(built))
    return built[key]


def _predicted(trace: Path, ddr_rows: int, policy: str = "lru") -> dict:
    """What the capacity library predicts for the run's trace at its DDR tier's rows (the
    store's policy, no HBM tier): the replay (cachesim.simulate) and, for LRU, the one-pass
    curve `tierstore capacity` draws, to compare with the store's own counts."""
    from tierstore.capacity.cachesim import simulate
    from tierstore.capacity.curves import LruCurve, stack_distances
    from tierstore.trace import Trace
    from tierstore.capacity.trace_streams import build_streams

    start = time.perf_counter()
    (stream,) = build_streams(Trace.load(trace))
    replay = simulate(stream, 0, ddr_rows, policy)
    out = {"policy": policy, "replay": {"hits": replay.ddr_hits, "misses": replay.ddr_misses, "evictions": replay.ddr_evictions}}
    if policy == "lru":
        (distances,) = stack_distances([stream])
        curve = LruCurve.from_distances(stream, distances).tiers(0, ddr_rows)
        out["curve"] = {"hits": int(curve["ddr_hits"]), "misses": int(curve["misses"])}
    return {**out, "seconds": time.perf_counter() - start}


def _ratios(r: dict, floors: dict, in_memory: dict) -> None:
    """The run's step against the floors and the in-memory step (None where not measured)."""
    if "mean_s" not in r:
        return
    iops, lm = r.get("disk_iops_qd32") or floors["disk"]["iops_qd32"], floors["lmdb"]
    floor = r["rows_read_per_step"] / iops if iops else None
    r["disk_floor_s"] = floor
    r["x_disk_floor"] = r["mean_s"] / floor if floor else None
    r["lmdb_floor_s"] = (r["rows_read_per_step"] * lm["get_cold_us"] + r["rows_written_per_step"] * lm["put_us"]) / 1e6 \
        if lm["put_us"] is not None else None
    base = in_memory.get("dlrm" if r["kind"] == "dlrm" else "fbgemm")
    r["x_in_memory"] = base["lookups_per_s"] / r["lookups_per_s"] if base else None
    first = r.get("first_use_rows_per_step")
    r["first_use_floor_s"] = first / iops if iops and first is not None else None
    r["first_use_floor_x_in_memory"] = r["first_use_floor_s"] / base["mean_s"] if base and r["first_use_floor_s"] else None
    # the step's own floor: its in-memory step, or the disk reads no cache can save, whichever is longer
    r["floor_s"] = max(base["mean_s"], r["first_use_floor_s"] or 0.0) if base else None
    r["x_floor"] = r["mean_s"] / r["floor_s"] if r["floor_s"] else None


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
