"""``tierstore bench train``: one training step (forward, backward, fused update)
of TieredEmbeddingBag with its working rows resident, against
nn.EmbeddingBag(sparse=True) + torch.optim.SGD in memory on the same batches.

Both run interleaved, step by step, in one process, so both see the same
machine load; the figure is the ratio of their median step times. The same
comparison is printed for Adagrad (tierstore.optim.Adagrad against
torch.optim.Adagrad on sparse gradients). Afterwards the trained rows of both
sides are compared, so the bench also shows that they computed the same thing.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

from tierstore.tools.bench import report, shared
from tierstore.tools.cli import positive_int

POOLING = 32  # ids per bag, as in DLRM-style benchmarks
N_BATCHES = 8  # distinct batches cycled through; their union is the working set
ALPHA = 1.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "rows", "dim", "batch", "repeat", "device", "dir", "seed",
           helps={"batch": "ids per step", "device": "where both sides train (cuda: tierstore's HBM tier)"})
    p.add_argument("--pooling", type=positive_int, default=POOLING, help="ids per bag")


def run(args: argparse.Namespace) -> None:
    with warnings.catch_warnings():
        # torch.optim.Adagrad builds sparse tensors internally and warns about it once per process
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        _run(args)


def _run(args: argparse.Namespace) -> None:
    import tierstore
    from tierstore.tools.demo import ZipfIds

    rows, dim, pooling, device = args.rows, args.dim, args.pooling, torch.device(args.device)
    bags = max(1, args.batch // pooling)
    gen = torch.Generator().manual_seed(args.seed)
    zipf = ZipfIds(rows, ALPHA, gen)
    batches = [zipf.sample(bags * pooling, gen) for _ in range(N_BATCHES)]
    working = torch.unique(torch.cat(batches))
    unique_per_batch = statistics.mean(len(torch.unique(b)) for b in batches)
    # on a GPU both sides train there: the in-memory table on it, tierstore's HBM tier holding the working rows
    offsets = (torch.arange(bags) * pooling).to(device)
    batches = [b.to(device) for b in batches]
    grads = [torch.randn(bags, dim, generator=gen).to(device) for _ in range(N_BATCHES)]  # d loss / d pooled, fixed per batch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    checks = []

    threads = torch.get_num_threads()
    settings = [threads] + ([1] if threads > 1 and device.type == "cpu" else [])  # intra-op threads; both sides always use the same
    results = []
    for name, ours, theirs, lr in (
        ("SGD", tierstore.optim.SGD, torch.optim.SGD, 0.01),
        ("Adagrad", tierstore.optim.Adagrad, torch.optim.Adagrad, 0.01),
    ):
        with tempfile.TemporaryDirectory(prefix="tierstore-bench-train-", dir=args.dir) as d:
            spec_init = tierstore.RowInit()  # zeros, so the in-memory table starts equal without copying it
            emb = tierstore.TieredEmbeddingBag(rows, dim, mode="sum", path=d, hbm_rows=len(working) + 1024,
                                               optimizer=ours(lr=lr), init=spec_init, device=device)
            for chunk in working.split(1 << 18):  # make the working rows resident
                emb.store.read(emb.table, chunk)
            base = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=device)
            torch.nn.init.zeros_(base.weight)
            base_opt = theirs(base.parameters(), lr=lr)
            misses0 = emb.store.stats()["hbm"]["misses"]

            def step_base(i):
                base_opt.zero_grad(set_to_none=True)
                base(batches[i], offsets).backward(grads[i])
                base_opt.step()

            def step_tiered(i):
                emb(batches[i], offsets).backward(grads[i])

            try:
                for n_threads in settings:
                    torch.set_num_threads(n_threads)
                    t_base, t_tier = [], []
                    warmup = 2
                    for r in range(warmup + args.repeat):  # interleaved: both sides see the same machine load
                        i = r % N_BATCHES
                        for fn, times in ((step_base, t_base), (step_tiered, t_tier)):
                            t0 = time.perf_counter()
                            fn(i)
                            sync()
                            times.append(time.perf_counter() - t0)
                    results.append((name, n_threads, statistics.median(t_base[warmup:]), statistics.median(t_tier[warmup:])))
            finally:
                torch.set_num_threads(threads)
            misses = emb.store.stats()["hbm"]["misses"] - misses0
            diff = (emb.store.read(emb.table, working).cpu() - base.weight.detach()[working.to(device)].cpu()).abs().max().item()
            checks.append(f"{name}: HBM misses while timed {misses}; max |tiered - in-memory| over trained rows {diff:.1e}")
            emb.close()
            del base, base_opt

    ids = bags * pooling
    lines = []
    for name, n_threads, tb, tt in results:
        lines += [
            (f"[{n_threads} thread{'s' if n_threads > 1 else ''}] nn.EmbeddingBag(sparse=True) + torch.optim.{name}",
             f"{tb * 1e3:8.2f} ms/step  {ids / tb / 1e6:6.2f} M ids/s"),
            (f"[{n_threads} thread{'s' if n_threads > 1 else ''}] TieredEmbeddingBag + tierstore.optim.{name}",
             f"{tt * 1e3:8.2f} ms/step  {ids / tt / 1e6:6.2f} M ids/s  ({tb / tt:.2f}x)"),
        ]
    lines += [("check", c) for c in checks]
    sgd = {n: tb / tt for name, n, tb, tt in results if name == "SGD"}
    report(
        "train: one step (forward, backward, fused update), working rows resident",
        {"rows": rows, "dim": dim, "bags": bags, "pooling": pooling, "zipf alpha": ALPHA, "device": device,
         "unique ids/batch": f"{unique_per_batch:.0f}", "working set": len(working),
         "ratios at 1 thread": ", ".join(f"{name} {tb / tt:.2f}x" for name, n, tb, tt in results if n == 1)},
        lines,
        f"TieredEmbeddingBag / nn.EmbeddingBag step throughput (SGD, {threads} thread{'s' if threads > 1 else ''})",
        sgd[threads], ">= 0.60",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierstore.tools.bench_train", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
