"""``tierstore trace ...`` (synth, convert, info, calibrate); it also registers ``tierstore capacity``
(tools/capacity_cli.py), which reads the traces made here."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from tierstore.tools import capacity_cli
from tierstore.engine.memory import format_bytes
from tierstore.tools.cli import add_verb, nonneg_float, nonneg_int, parse_size, positive_float, positive_int, size
from tierstore.errors import PathNotFoundError, SettingError

DEFAULT_STATS_DIR = Path("../shared/data/dlrm_datasets")
SYNTH_MAX_BYTES = "1GiB"  # a mistyped --steps or --batch-size must not fill a disk or the memory unasked


def register(sub) -> None:
    _register_trace(sub)
    capacity_cli.register(sub)


# -- tierstore trace ---------------------------------------------------------------------------------
def _register_trace(sub) -> None:
    p = add_verb(sub, "trace")
    verbs = p.add_subparsers(dest="trace_command", metavar="VERB")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    s = verbs.add_parser("synth", help="a synthetic trace: Zipf popularity per table, optionally drifting")
    s.add_argument("out", help="output: a directory, or a file ending in .npz")
    s.add_argument("--table", action="append", default=[], metavar="NAME:ROWS[:ALPHA[:POOLING]]",
                   help="a table (repeatable): NAME, ROWS rows, Zipf exponent ALPHA (default --alpha) and POOLING ids per "
                        "sample (default --pooling), e.g. user:1000000:1.1:8; without --table: --tables tables of --rows rows")
    s.add_argument("--tables", type=positive_int, default=1, help="number of tables t0.. when no --table is given")
    s.add_argument("--rows", type=positive_int, default=1_000_000, help="rows per table when no --table is given")
    s.add_argument("--alpha", type=positive_float, default=1.05, help="Zipf exponent of tables without their own")
    s.add_argument("--batch-size", type=positive_int, default=2048, help="samples per step")
    s.add_argument("--pooling", type=positive_float, default=16.0,
                   help="ids per sample per table, of tables without their own (a call reads batch-size x pooling ids)")
    s.add_argument("--steps", type=positive_int, default=100, help="training steps (one call per table each)")
    s.add_argument("--drift", type=nonneg_float, default=0.0, help="rows every popularity rank moves per step (temporal locality)")
    s.add_argument("--dim", type=positive_int, default=64, help="embedding dim recorded in the trace (for bandwidth)")
    s.add_argument("--seed", type=int, default=0, help="random seed")
    s.add_argument("--max-bytes", type=size("--max-bytes"), default=SYNTH_MAX_BYTES, metavar="SIZE",
                   help="refuse to write a trace larger than this (it is built in memory too), e.g. 4G "
                        f"(default {SYNTH_MAX_BYTES}; the size is printed before the trace is made)")
    s.set_defaults(func=_synth, kept=_unwritten)

    c = verbs.add_parser("convert", help="convert dlrm_datasets .pt files or a CSV (step,table,id) into a trace")
    c.add_argument("inputs", nargs="+", help="fbgemm_t*_bs*.pt files (one batch each) or one .csv file")
    c.add_argument("-o", "--out", required=True, help="output: a directory, or a file ending in .npz")
    c.add_argument("--from", dest="fmt", choices=("auto", "dlrm", "csv"), default="auto", help="input format (auto: by file name)")
    c.add_argument("--batch-size", type=positive_int, default=None, help="dlrm: split each file's batch into steps of this many samples")
    c.add_argument("--dim", type=positive_int, default=None, help="embedding dim to record (for bandwidth)")
    c.set_defaults(func=_convert, kept=_unwritten)

    i = verbs.add_parser("info", help="summary of a trace")
    i.add_argument("trace", help="a trace directory (the one holding trace.json) or .npz file")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=_info)

    k = verbs.add_parser("calibrate", help="fit synth's alpha and rows to dlrm_datasets per-batch reuse histograms")
    k.add_argument("stats", nargs="*", help=f"*_locality_stats.txt files (default: {DEFAULT_STATS_DIR}/*_locality_stats.txt)")
    k.add_argument("--section", type=nonneg_int, default=0, help="which report in each file (0: the first)")
    k.add_argument("--ids-per-table", type=positive_int, default=None, help="ids per table and batch (default: from the stats)")
    k.add_argument("--components", type=int, choices=(1, 2), default=2, help="fit one Zipf table, or also a mix of two")
    k.add_argument("--quick", action="store_true", help="a coarser grid")
    k.add_argument("--seed", type=int, default=0, help="random seed of the generated batches")
    k.add_argument("--json", action="store_true", help="print JSON")
    k.set_defaults(func=_calibrate)


def _unwritten(args) -> str:
    return f"no trace was written to {args.out}, or only part of one; rerun to write it"


def _parse_tables(args):
    from tierstore.tools.synth import SynthTable

    if not args.table:
        return tuple(SynthTable(f"t{i}", args.rows) for i in range(args.tables))
    out = []
    for spec in args.table:
        parts = spec.split(":")
        if not 2 <= len(parts) <= 4:
            raise SettingError(f"--table {spec!r}: expected NAME:ROWS[:ALPHA[:POOLING]], e.g. user:1000000:1.1:8")
        try:
            out.append(SynthTable(parts[0], int(parts[1]), float(parts[2]) if len(parts) > 2 and parts[2] else None,
                                  float(parts[3]) if len(parts) > 3 and parts[3] else None))
        except ValueError:
            raise SettingError(f"--table {spec!r}: ROWS must be an int, ALPHA and POOLING numbers") from None
    return tuple(out)


def _synth(args) -> int:
    from tierstore.tools.synth import SynthConfig, synth, trace_size

    cfg = SynthConfig(_parse_tables(args), args.alpha, args.batch_size, args.pooling, args.steps, args.drift, args.dim, args.seed)
    # the size is known from the options alone: checked against the limit and the disk before any work
    (accesses, need), limit = trace_size(cfg), parse_size(args.max_bytes, "--max-bytes")
    what = f"{accesses:,} accesses in {len(cfg.tables) * cfg.steps:,} calls, {format_bytes(need)}"
    if need > limit:
        raise SettingError(f"this trace would be {what}, over --max-bytes {args.max_bytes}; pass --max-bytes "
                         f"{_round_up_gib(need)} to write it, or lower --steps, --batch-size or the pooling")
    free = shutil.disk_usage(_existing_parent(Path(args.out))).free
    if need > free:
        raise SettingError(f"this trace would be {what}, but {_existing_parent(Path(args.out))} has {format_bytes(free)} free; "
                         "write it to another disk, or lower --steps, --batch-size or the pooling")
    print(f"writing {args.out}: {what} (held in memory while it is made)", flush=True)
    trace = synth(cfg)
    path = trace.save(args.out)
    print(f"wrote {path}: {trace.n_accesses:,} accesses, {trace.n_calls:,} calls, {trace.n_steps:,} steps, {len(trace.tables)} tables")
    return 0


def _round_up_gib(n: int) -> str:
    return f"{-(-n // (1 << 30))}GiB"


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _convert(args) -> int:
    from tierstore.trace import from_csv, from_dlrm

    fmt = args.fmt
    if fmt == "auto":
        exts = {"csv" if str(f).endswith(".csv") else "dlrm" if re.search(r"\.pt(\.gz)?$", str(f)) else "?" for f in args.inputs}
        if len(exts) != 1 or "?" in exts:
            raise SettingError(f"cannot tell the input format of {args.inputs}; pass --from dlrm or --from csv")
        fmt = exts.pop()
    if fmt == "csv":
        if len(args.inputs) != 1:
            raise SettingError("--from csv takes one CSV file")
        trace = from_csv(args.inputs[0], dim=args.dim)
    else:
        trace = from_dlrm(args.inputs, batch_size=args.batch_size, dim=args.dim)
    path = trace.save(args.out)
    print(f"wrote {path}: {trace.n_accesses:,} accesses, {trace.n_calls:,} calls, {trace.n_steps:,} steps, {len(trace.tables)} tables")
    return 0


def _info(args) -> int:
    from tierstore.trace import Trace

    trace = Trace.load(args.trace)
    per = trace.accesses_per_table()
    calls = np.bincount(trace.call_table, minlength=len(trace.tables))
    info = {"accesses": trace.n_accesses, "calls": trace.n_calls, "steps": trace.n_steps, "complete": trace.complete,
            "tables": [{**t.to_json(), "accesses": int(a), "calls": int(c)} for t, a, c in zip(trace.tables, per, calls)]}
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{args.trace}: {trace.n_accesses:,} accesses, {trace.n_calls:,} calls, {trace.n_steps:,} steps"
          + ("" if trace.complete else " (incomplete: the recorder was not closed)"))
    for t in info["tables"]:
        print(f"  {t['name']}: {t['accesses']:,} accesses in {t['calls']:,} calls, num_rows={t['num_rows']}, row_bytes={t['row_bytes']}")
    return 0


def _calibrate(args) -> int:
    from tierstore.tools.synth import BUCKET_EDGES, calibrate, parse_locality_stats

    files = [Path(f) for f in args.stats] or sorted(DEFAULT_STATS_DIR.glob("*_locality_stats.txt"))
    if not files:
        raise PathNotFoundError(f"no locality stats given and none in {DEFAULT_STATS_DIR}; pass the *_locality_stats.txt files")
    results = []
    for f in files:
        sections = parse_locality_stats(f)
        if not 0 <= args.section < len(sections):
            raise SettingError(f"{f} has {len(sections)} reports; --section must be in 0..{len(sections) - 1}")
        target = sections[args.section]
        for k in sorted({1, args.components}):
            results.append((f, calibrate(target, k, ids_per_table=args.ids_per_table, seed=args.seed, quick=args.quick)))
    if args.json:
        print(json.dumps([{"file": str(f), "section": c.target.name, **c.as_dict()} for f, c in results], indent=1))
        return 0
    labels = [f"({a},{b}]" for a, b in zip(BUCKET_EDGES[:-1], BUCKET_EDGES[1:])] + [f"{BUCKET_EDGES[-1]}+"]
    for f, c in results:
        kind = "one Zipf table" if len(c.classes) == 1 else "two Zipf tables"
        desc = ", ".join(f"{n:,} rows alpha {a:g} ({w:.0%} of ids)" for n, a, w in c.classes)
        print(f"{f.name} [{c.target.name}], {kind}: {desc}; {c.ids_per_table:,} ids per table and batch")
        print(f"  total variation distance of a generated batch: distinct-rows histogram {c.rows_tv:.3f}, "
              f"ids histogram {c.index_tv:.3f}; ids per distinct row {c.mean_reuse:.1f} (target {c.target.indices / c.target.unique:.1f})")
        print(f"  {'accesses':>14}  {'rows: target':>12}  {'synthetic':>9}  {'ids: target':>11}  {'synthetic':>9}")
        for i, lab in enumerate(labels):
            print(f"  {lab:>14}  {c.target.rows_hist[i]:12.3f}  {c.synthetic_rows_hist[i]:9.3f}  "
                  f"{c.target.index_hist[i]:11.3f}  {c.synthetic_index_hist[i]:9.3f}")
        print(f"  reproduce: tierstore trace synth OUT {c.synth_args()}")
    return 0

