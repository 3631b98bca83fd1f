"""``tierstore bench peers``: tierstore's resident training step and lookup
against FBGEMM's fused table-batched embedding (fbgemm-gpu-cpu) on the same batches.

Every row the batches touch is resident on both sides: in tierstore's HBM tier
(on the CPU, a tier in host memory like any other), and with ``--tier ddr`` also
in a second store whose DDR tier holds the whole table (``hbm_rows=0``; FBGEMM's
``EmbeddingLocation.HOST``), timed in the same rounds. Each optimizer is timed
at torch's thread count and at 1 thread, the two sides interleaved round by
round so that both see the same machine load; figures are medians. Afterwards
the trained rows of both sides are compared. FBGEMM is optional: without it the
bench says how to install it and times tierstore alone.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings

import torch

from tierstore.tools.bench import DEFAULT_BATCH, interleaved_medians, report, shared

POOLING = 32
MIN_BATCHES = 64
WARMUP = 2  # untimed rounds before the timed ones (interleaved_medians')
ALPHA = 1.05
INSTALL = "pip install 'tierstore[fbgemm]'  (fbgemm-gpu-cpu==1.8.0, which goes with torch 2.13)"
# tierstore optimizer -> (FBGEMM OptimType name or None where FBGEMM's CPU build lacks it, kwargs for both)
OPTIMIZERS = {
    "SGD": ("EXACT_SGD", {"lr": 0.01}),
    "RowWiseAdagrad": ("EXACT_ROWWISE_ADAGRAD", {"lr": 0.01, "eps": 1e-8}),
    "Adagrad": ("EXACT_ADAGRAD", {"lr": 0.01, "eps": 1e-8}),
    "Adam": (None, {"lr": 0.001, "eps": 1e-8}),
}
# --tier: the tiers whose resident rows are timed, and how their sides are labelled
TIERS = {"hbm": ("hbm",), "ddr": ("hbm", "ddr")}
TIER_LABELS = {"hbm": "", "ddr": ", DDR-resident"}
TIER_NAMES = {"hbm": "HBM tier (hbm_rows=working set)", "ddr": "DDR tier (hbm_rows=0, ddr_rows=rows)"}


def fbgemm_module(rows: int, dim: int, optim_name: str, hyper: dict, device: torch.device, fp16: bool = False):
    """FBGEMM's SplitTableBatchedEmbeddingBagsCodegen holding one zeroed table (fp16
    weights with ``fp16``), or None if FBGEMM is absent."""
    try:
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, OptimType, SplitTableBatchedEmbeddingBagsCodegen)
    except ImportError:
        return None
    on_gpu = device.type == "cuda"
    location = EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST
    compute = ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU
    m = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, location, compute)], optimizer=getattr(OptimType, optim_name), pooling_mode=PoolingMode.SUM,
        learning_rate=hyper["lr"], eps=hyper.get("eps", 1e-8), device=device,
        weights_precision=SparseType.FP16 if fp16 else SparseType.FP32)
    with torch.no_grad():
        for w in m.split_embedding_weights():
            w.zero_()
    return m


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared(p, "rows", "dim", "batch", "repeat", "device", "dir", "seed",
           helps={"batch": f"ids per step, in bags of {POOLING} (default: {DEFAULT_BATCH}, FBGEMM's benchmark's "
                           f"{DEFAULT_BATCH // POOLING} bags)"})
    p.add_argument("--tier", choices=tuple(TIERS), default="hbm",
                   help="ddr also times every row resident in the DDR tier (hbm_rows=0), beside the HBM tier")


def run(args: argparse.Namespace) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)  # FBGEMM warns about CPU-only builds on import
        _run(args)


def _run(args: argparse.Namespace) -> None:
    import tierstore
    from tierstore.tools.demo import ZipfIds

    device = torch.device(args.device)
    rows, dim = args.rows, args.dim
    bags = max(1, args.batch // POOLING)
    gen = torch.Generator().manual_seed(args.seed)
    zipf = ZipfIds(rows, ALPHA, gen)
    threads = torch.get_num_threads()
    settings = [threads] + ([1] if threads > 1 and device.type == "cpu" else [])
    # each setting times a step and a lookup: a section of WARMUP + repeat calls each
    calls = WARMUP + args.repeat
    n_batches = max(MIN_BATCHES, 2 * len(settings) * calls)
    batches = [zipf.sample(bags * POOLING, gen) for _ in range(n_batches)]
    offsets = torch.arange(bags + 1) * POOLING
    grads = [torch.randn(bags, dim, generator=gen).to(device) for _ in range(n_batches)]
    working = torch.unique(torch.cat(batches))
    unique_per_batch = statistics.mean(len(torch.unique(b)) for b in batches)
    dev_batches, dev_offsets = [b.to(device) for b in batches], offsets.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    have_fbgemm = fbgemm_module(8, 8, "EXACT_SGD", {"lr": 0.01}, device) is not None
    lines, ratios = [], {}
    if not have_fbgemm:
        lines.append(("FBGEMM", f"not installed: timing tierstore alone. Install it with {INSTALL}"))

    tiers = TIERS[args.tier]
    for name, (fb_name, hyper) in OPTIMIZERS.items():
        with tempfile.TemporaryDirectory(prefix="tierstore-bench-peers-", dir=args.dir) as d:
            fb = fbgemm_module(rows, dim, fb_name, hyper, device) if fb_name and have_fbgemm else None
            # tierstore with its torch kernels, and with FBGEMM's fused backward on its rows where FBGEMM runs,
            # the rows in each tier asked for: {tier: {kernels: module}}
            embs = {tier: {} for tier in tiers}
            for tier in tiers:
                sizes = {"hbm_rows": len(working) + 1024} if tier == "hbm" else {"hbm_rows": 0, "ddr_rows": rows}
                for kernels in ("torch",) + (("fbgemm",) if fb is not None and device.type == "cpu" else ()):
                    embs[tier][kernels] = emb = tierstore.TieredEmbeddingBag(
                        rows, dim, mode="sum", path=f"{d}/{tier}-{kernels}", **sizes,
                        optimizer=getattr(tierstore.optim, name)(**hyper), init=tierstore.RowInit(), device=device, kernels=kernels)
                    _make_resident(emb, working)

            section = iter(range(10**9))  # the sides of a section start at its batch: none a side took before

            def step(module, fbgemm=False, start=0):
                return _turns(module, dev_batches, dev_offsets, sync, fbgemm, grads, start)

            def lookup(module, fbgemm=False, start=0):
                return _turns(module, dev_batches, dev_offsets, sync, fbgemm, start=start)

            try:
                for n_threads in settings:
                    torch.set_num_threads(n_threads)
                    tag = f"[{n_threads} thread{'s' if n_threads > 1 else ''}] {name}"
                    for kind, make in (("step", step), ("lookup", lookup)):
                        if kind == "lookup" and name != "SGD":  # the lookup depends on neither the optimizer nor the kernels
                            continue
                        # every tier's sides and FBGEMM in the same rounds: {(tier, side name): timed side}
                        start = next(section) * calls
                        sides = {(tier, f"tierstore ({k})" if kind == "step" else "tierstore"): make(e, start=start)
                                 for tier, by_kernels in embs.items() for k, e in by_kernels.items() if kind == "step" or k == "torch"}
                        times = interleaved_medians(list(sides.values()) + ([make(fb, True, start)] if fb else []), args.repeat, WARMUP)
                        fb_time = times[-1] if fb else None
                        for tier in embs:
                            ours = {side: t for (t_tier, side), t in zip(sides, times) if t_tier == tier}
                            if fb_time is None:
                                why = "" if fb_name or not have_fbgemm else " (FBGEMM's CPU build has no Adam)"
                                lines.append((f"{tag} {kind}{TIER_LABELS[tier]}", "   ".join(f"{side} {t * 1e3:7.2f} ms" for side, t in ours.items()) + why))
                                continue
                            for side, t in ours.items():
                                ratios[(name, n_threads, kind, side + TIER_LABELS[tier])] = t / fb_time
                            lines.append((f"{tag} {kind}{TIER_LABELS[tier]}", "   ".join(f"{side} {t * 1e3:7.2f} ms {t / fb_time:.2f}x" for side, t in ours.items())
                                          + f"   FBGEMM {fb_time * 1e3:7.2f} ms"))
            finally:
                torch.set_num_threads(threads)
            if fb is not None:  # every side trained on the same batches the same number of times
                theirs_rows = fb.split_embedding_weights()[0][working.to(device)].float().cpu()
                for tier, by_kernels in embs.items():
                    for kernels, emb in by_kernels.items():
                        diff = (emb.store.read(emb.table, working.to(device)).cpu() - theirs_rows).abs().max().item()
                        lines.append((f"{name} check ({kernels}){TIER_LABELS[tier]}", f"max |tierstore - FBGEMM| over trained rows "
                                                                                    f"{diff:.1e} (rows up to {theirs_rows.abs().max().item():.1e})"))
            for by_kernels in embs.values():
                for emb in by_kernels.values():
                    emb.close()
            del fb

    lines += _half_lookups(args, rows, dim, working, dev_batches, dev_offsets, device, sync, have_fbgemm)
    step = {side: max(r for (_, _, k, sd), r in ratios.items() if k == "step" and sd == side)
            for (_, _, k, side) in ratios if k == "step"}
    lookup = [r for (_, _, k, _), r in ratios.items() if k == "lookup"]
    params = {"rows": rows, "dim": dim, "bags": bags, "pooling": POOLING, "zipf alpha": ALPHA, "device": device,
              "batches (each timed call a fresh one)": n_batches, "unique ids/batch": f"{unique_per_batch:.0f}", "working set": len(working),
              "resident in": " and ".join(TIER_NAMES[t] for t in tiers)}
    if lookup:
        params["lookup x FBGEMM (goal <= 1.5)"] = ", ".join(f"{r:.2f}" for r in lookup)
    for side, worst in list(step.items())[:-1]:
        lines.append((f"worst training step, {side}", f"{worst:.2f}x FBGEMM"))
    last = list(step.items())[-1] if step else ("tierstore", float("nan"))
    report("peers: resident training step and lookup, tierstore / FBGEMM time (lower is better)", params, lines,
           f"worst training step, {last[0]} / FBGEMM time", last[1], "<= 1.20")


def _make_resident(emb, ids: torch.Tensor) -> None:
    for chunk in ids.split(1 << 18):
        emb.store.read(emb.table, chunk)


def _turns(module, batches, offsets, sync, fbgemm: bool = False, grads=None, start: int = 0):
    """A timed side: each call runs the module on the next batch in turn from ``start``
    (FBGEMM takes the bags' end offset too), a training step with ``grads``, else a lookup."""
    turn = iter(range(start, 10**9))

    def run():
        i = next(turn) % len(batches)
        with torch.set_grad_enabled(grads is not None):
            out = module(batches[i], offsets if fbgemm else offsets[:-1])
            if grads is not None:
                out.backward(grads[i])
        sync()
    return run


def _half_lookups(args, rows, dim, working, batches, offsets, device, sync, have_fbgemm) -> list[tuple[str, str]]:
    """The forward-only lookup of tables with float16 and bfloat16 weights against
    float32 (and FBGEMM's fp16 rows), every row resident, at torch's thread count."""
    import tierstore

    lines = []
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-peers-", dir=args.dir) as d:
        embs = {}
        for dtype in ("float32", "float16", "bfloat16"):
            embs[dtype] = tierstore.TieredEmbeddingBag(rows, dim, mode="sum", path=f"{d}/{dtype}", hbm_rows=len(working) + 1024,
                                                       init=tierstore.RowInit.normal(0, 0.01), device=device, dtype=dtype)
            _make_resident(embs[dtype], working)
        fb = fbgemm_module(rows, dim, "EXACT_SGD", {"lr": 0.01}, device, fp16=True) if have_fbgemm else None

        sides = [_turns(e, batches, offsets, sync) for e in embs.values()]
        sides += [_turns(fb, batches, offsets, sync, fbgemm=True)] if fb is not None else []
        times = dict(zip(list(embs) + ["FBGEMM fp16"], interleaved_medians(sides, args.repeat, WARMUP)))
        for dtype, emb in embs.items():
            spec = emb.store.tables[emb.table]
            vs = f"   {times[dtype] / times['FBGEMM fp16']:.2f}x FBGEMM fp16" if fb is not None else ""
            lines.append((f"lookup, {dtype} weights", f"tierstore {times[dtype] * 1e3:7.2f} ms   {times[dtype] / times['float32']:.2f}x "
                                                      f"float32{vs}   {spec.row_bytes} bytes a row"))
            emb.close()
        if fb is not None:
            lines.append(("lookup, FBGEMM fp16 weights", f"FBGEMM {times['FBGEMM fp16'] * 1e3:7.2f} ms   {2 * dim} bytes a row"))
    return lines
