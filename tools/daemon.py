"""``tierstore prefetchd``, the command-line verb: its arguments, logging and signal
handling. The daemon itself (its wire format, client, server and the contracts they
keep) is the package tierstore.daemon.
"""
from __future__ import annotations

import argparse
import logging
import signal

import torch

from tierstore.daemon.config import DaemonConfig
from tierstore.daemon.memory import return_freed_memory
from tierstore.daemon.server import Daemon
from tierstore.engine.memory import parse_bytes
from tierstore.tools.cli import add_verb, nonneg_float, nonneg_int, positive_float, positive_int
from tierstore.tools.stats import require_store

__all__ = ["main", "register"]


# -- the CLI verb --------------------------------------------------------------------------
def register(sub) -> None:
    p = add_verb(sub, "prefetchd")
    p.add_argument("path", help="store directory (created beforehand by a TieredStore with tables=)")
    p.add_argument("--socket", required=True, help="Unix socket path (created with mode 0600)")
    p.add_argument("--ddr-rows", type=int, default=None, help="rows of the DDR tier per table (required without --memory-budget)")
    p.add_argument("--memory-budget", type=_budget, default=None,
                   help="the store's host memory, e.g. 1GiB: sizes the DDR tier (unless --ddr-rows), staging, the write-back "
                        "queue, LMDB's dirty pages and a share for the page cache (docs/memory-budget.md)")
    p.add_argument("--policy", default="lru", help="eviction policy: lru or lfu")
    p.add_argument("--lookahead-source", default=None, help="trace (tierstore.trace format) to prefetch from, ahead of the slowest client's step")
    p.add_argument("--depth", type=int, default=2, help="steps to prefetch ahead of the slowest client (with --lookahead-source)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on 127.0.0.1:PORT/metrics; 0 binds a free port, printed on the ready line")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: torch's). Clients are served on a thread each; with N >= 2 "
                        "clients reading at once, 1 keeps their gathers from fighting over the cores")
    p.add_argument("--shm-max-mib", type=nonneg_int, default=1024, help="largest shared-memory segment per client in MiB (0: socket only)")
    p.add_argument("--shm-total-mib", type=nonneg_int, default=4096, help="all clients' segments together in MiB; past it a client uses the socket")
    p.add_argument("--max-inflight-mib", type=nonneg_int, default=256,
                   help="frame payloads, READ replies and working copies handled at once, in MiB; frames wait for room "
                        "(one frame: at most 64 MiB or this); prefetch hints held take at most half of it more")
    p.add_argument("--max-claims", type=positive_int, default=1024,
                   help="row ranges one client may claim; a HELLO with more is refused (claim fewer, wider ranges)")
    p.add_argument("--max-clients", type=positive_int, default=None,
                   help="connections served at once; more are refused with DaemonBusyError (default: what ulimit -n allows, at most 1024)")
    p.add_argument("--idle-timeout", type=nonneg_float, default=3600.0, help="seconds a client may send nothing before it is disconnected (0: never)")
    p.add_argument("--frame-timeout", type=positive_float, default=30.0,
                   help="seconds a client has to send HELLO, finish a frame it began, and read a reply")
    p.set_defaults(func=main)


def _budget(text: str) -> int:
    try:
        return parse_bytes(text, "--memory-budget")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefetchd %(levelname)s %(message)s")
    require_store(args.path, needs_tables=True)  # says how to get one from the command line
    return_freed_memory()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = DaemonConfig(args.path, args.socket, args.ddr_rows, args.policy, args.lookahead_source, args.depth, args.metrics_port,
                          shm_max_bytes=args.shm_max_mib << 20, shm_total_bytes=args.shm_total_mib << 20,
                          max_inflight_bytes=args.max_inflight_mib << 20, max_clients=args.max_clients, max_claims=args.max_claims,
                          idle_timeout=args.idle_timeout, frame_timeout=args.frame_timeout, memory_budget=args.memory_budget)
    daemon = Daemon(config)
    # handlers only set a flag: the accept loop notices it within 0.2 s, then flushes and exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.stop())
    # a line for supervisors and tests to wait on, with the metrics port bound (--metrics-port 0: a free one)
    metrics = f" metrics-port {daemon.metrics_port}" if daemon.metrics_port is not None else ""
    print(f"ready {config.socket}{metrics}", flush=True)
    daemon.serve()
    return 0
