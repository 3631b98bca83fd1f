"""``tierstore plan TRACE --world-size N``: a sharding plan from a trace (tierstore.capacity.planner)."""
from __future__ import annotations

import sys

from tierstore.tools.cli import add_verb, parse_size, positive_int, size
from tierstore.errors import SettingError

OPTIMIZERS = ("none", "sgd", "adagrad", "rowwise_adagrad", "adam")
# The planner matches a split table's trace ids to each rank in turn: about world size x
# accesses id checks, some 3e7 a second on one core. Above this many, say so before it starts.
SLOW_CHECKS = 3e8


def register(sub) -> None:
    p = add_verb(sub, "plan", description="Split the trace's tables across --world-size ranks (whole tables, row ranges or hash, column ranges) so "
                    "that every rank gets a like share of lookups per step, SSD reads per step (LRU, at the tier sizes each "
                    "rank's --hbm-bytes/--ddr-bytes give its shards) and bytes of rows; print the plan and the prediction per "
                    "rank. ShardedEmbeddingBagCollection(plan=ShardingPlan.from_json(...)) reads the --json output.")
    p.add_argument("trace", help="a trace directory or .npz (tierstore trace synth/convert, or TieredStore(record_trace=))")
    p.add_argument("--world-size", type=positive_int, required=True, help="number of ranks")
    p.add_argument("--hbm-bytes", type=size("--hbm-bytes"), default=None, help="HBM budget of each rank, e.g. 16G or 16GiB")
    p.add_argument("--ddr-bytes", type=size("--ddr-bytes"), default=None, help="DDR budget of each rank, e.g. 256G")
    p.add_argument("--sharding", action="append", default=[], metavar="TABLE=TYPE",
                   help="force a table's sharding: table, row or column (repeatable)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="none",
                   help="count this optimizer's state in each row's bytes (default: the trace's row_bytes)")
    p.add_argument("--dim", type=positive_int, default=None, help="embedding dim of tables whose trace does not record it")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (ShardingPlan.from_json reads it)")
    p.set_defaults(func=_plan, kept="no plan was printed; nothing was written")


def _tables(trace, dim: int | None):
    from tierstore import TableSpec

    out = []
    for t in trace.tables:  # a loop per table
        d = t.dim or dim or (t.row_bytes // 4 if t.row_bytes else None)
        if d is None:
            raise SettingError(f"the trace does not record table {t.name!r}'s dim or row bytes; pass --dim")
        state = max(t.row_bytes // 4 - d, 0) if t.row_bytes else 0
        out.append(TableSpec(t.name, t.num_rows, d, state_dim=state))
    return out


def _sharding(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        table, eq, kind = item.partition("=")
        if not eq or not table or not kind:
            raise SettingError(f"--sharding {item!r}: expected TABLE=TYPE, e.g. --sharding user=row")
        out[table] = kind
    return out


def _optimizer(name: str):
    from tierstore import optim

    # the learning rate plays no part in a row's size
    return {"none": None, "sgd": optim.SGD(1.0), "adagrad": optim.Adagrad(1.0),
            "rowwise_adagrad": optim.RowWiseAdagrad(1.0), "adam": optim.Adam(1.0)}[name]


def check_world_size(tables, world_size: int) -> None:
    """Every rank must be able to hold a shard: a table splits into at most its rows (row
    sharding) or its columns (column sharding); an unbounded table hashes over any number."""
    if any(t.num_rows is None for t in tables):
        return
    most = sum(max(t.num_rows, t.dim) for t in tables)
    if world_size > most:
        raise SettingError(f"--world-size {world_size:,} is more ranks than the trace's tables split into ({most:,} shards at "
                         f"most: a table splits by rows, or by columns if it has more); pass --world-size {most:,} or less")


def _plan(args) -> int:
    from tierstore.capacity.planner import plan
    from tierstore.trace import Trace

    trace = Trace.load(args.trace)
    tables = _tables(trace, args.dim)
    check_world_size(tables, args.world_size)
    checks = args.world_size * trace.n_accesses
    if checks > SLOW_CHECKS:
        print(f"tierstore plan: matching {trace.n_accesses:,} trace accesses to {args.world_size:,} ranks "
              f"(about {checks:.1e} id checks) may take minutes; Ctrl-C stops it", file=sys.stderr, flush=True)
    result = plan(tables, args.world_size, trace=trace, hbm_bytes=parse_size(args.hbm_bytes, "--hbm-bytes"),
                  ddr_bytes=parse_size(args.ddr_bytes, "--ddr-bytes"), sharding=_sharding(args.sharding),
                  optimizer=_optimizer(args.optimizer))
    if args.json:
        print(result.to_json())
        return 0
    print(f"{args.trace}: {trace.n_steps:,} steps, {len(trace.tables)} tables on {args.world_size} ranks"
          f" (HBM {args.hbm_bytes or 0}, DDR {args.ddr_bytes or 0} per rank; SSD reads predicted for LRU)")
    print(result)
    return 0
