"""``tierstore demo``: train a small DLRM whose embedding tables live in a TieredStore.

The model: a bottom MLP over 13 dense features, several embedding tables
(TieredEmbeddingBagCollection, fused Adagrad), pairwise dot-product
interaction, a top MLP, logistic loss. The data: synthetic clicks whose ids
follow a Zipf law, with labels drawn from a hidden logistic model, so the
loss has something to learn. Every table is several times larger than its DDR
tier, so rows move between HBM, DDR and LMDB all the time. ``--compare``
trains the same model with torch.nn.EmbeddingBag in memory on the same data
and checks that the two runs agree.

After training, the serving step (``--no-serve`` skips it) exports
the store to int8 and float32 serving stores and serves the held-out batches
from each with the trained dense layers; float32 serving must reproduce
training's held-out loss. ``--record-trace PATH`` records the store's lookups
for ``tierstore capacity``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tierstore.engine.memory import format_bytes
from tierstore.precision import DTYPES
from tierstore.tools.capacity_progress import LineBar
from tierstore.tools.cli import add_verb
from tierstore.tools.demo_model import DLRM, ClickData, InMemoryBags, ZipfIds  # noqa: F401 (imported from here)
from tierstore.errors import PathExistsError, SettingError

MARKER = "tierstore-demo.json"  # marks a directory this demo made, so a rerun may replace it
LOSS_WINDOW = 50
PROGRESS_SECONDS = 5.0  # between progress lines when stderr is not a terminal (a log, a pipe)
AGREE_RTOL = 1e-3  # --compare: the two runs' mean loss over the last window must agree this closely
HALF_AGREE_RTOL = 2e-2  # ... with float16/bfloat16 tables, against float32 in memory


@dataclass
class DemoConfig:
    dir: Path = Path("tierstore-demo")
    steps: int = 600
    batch: int = 256
    tables: int = 4
    rows: int = 200_000
    dim: int = 16
    pooling: int = 8  # bags hold 1..2*pooling-1 ids, pooling on average
    hbm_rows: int = 2_000
    ddr_rows: int = 10_000
    policy: str = "lru"
    optimizer: str = "adagrad"
    lr: float = 0.05
    alpha: float = 1.05
    seed: int = 0
    dtype: str = "float32"  # of the tables' weights
    threads: int = 1  # the demo's tensors are small: more intra-op threads mostly contend
    compare: bool = False
    progress: bool = True
    world_size: int = 1  # > 1: tables sharded over that many local processes (gloo), checked against one process
    record_trace: Path | None = None  # the store's reads, as a trace for `tierstore capacity`
    serve: bool = True  # after training: export int8 and float32 serving stores, serve the held-out batches from each

    def __post_init__(self):
        self.dir = Path(self.dir)
        for name in ("steps", "batch", "tables", "rows", "dim", "pooling", "threads", "world_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise SettingError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("hbm_rows", "ddr_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise SettingError(f"--{name.replace('_', '-')} must be an integer >= 0, got {v!r}")
        if self.optimizer not in OPTIMIZERS:
            raise SettingError(f"--optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SettingError(f"--lr must be > 0, got {self.lr}")
        if not self.alpha > 0:
            raise SettingError(f"--alpha must be > 0, got {self.alpha}")
        if self.dtype not in DTYPES:
            raise SettingError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.batch % self.world_size:
            raise SettingError(f"--batch ({self.batch}) must be a multiple of --world-size ({self.world_size}): every rank "
                             "trains an equal part of each batch")
        if self.world_size > 1 and self.compare:
            raise SettingError("--compare is for one process; --world-size N already checks the ranks against one process")
        if self.world_size > 1 and self.record_trace is not None:
            raise SettingError("--record-trace records one process's store; drop --world-size or --record-trace")
        if self.record_trace is not None:
            self.record_trace = Path(self.record_trace)

    @property
    def table_names(self) -> list[str]:
        return [f"cat{i}" for i in range(self.tables)]


def _tierstore_opt(name, lr):
    import tierstore
    return {"adagrad": tierstore.optim.Adagrad, "sgd": tierstore.optim.SGD}[name](lr=lr)


# embedding optimizer in the store, and its torch.optim twin for --compare
OPTIMIZERS: dict[str, type] = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


@dataclass
class RunResult:
    losses: list[float]
    seconds: float
    eval_loss: float
    eval_accuracy: float
    stats: dict | None = None  # the store's counters after the last training step (before the held-out batches)
    held_out: list | None = None  # the held-out batches (dense, sparse, labels), for the serving step


HELD_OUT_BATCHES = 4


def _evaluate(model: nn.Module, batches: list) -> tuple[float, float]:
    """Mean loss and accuracy of a forward over held-out batches: nothing is updated."""
    loss_fn = nn.BCEWithLogitsLoss()
    model.eval()
    with torch.no_grad():
        ev_loss, ev_acc = [], []
        for dense, sparse, labels in batches:
            logits = model(dense, sparse)
            ev_loss.append(loss_fn(logits, labels).item())
            ev_acc.append(((logits > 0).float() == labels).float().mean().item())
    model.train()
    return float(np.mean(ev_loss)), float(np.mean(ev_acc))


def _prepare_dir(path: Path) -> None:
    if path.exists():
        if (path / MARKER).exists():
            shutil.rmtree(path)  # a previous demo run: start afresh
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        else:
            raise PathExistsError(f"{path} exists and was not made by tierstore demo; pass --dir with a new directory")
    try:
        path.mkdir(parents=True)
    except OSError as e:  # before any work: the demo needs a directory it can write
        raise SettingError(f"--dir {path}: cannot make a directory there ({e.strerror.lower()}); "
                         "pass --dir with a path in a directory you can write to") from None


class _NoBar:
    n = 0

    def set_postfix(self, postfix: dict, refresh: bool = False) -> None:
        pass

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):
    """tqdm on a terminal, a line every few seconds otherwise (both on stderr), or nothing."""
    if not enabled:
        return _NoBar()
    if not sys.stderr.isatty():
        return LineBar(total, desc, "step", PROGRESS_SECONDS, show_first=True)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)


def _served(stats: dict) -> np.ndarray:
    """Lookups served by HBM, DDR and below (LMDB, or its write-back queue), cumulative.
    Every lookup reaches the first tier the store has (HBM, else DDR): that tier counts them all."""
    h, d = stats["hbm"], stats["ddr"]
    lookups = (h["hits"] + h["misses"]) or (d["hits"] + d["misses"])
    return np.array([h["hits"], d["hits"], lookups - h["hits"] - d["hits"]], dtype=np.float64)


def _shares(served: np.ndarray) -> str:
    total = served.sum()
    if not total:
        return "-"
    return " ".join(f"{name} {100 * v / total:.0f}%" for name, v in zip(("hbm", "ddr", "lmdb"), served))


def _train(cfg: DemoConfig, model: DLRM, emb_opt, data: ClickData, generator: torch.Generator, clock, label: str,
           stats: Callable[[], dict] | None) -> RunResult:
    dense_opt = torch.optim.Adagrad([*model.bottom.parameters(), *model.top.parameters()], lr=cfg.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    losses = []
    bar = _progress(cfg.steps, label, cfg.progress)
    shares = stats if cfg.hbm_rows or cfg.ddr_rows else None  # no tier: nothing counts the lookups
    last = _served(shares()) if shares else None
    start = clock()
    for step in range(cfg.steps):
        dense, sparse, labels = data.batch(generator)
        loss = loss_fn(model(dense, sparse), labels)
        dense_opt.zero_grad(set_to_none=True)
        if emb_opt is not None:
            emb_opt.zero_grad(set_to_none=True)
        loss.backward()  # TieredEmbeddingBag rows are updated here, by the fused optimizer
        dense_opt.step()
        if emb_opt is not None:
            # torch.optim builds sparse tensors from nn.EmbeddingBag's gradients, valid by
            # construction: opt out of checking them explicitly (torch warns when nobody chose)
            with torch.sparse.check_sparse_tensor_invariants(enable=False):
                emb_opt.step()
        losses.append(loss.item())
        if cfg.progress and (step % 10 == 9 or step == cfg.steps - 1):
            post = {"loss": f"{np.mean(losses[-LOSS_WINDOW:]):.4f}"}
            if shares:
                now = _served(shares())
                post["served"] = _shares(now - last)
                last = now
            bar.set_postfix(post, refresh=False)
            bar.update(step + 1 - bar.n)
    seconds = clock() - start
    bar.close()
    trained = stats() if stats else None
    held_out = [data.batch(generator) for _ in range(HELD_OUT_BATCHES)]
    return RunResult(losses, seconds, *_evaluate(model, held_out), trained, held_out)


@dataclass
class StoreFigures:
    """What the summary reports of the store after training."""

    stats: dict  # store.stats()
    resident: dict[str, dict[str, int]]  # table -> {"hbm": rows, "ddr": rows}
    row_bytes: int  # a stored row: weights and optimizer state
    width: int  # floats a row holds (weights and optimizer state)
    lmdb_mib: float
    store_dir: Path
    checkpoint: Path


def loss_window(n: int) -> int:
    """Steps averaged at each end of a run of n: at most LOSS_WINDOW, and the first and
    last windows never share a step (one step: that step)."""
    return max(1, min(LOSS_WINDOW, n // 2))


def _steps(n: int) -> str:
    return "step" if n == 1 else f"{n} steps"


def _times_smaller(table_rows: int, tier_rows: int) -> str:
    if tier_rows >= table_rows:
        return "holds the whole table"
    r = table_rows / tier_rows
    return f"{r:,.0f}x smaller than the table" if r >= 10 else f"{r:.1f}x smaller than the table"


def _tiers(cfg: DemoConfig) -> str:
    if not cfg.hbm_rows and not cfg.ddr_rows:
        return "no HBM or DDR tier (--hbm-rows 0 --ddr-rows 0): every lookup reads LMDB"
    hbm = f"HBM {cfg.hbm_rows:,} rows" if cfg.hbm_rows else "no HBM tier"
    ddr = f"DDR {cfg.ddr_rows:,} rows ({_times_smaller(cfg.rows, cfg.ddr_rows)})" if cfg.ddr_rows else "no DDR tier"
    return f"{hbm}, {ddr}, policy {cfg.policy}"


def summary_lines(cfg: DemoConfig, run: RunResult, store: StoreFigures) -> list[str]:
    """The summary of the tiered run, a line per topic."""
    n, stats = len(run.losses), store.stats
    if n == 1:
        loss = f"loss {run.losses[0]:.4f} (one step)"
    else:
        w = loss_window(n)
        loss = f"first {_steps(w)} {np.mean(run.losses[:w]):.4f} -> last {_steps(w)} {np.mean(run.losses[-w:]):.4f}"
    served = _served(stats)
    served_by = f"{_shares(served)} of {int(served.sum()):,} row lookups"
    if not cfg.hbm_rows and not cfg.ddr_rows:  # the tiers count lookups; LMDB's write-back queue serves some uncounted
        served_by = "every row lookup by LMDB or its write-back queue (no HBM or DDR tier)"
    elif cfg.ddr_rows:
        d = stats["ddr"]
        on = "on HBM misses " if cfg.hbm_rows else ""
        served_by += f"; DDR hit rate {on}{100 * d['hits'] / max(d['hits'] + d['misses'], 1):.0f}%"
    where = "in every tier and in LMDB" if cfg.hbm_rows or cfg.ddr_rows else "in LMDB"
    half = f" (with float32 weights: {4 * store.width})" if cfg.dtype != "float32" else ""
    ssd = stats["ssd"]
    resident = store.resident.values()
    return [
        f"tierstore demo: {cfg.steps} steps of {cfg.batch} examples in {run.seconds:.1f} s "
        f"({cfg.steps / run.seconds:.1f} steps/s)",
        f"  model      DLRM: bottom MLP 13-64-{cfg.dim}, {cfg.tables} tables, dot interaction, top MLP; "
        f"{cfg.optimizer} (fused into backward for the tables), lr {cfg.lr}",
        f"  tables     {cfg.tables} x {cfg.rows:,} rows x {cfg.dim} dims, Zipf alpha {cfg.alpha}; per table {_tiers(cfg)}",
        f"  rows       weights {cfg.dtype}, optimizer state float32: {store.row_bytes} bytes a row {where}{half}; "
        f"LMDB file {store.lmdb_mib:.1f} MiB",
        f"  loss       {loss}; held-out {run.eval_loss:.4f}, accuracy {100 * run.eval_accuracy:.1f}%",
        f"  served     {served_by}",
        f"  lmdb       {ssd['reads']:,} rows looked up ({ssd['initial']:,} of them not on disk yet: their initial values), "
        f"{ssd['writes']:,} rows written; resident now {sum(r['hbm'] for r in resident):,} HBM + "
        f"{sum(r['ddr'] for r in resident):,} DDR rows",
        f"  store      {store.store_dir} (reopen: tierstore.TieredStore({str(store.store_dir)!r})); checkpoint {store.checkpoint}",
    ]


def trace_line(path: Path) -> str:
    from tierstore.trace import Trace

    trace = Trace.load(path)
    return (f"  trace      {path}: {trace.n_accesses:,} ids looked up in {trace.n_steps:,} steps (training, then the held-out "
            f"batches; an id repeated in a batch counts each time); size the tiers from it: tierstore capacity {path} "
            "--hbm-hit 0.5 --hit 0.8")


@dataclass
class Served:
    """The held-out batches served from serving stores exported after training, one per dtype."""

    results: dict[str, tuple[float, float]]  # dtype -> (held-out loss, accuracy)
    row_bytes: dict[str, int]  # dtype -> bytes of the rows stored (no optimizer state; initial rows left out)
    rows: int  # rows stored (the same for every dtype)
    seconds: float  # export of every dtype, and serving
    paths: dict[str, Path]

    def faithful(self, trained: RunResult) -> bool:
        """float32 serving pools the trained rows: its held-out loss is the trained model's."""
        return math.isclose(self.results["float32"][0], trained.eval_loss, rel_tol=SERVE_RTOL)

    def lines(self, trained: RunResult) -> list[str]:
        (q_loss, q_acc), (f_loss, f_acc) = self.results["int8"], self.results["float32"]
        check = "equals" if self.faithful(trained) else "DIFFERS FROM"
        return [
            f"  serving    int8 rows (row-wise scale and bias): held-out loss {q_loss:.4f}, accuracy {100 * q_acc:.1f}% against "
            f"float32 serving {f_loss:.4f}, {100 * f_acc:.1f}% ({check} training's held-out); {self.rows:,} rows stored in "
            f"{format_bytes(self.row_bytes['int8'])} int8 vs {format_bytes(self.row_bytes['float32'])} float32",
            f"             exported and served in {self.seconds:.1f} s: {self.paths['int8']} "
            "(tierstore.ServingEmbeddingBagCollection(path) opens it; --no-serve skips this step)",
        ]


SERVE_RTOL = 1e-5  # float32 serving against training's forward: the same rows, pooled in another order
SERVE_DTYPES = ("float32", "int8")


def serve(cfg: DemoConfig, store_dir: Path, model: "DLRM", held_out: list, clock: Callable[[], float]) -> Served:
    """Export the trained store per dtype of SERVE_DTYPES and serve the held-out batches through
    tierstore.serving.store, the dense layers as trained."""
    from tierstore.serving.store import ServingEmbeddingBagCollection
    from tierstore.serving.export import export

    start = clock()
    results, row_bytes, paths, rows = {}, {}, {}, 0
    trained = model.embeddings
    try:
        for dtype in SERVE_DTYPES:
            paths[dtype] = export(store_dir, cfg.dir / f"serving-{dtype}", dtype=dtype)
            serving = ServingEmbeddingBagCollection(paths[dtype], hbm_rows=cfg.hbm_rows, ddr_rows=cfg.ddr_rows, device="cpu")
            try:
                model.embeddings = serving
                results[dtype] = _evaluate(model, held_out)
                tables = serving.store.meta["tables"]
            finally:
                serving.close()
            rows = sum(t["rows"] for t in tables)
            row_bytes[dtype] = sum(t["rows"] * t["row_bytes"] for t in tables)
    finally:
        model.embeddings = trained
    return Served(results, row_bytes, rows, clock() - start, paths)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _specs(cfg: DemoConfig):
    import tierstore

    init = tierstore.RowInit.uniform(-0.05, 0.05, seed=cfg.seed)
    return [tierstore.TableSpec(n, cfg.rows, cfg.dim, dtype=cfg.dtype, init=init) for n in cfg.table_names]


def _start(cfg: DemoConfig) -> None:
    torch.set_num_threads(cfg.threads)
    t = cfg.record_trace
    replaced = (cfg.dir / MARKER).exists() and cfg.dir.resolve() in t.resolve().parents if t is not None else False
    if t is not None and t.exists() and (not t.is_dir() or any(t.iterdir())) and not replaced:
        raise SettingError(f"--record-trace {t} exists and is not an empty directory; pass a new directory for the trace")
    _prepare_dir(cfg.dir)
    (cfg.dir / MARKER).write_text(json.dumps({k: str(v) for k, v in dataclasses.asdict(cfg).items()}, indent=1))


def _one_process(cfg: DemoConfig, path: Path, seed_generator: Callable[[int], torch.Generator]):
    """The tiered model in this process, its data, and the data's starting state (every run sees the same batches)."""
    import tierstore

    g = seed_generator(cfg.seed)
    data = ClickData(cfg, g)
    ebc = tierstore.TieredEmbeddingBagCollection(tables=_specs(cfg), path=path, hbm_rows=cfg.hbm_rows, ddr_rows=cfg.ddr_rows,
                                                 policy=cfg.policy, device="cpu", optimizer=_tierstore_opt(cfg.optimizer, cfg.lr),
                                                 record_trace=cfg.record_trace)
    return ebc, DLRM(ebc, cfg.table_names, cfg.dim, seed_generator(cfg.seed + 1)), data, g


def run_demo(cfg: DemoConfig, seed_generator: Callable[[int], torch.Generator] = seeded,
             clock: Callable[[], float] = time.perf_counter, out=sys.stdout) -> int:
    """Train the tiered model (and with cfg.compare the in-memory one); print a summary. 0 = success.
    With cfg.world_size > 1: sharded over local processes, checked against one process."""
    from tierstore.spec import initial_rows

    if cfg.world_size > 1:
        from tierstore.tools.demo_sharded import run_sharded_demo

        return run_sharded_demo(cfg, seed_generator, clock, out)
    _start(cfg)
    store_dir = cfg.dir / "store"
    specs = _specs(cfg)
    ebc, model, data, g = _one_process(cfg, store_dir, seed_generator)
    data_state = g.get_state()
    twin = copy.deepcopy((model.bottom, model.top)) if cfg.compare else None
    tiered = _train(cfg, model, None, data, g, clock, "tierstore", ebc.store.stats)
    store = ebc.store
    stats, resident = store.stats(), {n: store.resident_rows(n) for n in cfg.table_names}
    stored = store.tables[cfg.table_names[0]]  # with the optimizer's state_dim
    ckpt = store.checkpoint(cfg.dir / "checkpoint")
    ebc.close()
    figures = StoreFigures(stats, resident, stored.row_bytes, stored.width, (store_dir / "data.mdb").stat().st_size / 2**20,
                           store_dir, ckpt)

    w = loss_window(len(tiered.losses))
    lines = summary_lines(cfg, tiered, figures)
    status = 0
    if cfg.record_trace is not None:
        lines.append(trace_line(cfg.record_trace))
    if cfg.serve:
        served = serve(cfg, store_dir, model, tiered.held_out, clock)
        lines += served.lines(tiered)
        status = 0 if served.faithful(tiered) else 1
    if cfg.compare:
        initial = {s.name: torch.from_numpy(initial_rows(s, np.arange(cfg.rows))) for s in specs}
        bags = InMemoryBags(initial)
        twin_model = DLRM(bags, cfg.table_names, cfg.dim, seed_generator(cfg.seed + 1))
        twin_model.bottom, twin_model.top = twin
        emb_opt = OPTIMIZERS[cfg.optimizer](bags.parameters(), lr=cfg.lr)
        g.set_state(data_state)
        mem = _train(cfg, twin_model, emb_opt, data, g, clock, "in memory", None)
        a, b = np.mean(tiered.losses[-w:]), np.mean(mem.losses[-w:])
        worst = float(np.max(np.abs(np.array(tiered.losses) - np.array(mem.losses))))
        same = tiered.losses == mem.losses
        rtol = AGREE_RTOL if cfg.dtype == "float32" else HALF_AGREE_RTOL
        agree = abs(a - b) <= rtol * abs(b) and abs(tiered.eval_loss - mem.eval_loss) <= rtol * abs(mem.eval_loss)
        status = 0 if agree else 1
        lines += [
            f"  compare    nn.EmbeddingBag in memory (float32): last {_steps(w)} loss {b:.4f} vs tierstore {a:.4f}; held-out "
            f"{mem.eval_loss:.4f} vs {tiered.eval_loss:.4f}, accuracy {100 * mem.eval_accuracy:.1f}% vs {100 * tiered.eval_accuracy:.1f}%; "
            + ("bit-identical loss at every step" if same else f"largest per-step loss difference {worst:.1e}")
            + (" -> AGREE" if agree else f" -> DISAGREE (beyond rtol {rtol})"),
            f"  speed      in memory {cfg.steps / mem.seconds:.1f} steps/s, tierstore {cfg.steps / tiered.seconds:.1f} steps/s "
            f"({mem.seconds / tiered.seconds:.2f}x of in-memory speed, with rows moving through HBM, DDR and LMDB)",
        ]
    print("\n".join(lines), file=out)
    return status


def register(sub) -> None:
    d = DemoConfig()
    p = add_verb(sub, "demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=d.dir, help="directory for the store (DIR/store) and checkpoint (DIR/checkpoint); "
                   "replaced on a rerun")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--batch", type=int, default=d.batch, help="examples per step")
    p.add_argument("--tables", type=int, default=d.tables, help="embedding tables")
    p.add_argument("--rows", type=int, default=d.rows, help="rows per table")
    p.add_argument("--dim", type=int, default=d.dim, help="embedding dim (also the bottom MLP's output)")
    p.add_argument("--pooling", type=int, default=d.pooling, help="mean ids per bag (bags hold 1 to 2 x pooling - 1)")
    p.add_argument("--hbm-rows", type=int, default=d.hbm_rows, help="HBM tier rows per table")
    p.add_argument("--ddr-rows", type=int, default=d.ddr_rows, help="DDR tier rows per table")
    p.add_argument("--policy", default=d.policy, help="eviction policy of both tiers")  # choices: set by cli.build_parser
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=d.optimizer, help="optimizer of the tables and the MLPs")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    p.add_argument("--alpha", type=float, default=d.alpha, help="Zipf exponent of the ids")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the data and the initial weights")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype,
                   help="the tables' weights: float16/bfloat16 halve their bytes (stochastic rounding; --compare then allows "
                        f"rtol {HALF_AGREE_RTOL} against float32 in memory)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads")
    p.add_argument("--compare", action="store_true", help="also train with nn.EmbeddingBag in memory and compare")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--record-trace", type=Path, default=None, metavar="PATH",
                   help="record the store's lookups (training and held-out) as a trace in PATH, a new directory, "
                        "for `tierstore capacity PATH`")
    p.add_argument("--no-serve", dest="serve", action="store_false",
                   help="skip the serving step (export the trained tables to int8 and float32 serving stores and "
                        "serve the held-out batches from both: 7-11 s after the default run on a busy 2-core machine)")
    p.add_argument("--world-size", type=int, default=d.world_size,
                   help="shard the tables over this many local processes (gloo on 127.0.0.1, plan from tierstore.capacity.planner) "
                        "and check every loss and trained row against one process")
    p.set_defaults(func=main, kept=_kept)


def _kept(args: argparse.Namespace) -> str:
    # a run starts in an emptied directory and checkpoints (atomically) once training ends
    if (args.dir / "checkpoint").exists():
        return (f"training had finished: the store in {args.dir / 'store'} and its checkpoint are complete; "
                "what followed (the serving step, --compare) was cut short: --no-serve skips serving")
    # LMDB commits are atomic: the store opens as of its last commit; the demo flushes only at its end
    return (f"the store in {args.dir} is consistent but only partly trained (the demo flushes at its end); "
            "rerun `tierstore demo` to train afresh")


def main(args: argparse.Namespace) -> int:
    """Bad settings raise ValueError naming the option; tierstore.tools.cli prints it."""
    fields = {f.name for f in dataclasses.fields(DemoConfig)}
    return run_demo(DemoConfig(**{k: v for k, v in vars(args).items() if k in fields}))
