"""``tierstore bench``: speed and memory figures, each a ratio against a
baseline measured in the same run. Figures are medians of repeated runs.

This module is the verb and the timing helpers every benchmark shares; it imports
no torch, so that ``tierstore bench --help`` answers at once. A benchmark lives in
its module with the function that runs it and the one that adds its options."""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from typing import NamedTuple

from tierstore.tools.cli import add_verb, conventions, positive_int


class Bench(NamedTuple):
    module: str  # in tierstore.tools
    help: str  # its line in `tierstore bench --help`, and its description
    run: str = "run"  # the module's function that runs it on the parsed options and prints its figures
    arguments: str = "add_arguments"  # the module's function that adds its options to a parser


BENCHES: dict[str, Bench] = {
    "read": Bench("bench_store", "reads of resident rows against torch.index_select over a plain tensor",
                  "bench_read", "read_arguments"),
    "cold": Bench("bench_store", "reads of rows only in LMDB against a raw py-lmdb get loop over the same rows",
                  "bench_cold", "cold_arguments"),
    "evict": Bench("bench_store", "reads that evict from a large DDR tier, by policy, against reads of resident rows",
                   "bench_evict", "evict_arguments"),
    "memory": Bench("bench_store", "a 10^9-row table with a 1M-row DDR tier: open time and resident memory",
                    "bench_memory", "memory_arguments"),
    "train": Bench("bench_train", "a training step with the working rows resident against nn.EmbeddingBag and "
                                  "torch.optim in memory"),
    "metrics": Bench("bench_metrics", "read throughput while Prometheus scrapes the store against nothing scraping"),
    "capacity": Bench("bench_capacity", "miss-ratio curves (exact LRU, SHARDS) of a Zipf trace against a "
                                        "plain-Python LRU of one size"),
    "daemon": Bench("bench_daemon", "reads through `tierstore prefetchd` against an in-process DDR tier, and two "
                                    "client processes against one"),
    "prefetch": Bench("bench_prefetch", "the training step with cold rows, by prefetch depth, against every row "
                                        "resident; lookahead eviction's hit rate against Belady's"),
    "peers": Bench("bench_peers", "the resident training step and lookup against FBGEMM's fused table-batched "
                                  "embedding"),
    "load": Bench("bench_store", "bulk load, durable, against LMDB putmulti in one transaction",
                  "bench_load", "load_arguments"),
    "sharded": Bench("bench_sharded", "ShardedEmbeddingBagCollection on 1, 2 and 4 local ranks against one "
                                      "process and the plan's bytes, and the bytes each rank receives"),
    "churn": Bench("bench_churn", "what admission and TTL eviction do to an unbounded table's disk and to a "
                                  "model's loss"),
    "instructions": Bench("bench_instructions", "machine instructions per training step (valgrind's callgrind), "
                                                "at prefetch depth 0 and 2"),
    "serve": Bench("bench_serve", "serving lookups (float32, int8, int4) against FBGEMM IntNBit; client "
                                  "latency while deltas apply"),
    "index": Bench("bench_index", "a table of many more declared rows than written: random rows written under a "
                                  "budget a million at a time, killed, recovered, trained, reopened"),
    "scale": Bench("bench_scale", "a table many times the memory budget, trained under a real memory limit"),
    "gpu": Bench("bench_gpu", "every GPU figure in one run: the resident step against nn.EmbeddingBag + torch's "
                              "optimizers, read against index_select, the HBM tier as a cache, ops and syncs a "
                              "step, then `pytest -m gpu`"),
}
DEFAULT = ("read", "cold", "memory")  # what `tierstore bench` alone runs
DEFAULT_BATCH = 65_536

# The options several benchmarks take, declared once; a benchmark adds those it reads,
# with its own default or help where they differ (shared()).
SHARED: dict[str, dict] = {
    "rows": dict(type=positive_int, default=1_000_000, help="table rows"),
    "dim": dict(type=positive_int, default=128, help="embedding dim"),
    "batch": dict(type=positive_int, default=DEFAULT_BATCH, help="ids per read"),
    "repeat": dict(type=positive_int, default=15, help="timed repetitions (the median is reported)"),
    "device": dict(default="cpu", help="the HBM tier's device (cuda puts every row in HBM)"),
    "dir": dict(default=None, help="directory for the benchmark's stores (default: a temporary one)"),
    "seed": dict(type=int, default=0, help="random seed"),
}


def shared(p: argparse.ArgumentParser, *names: str, helps: dict[str, str] | None = None, **defaults) -> None:
    """Adds the shared options ``names`` and those in ``defaults`` (with the default given) to
    a benchmark's parser; ``helps`` gives its own help line for any of them. A benchmark adds
    these first, then its own."""
    for name in [n for n in SHARED if n in names or n in defaults]:  # in one order for every benchmark
        kwargs = {**SHARED[name], **({"default": defaults[name]} if name in defaults else {})}
        if helps and name in helps:
            kwargs["help"] = helps[name]
        p.add_argument(f"--{name}", **kwargs)


def _module(bench: Bench):
    return importlib.import_module(f"tierstore.tools.{bench.module}")


class BenchmarkParser(argparse.ArgumentParser):
    """One benchmark's parser. Its options are added when it first parses (a run, or its
    ``--help``): only then is its module imported, and torch with it."""

    def __init__(self, *args, benchmark: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.benchmark, self.loaded = benchmark, False

    def load(self) -> BenchmarkParser:
        if not self.loaded:
            self.loaded = True
            self.add_argument("more", nargs="*", metavar="BENCHMARK",
                              help="more benchmarks to run after this one, each with the options given "
                                   "(each must take them all)")
            bench = BENCHES[self.benchmark]
            getattr(_module(bench), bench.arguments)(self)
            conventions(self)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        args = sys.argv[1:] if args is None else list(args)
        ns, rest = super().parse_known_args(args, namespace)
        unknown = [name for name in ns.more if name not in BENCHES]
        if rest:  # here, not at the top level: the error shows this benchmark's usage, with its options
            several = (f"; benchmarks named together must each take every option given: run {self.benchmark} in "
                       "its own command")
            # an unknown option's value was taken for a benchmark's name: it is unrecognized too
            self.error(f"unrecognized arguments: {' '.join(rest + unknown)}"
                       + (several if len(unknown) < len(ns.more) else ""))
        if unknown:
            self.error(f"no benchmark {', '.join(map(repr, unknown))}; choose from {', '.join(BENCHES)}")
        ns.bench_argv = args
        return ns, rest


def benchmark_parser(name: str) -> BenchmarkParser:
    """``tierstore bench NAME``'s parser, its options added."""
    return BenchmarkParser(prog=f"tierstore bench {name}", description=BENCHES[name].help, benchmark=name).load()


def register(sub) -> None:
    p = add_verb(sub, "bench", usage="tierstore bench [-h] [BENCHMARK ...] [options]",
                 description="Each benchmark prints its figures against a baseline measured in the same run. "
                             "`tierstore bench BENCHMARK --help` gives its options. Several named together run in "
                             "turn, each with the options given (`tierstore bench read cold --rows 100000`); with "
                             f"none named: {' '.join(DEFAULT)}.")
    benches = p.add_subparsers(dest="bench", title="benchmarks", metavar="BENCHMARK", prog="tierstore bench",
                               parser_class=BenchmarkParser)
    for name, bench in BENCHES.items():
        benches.add_parser(name, help=bench.help, description=bench.help, benchmark=name)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    names = [args.bench, *args.more] if args.bench else list(DEFAULT)
    # each benchmark reads the options given with its own parser (its defaults): all are
    # parsed before the first runs, so an option one of them does not take costs no run
    runs = [(name, benchmark_parser(name).parse_args(getattr(args, "bench_argv", []))) for name in names]
    import torch  # here, not above: `tierstore bench --help` answers without loading it

    for name, options in runs:
        torch.manual_seed(getattr(options, "seed", 0))
        bench = BENCHES[name]
        getattr(_module(bench), bench.run)(options)
    return 0


def wall_clock(fn, round_: int) -> float:
    """Seconds one call ``fn()`` takes by the wall clock (the round is not passed)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_medians(fns, repeat: int, warmup: int = 2, timed=wall_clock) -> list[float]:
    """Median seconds of each function, called in turn each round, so that a change
    in machine load during the run hits the baseline and tierstore alike; ``timed(fn, round)``
    times one call (bench gpu times CUDA calls between events)."""
    times = [[] for _ in fns]
    for r in range(warmup + repeat):
        for fn, ts in zip(fns, times):
            t = timed(fn, r)
            if r >= warmup:
                ts.append(t)
    return [statistics.median(ts) for ts in times]


def median_seconds(fn, repeat: int, warmup: int = 2) -> float:
    return interleaved_medians((fn,), repeat, warmup)[0]


def report(title: str, params: dict, rows: list[tuple[str, str]], ratio_name: str, ratio: float, goal: str) -> None:
    print(f"\n== {title}")
    print("   " + ", ".join(f"{k}={v}" for k, v in params.items()))
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"   {label:<{width}}  {value}")
    print(f"   {ratio_name}: {ratio:.2f}x  (goal {goal})")
