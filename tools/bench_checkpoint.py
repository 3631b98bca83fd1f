"""Checkpoint and compile figures (BENCHMARKS.md, "Checkpoints and torch.compile").

``python -m tierstore.tools.bench_checkpoint DIR [--rows 1000000] [--dim 128] [--steps 60]``

Checkpoints: one table of rows x dim float32 with row-wise Adagrad, every row written, in
a TieredStore (no tiers) and in TorchRec's in-memory EmbeddingBagCollection. Each operation
runs in a fresh process (spawn); its time and the peak anonymous RSS it added (RssAnon,
sampled every 5 ms, over what the process held before it; LMDB's mapped file pages are
not counted) are printed. The page cache is warm (the files were just
written).

Compile: the demo's DLRM (tools/demo.py, its defaults) trained ``--steps`` steps on the same
batches eagerly and under torch.compile; the steps after the first 10 are timed.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import torch

CHUNK = 1 << 16


def _rss() -> int:
    """Anonymous resident bytes: the process's own memory. LMDB's map and the page cache
    (file pages mapped in) count in RSS too but are the kernel's to drop."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class Peak:
    """Peak anonymous RSS over a block, sampled every 5 ms, less that at its start."""

    def __enter__(self):
        self.base, self.peak, self.done = _rss(), _rss(), False
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        self.start = time.perf_counter()
        return self

    def _watch(self):
        while not self.done:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.done = True
        self.thread.join()
        self.peak = max(self.peak, _rss())
        self.added = self.peak - self.base


def _module(path: Path, rows: int, dim: int):
    import tierstore

    return tierstore.TieredEmbeddingBag(rows, dim, mode="sum", path=path, device="cpu",
                                        optimizer=tierstore.optim.RowWiseAdagrad(lr=0.01))


def _state(m) -> dict:
    return {"model": m.state_dict(), "optim": m.fused_optimizer.state_dict()}


def op_build(d: Path, rows: int, dim: int) -> str:
    m = _module(d / "store", rows, dim)
    g = torch.Generator().manual_seed(0)
    for lo in range(0, rows, CHUNK):
        n = min(CHUNK, rows - lo)
        m.store.write("t0", torch.arange(lo, lo + n), torch.cat([torch.randn(n, dim, generator=g) * 0.01,
                                                                 torch.rand(n, 1, generator=g)], 1), with_state=True)
    m.close()
    return "built"


def op_dcp_save(d: Path, rows: int, dim: int) -> Peak:
    import torch.distributed.checkpoint as dcp

    m = _module(d / "store", rows, dim)
    with Peak() as p:
        dcp.save(_state(m), checkpoint_id=d / "dcp")
    m.close()
    return p


def op_dcp_load_fresh(d: Path, rows: int, dim: int) -> Peak:
    m = _module(d / "fresh", rows, dim)
    p = _dcp_load(m, d)
    ok = torch.equal(m.store.read("t0", torch.arange(0, rows, 997), with_state=True),
                     _read_back(d, rows, dim))
    m.close()
    p.note = "restored rows equal" if ok else "RESTORED ROWS DIFFER"
    return p


def _read_back(d: Path, rows: int, dim: int) -> torch.Tensor:
    import tierstore

    with tierstore.TieredStore(d / "store", readonly=True) as s:
        return s.read("t0", torch.arange(0, rows, 997), with_state=True)


def _dcp_load(m, d: Path) -> Peak:
    """DCP's load into the module's store, as a trainer restores, made durable."""
    import torch.distributed.checkpoint as dcp

    with Peak() as p:
        sd = _state(m)
        dcp.load(sd, checkpoint_id=d / "dcp")
        m.load_state_dict(sd["model"])
        m.fused_optimizer.load_state_dict(sd["optim"])
        m.store.flush()
    return p


def op_dcp_load_same(d: Path, rows: int, dim: int) -> Peak:
    m = _module(d / "store", rows, dim)
    p = _dcp_load(m, d)
    m.close()
    return p


def op_store_checkpoint(d: Path, rows: int, dim: int) -> Peak:
    m = _module(d / "store", rows, dim)
    with Peak() as p:
        m.store.checkpoint(d / "snapshot")
    m.close()
    return p


def op_store_restore(d: Path, rows: int, dim: int) -> Peak:
    import tierstore

    with Peak() as p:
        s = tierstore.TieredStore(d / "snapshot")
        s.read("t0", [0])
    s.close()
    return p


def _torchrec_ebc(rows: int, dim: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])])
    momentum = torch.zeros(rows)  # what a fused row-wise Adagrad holds: one value a row
    return ebc, {"model": ebc.state_dict(), "optim": {"state": {"embedding_bags.t0.weight": {"t0.momentum1": momentum}}}}


def op_torchrec_save(d: Path, rows: int, dim: int) -> Peak:
    import torch.distributed.checkpoint as dcp

    _, sd = _torchrec_ebc(rows, dim)
    with Peak() as p:
        dcp.save(sd, checkpoint_id=d / "torchrec")
    return p


def op_torchrec_load(d: Path, rows: int, dim: int) -> Peak:
    import torch.distributed.checkpoint as dcp

    ebc, sd = _torchrec_ebc(rows, dim)
    with Peak() as p:
        dcp.load(sd, checkpoint_id=d / "torchrec")
        ebc.load_state_dict(sd["model"])
    return p


def _run(q, name, d, rows, dim):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        r = globals()[name](Path(d), rows, dim)
        q.put(r if isinstance(r, str) else (r.seconds, r.added, getattr(r, "note", "")))
    except BaseException as e:  # reported, not hidden
        q.put(f"failed: {type(e).__name__}: {e}")


def _in_child(name: str, d: Path, rows: int, dim: int):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_run, args=(q, name, str(d), rows, dim))
    p.start()
    r = q.get()
    p.join()
    return r


def _du(path: Path) -> str:
    return f"{sum(f.stat().st_size for f in path.rglob('*') if f.is_file()) / 2**20:.0f} MiB"


def checkpoints(d: Path, rows: int, dim: int) -> None:
    print(f"table {rows:,} x {dim} float32, row-wise Adagrad; one thread; each op in a fresh process")
    start = time.perf_counter()
    print("build (every row written):", _in_child("op_build", d, rows, dim), f"{time.perf_counter() - start:.1f} s,",
          "data", _du(d / "store"))
    for label, op, out in (("tierstore DCP save", "op_dcp_save", "dcp"),
                           ("tierstore DCP load into a fresh store (+ flush)", "op_dcp_load_fresh", "fresh"),
                           ("tierstore DCP load into the same store (+ flush)", "op_dcp_load_same", None),
                           ("store.checkpoint()", "op_store_checkpoint", "snapshot"),
                           ("open the store.checkpoint() copy", "op_store_restore", None),
                           ("TorchRec EBC (in memory) DCP save", "op_torchrec_save", "torchrec"),
                           ("TorchRec EBC (in memory) DCP load", "op_torchrec_load", None)):
        r = _in_child(op, d, rows, dim)
        if isinstance(r, str):
            print(f"{label}: {r}")
            continue
        size = f", files {_du(d / out)}" if out else ""
        print(f"{label}: {r[0]:.2f} s, peak anonymous RSS +{r[1] / 2**20:.0f} MiB{size} {r[2]}")


def compile_step(d: Path, steps: int) -> None:
    import torch._dynamo
    from tierstore.tools import demo

    torch.set_num_threads(1)
    cfg = demo.DemoConfig(dir=d / "demo", progress=False)
    times = {}
    for mode in ("eager", "compiled", "eager", "compiled"):
        path = d / f"demo-{mode}"
        shutil.rmtree(path, ignore_errors=True)
        ebc, model, data, g = demo._one_process(cfg, path, demo.seeded)
        torch._dynamo.reset()
        fwd = torch.compile(model) if mode == "compiled" else model
        opt = torch.optim.Adagrad([*model.bottom.parameters(), *model.top.parameters()], lr=cfg.lr)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        batches = [data.batch(g) for _ in range(steps)]
        marks = []
        for dense, sparse, labels in batches:
            loss = loss_fn(fwd(dense, sparse), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            marks.append(time.perf_counter())
        ebc.close()
        per = [b - a for a, b in zip(marks[10:], marks[11:])]
        per.sort()
        times.setdefault(mode, []).append((per[len(per) // 2], sum(per) / len(per), loss.item()))
    for mode, runs in times.items():
        print(f"demo DLRM {mode}: " + "; ".join(f"p50 {p * 1e3:.2f} ms, mean {m * 1e3:.2f} ms, last loss {l:.6f}" for p, m, l in runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", choices=["checkpoints", "compile"])
    a = ap.parse_args()
    if a.dir.exists():
        shutil.rmtree(a.dir)
    a.dir.mkdir(parents=True)
    if a.only != "compile":
        checkpoints(a.dir, a.rows, a.dim)
    if a.only != "checkpoints":
        compile_step(a.dir, a.steps)
    shutil.rmtree(a.dir)


if __name__ == "__main__":
    main()
