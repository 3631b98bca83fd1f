"""``tierstore capacity``: the command line of the capacity analysis
(tools/capacity_analysis.py).

Every option is checked before the trace is loaded (a long analysis must not be
lost to a typo or a missing extra), and the report is printed before the plots,
the one step that can still fail after it."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from tierstore.tools.cli import add_verb, parse_size, positive_float, positive_int, ratio, size
from tierstore.errors import SettingError


def register(sub) -> None:
    p = add_verb(sub, "capacity", description="Exact LRU miss-ratio curves (stack distances under the store's batch semantics), SHARDS for long "
                    "traces, LFU/lookahead simulated and Belady's bound at chosen sizes, and the HBM/DDR rows per table "
                    "that reach target hit rates or best split a byte budget, with the SSD read rate they leave.",
    )
    p.add_argument("trace", help="a trace directory or .npz (tierstore trace synth/convert, or TieredStore(record_trace=))")
    p.add_argument("--tables", default=None, help="comma-separated tables to analyse (default: all)")
    p.add_argument("--shards", type=ratio, default=None, metavar="RATE", help="approximate the curves by SHARDS at this sampling rate (e.g. 0.01)")
    p.add_argument("--compare", action="store_true", help="with --shards: compute the exact curves too and report SHARDS's measured error")
    p.add_argument("--hbm-hit", type=ratio, default=None, help="target HBM hit ratio per table (recommend HBM rows)")
    p.add_argument("--hit", type=ratio, default=None, help="target cache (HBM + DDR) hit ratio per table (recommend DDR rows)")
    p.add_argument("--hbm-bytes", type=size("--hbm-bytes"), default=None, help="HBM budget to split across tables, e.g. 16G or 16GiB")
    p.add_argument("--ddr-bytes", type=size("--ddr-bytes"), default=None, help="DDR budget to split across tables, e.g. 256G")
    p.add_argument("--memory-budget", type=size("--memory-budget"), default=None, metavar="SIZE",
                   help="a store's memory_budget=, e.g. 512MiB: the split it gets (tiers, staging, queue, row index, "
                        "page cache) and the hits its tiers then get, as TieredStore(memory_budget=) sizes them")
    p.add_argument("--sizes", action="append", default=[], metavar="HBM:DDR",
                   help="simulate at these tier sizes per table, rows or %% of the working set, e.g. 10000:100000 or 1%%:10%% (repeatable; default: the recommendation, else 1%%:10%%)")
    p.add_argument("--policies", default="lfu", help="policies to replay at those sizes: the eviction policies (lfu, lru, ...) or lookahead (LRU is always read off the curve; "
                   "replaying it cross-checks); default lfu, '' for none")
    p.add_argument("--window", type=positive_int, default=16, help="lookahead window in batches")
    p.add_argument("--no-belady", action="store_true", help="skip Belady's bound")
    p.add_argument("--steps-per-s", type=positive_float, default=1.0, help="training steps per second, for SSD rates")
    p.add_argument("--row-bytes", type=positive_int, default=None, help="bytes per row on SSD (default: from the trace, else 512)")
    p.add_argument("--admit-after", type=positive_int, default=None, metavar="N",
                   help="predict TableSpec(admit_after=N): uses kept and dropped, rows that get storage (the store's own sketch)")
    p.add_argument("--admit-width", type=positive_int, default=1 << 20, help="with --admit-after: sketch counters per row (a power of two)")
    p.add_argument("--admit-depth", type=positive_int, default=4, help="with --admit-after: sketch rows")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots there (needs pip install 'tierstore[plot]')")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress on stderr: bars on a terminal, a line every few seconds otherwise (default: on for traces over 2M accesses)")
    p.add_argument("--seed", type=int, default=0, help="SHARDS hash seed")
    p.set_defaults(func=_capacity, kept="the analysis did not finish; the trace is unchanged")


def _config(args):
    """The analysis the options ask for (progress decided once the trace is loaded)."""
    from tierstore.tools.capacity import CapacityConfig

    sizes = []
    for s in args.sizes:
        parts = s.split(":")
        if len(parts) != 2:
            raise SettingError(f"--sizes {s!r}: expected HBM:DDR, e.g. 10000:100000 or 1%:10%")
        sizes.append((parts[0], parts[1]))
    if args.compare and args.shards is None:
        raise SettingError("--compare compares SHARDS with the exact curve; pass --shards RATE too")
    return CapacityConfig(
        tables=tuple(t.strip() for t in args.tables.split(",")) if args.tables else None,
        shards_rate=args.shards, compare_exact=args.compare, sizes=tuple(sizes),
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()), window=args.window,
        belady=not args.no_belady, hbm_target=args.hbm_hit, hit_target=args.hit,
        hbm_bytes=parse_size(args.hbm_bytes, "--hbm-bytes"), ddr_bytes=parse_size(args.ddr_bytes, "--ddr-bytes"),
        memory_budget=parse_size(args.memory_budget, "--memory-budget"),
        steps_per_s=args.steps_per_s, row_bytes=args.row_bytes, seed=args.seed,
        iec=any("i" in str(b).lower() for b in (args.hbm_bytes, args.ddr_bytes, args.memory_budget) if b),
        admit_after=args.admit_after, admit_width=args.admit_width, admit_depth=args.admit_depth,
    )


def passes(cfg, n_tables: int) -> dict[str, int]:
    """The passes over a trace that capacity.analyze makes for ``cfg``, by kind, each with
    its own progress line; Belady's are skipped at a size of 0 rows."""
    sizes = n_tables * max(len(cfg.sizes), 1)
    exact = cfg.shards_rate is None or cfg.compare_exact
    out = {"deduplicating ids": int(exact or bool(cfg.policies) or cfg.belady),  # the uses every exact pass reads
           "exact LRU curves": int(exact),
           "SHARDS (sampling, then the sample's curves)": 2 * int(cfg.shards_rate is not None)}
    out.update({f"{p} replays": sizes for p in cfg.policies})
    out["Belady bounds"] = 2 * sizes if cfg.belady else 0
    return {k: v for k, v in out.items() if v}


def plan_line(trace, cfg) -> str:
    n_tables = len(cfg.tables or trace.table_names)
    kinds = passes(cfg, n_tables)
    n = sum(kinds.values())
    return (f"capacity: {trace.n_accesses:,} accesses in {n_tables} tables: up to {n} pass{'es' * (n != 1)} "
            f"({', '.join(f'{k} {v}' for k, v in kinds.items())}), each shown with its time left")


def _capacity(args) -> int:
    # the analysis, report and plots through tierstore.tools.capacity, the public module a
    # Python caller uses: the command is that API plus its checks and its order
    from tierstore.tools import capacity, capacity_plots, capacity_progress
    from tierstore.trace import Trace

    cfg = _config(args)
    plot_dir = None
    if args.plot:  # the path the user typed, then the extra it needs: both before any work
        plot_dir = capacity_plots.check_plot_dir(args.plot)
        capacity_plots.pyplot()
    trace = Trace.load(args.trace)
    # a long run shows progress: tqdm on a terminal, a line every few seconds in a log
    show = args.progress if args.progress is not None else trace.n_accesses > capacity_progress.PROGRESS_ACCESSES
    cfg = dataclasses.replace(cfg, progress=capacity_progress.bars if show else False)
    if show:  # before the work: how much of it there is, so the progress lines can be read against it
        sys.stderr.write(plan_line(trace, cfg) + "\n")
        sys.stderr.flush()
    report = capacity.analyze(trace, cfg)
    if plot_dir is not None:
        report["plots"] = [str(plot_dir / f) for f in capacity_plots.PLOT_FILES]
    # the report first: writing the plots is the one step left that can fail (a full disk)
    print(capacity.to_json(report) if args.json else capacity.format_report(report), flush=True)
    if plot_dir is not None:
        capacity.plot_report(report, plot_dir)
        if not args.json:
            print(f"plots: {', '.join(report['plots'])}")
    return 0
