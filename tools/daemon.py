"""``tierstore prefetchd``: one process per host that owns a store's DDR tier and
LMDB files and serves them to trainer processes over a Unix socket.

Clients attach with ``tierstore.open_store(PATH, daemon=SOCK, claim=[...])``
(tierstore/client.py); the frames are described in tierstore/wire.py.

Claims: each client names the tables or ``(table, lo, hi)`` row ranges it
writes in its HELLO (at most ``max_claims``); the daemon keeps every client's
claims of a table in one sorted array, so a HELLO is checked with binary
searches, not against each claim held. It refuses a claim that overlaps another
client's, and refuses WRITE frames touching rows outside the sender's claims. A client with an HBM tier caches only its claimed rows (see
tierstore/client.py), so no other client's write can make its copy stale.

Durability: WRITE frames go straight into the daemon's store (its DDR tier,
else LMDB) and become durable at the next FLUSH from anyone, or when the
daemon stops (SIGTERM/SIGINT flush before exit). A client killed mid-write
loses at most the frame it was sending (a partial frame is never applied)
plus the dirty rows of its own HBM tier, and its claims are released at once;
rows it wrote that nobody flushed stay in the daemon's cache and are flushed
with everything else. A daemon killed with SIGKILL loses the rows written
since the last flush, like an embedded store.

Limits: at most ``max_clients`` connections (by default as many as the
open-file limit allows, up to 1024); the excess is told DaemonBusyError and
closed, and an accept() that finds no free descriptor refuses that one
connection, never the daemon. A connection must send HELLO within
``frame_timeout``, finish each frame it begins within it, and read each
reply within it; one idle for ``idle_timeout`` is closed (with a
ConnectionError reply saying so). Memory: each frame's payload, plus a
READ's reply, a PREFETCH's working copies or a HELLO's parsed JSON, is
reserved from ``max_inflight_bytes`` before anything is allocated for it (a
frame waits until it fits), and segments are granted from
``shm_total_bytes``; a finished connection's segment and buffers go at once.
Prefetch hints the store keeps (their ids, the rows they pin) hold at most
half of ``max_inflight_bytes``, all clients together: a hint that would pass
it first drops the oldest hints of the client holding the most (see HintPool).

Concurrency: one thread per connection. Frames are read and written outside
the store's lock, and READ rows are gathered straight into the client's
shared-memory segment. A read whose rows are all in the DDR tier holds the
store's lock only for the lookup and the policy update, and gathers outside
it, so several clients' gathers run at once (TieredStore.read).

This module is the command-line verb. The daemon's parts: its settings
(daemon_config.py), its socket, client sessions and claims (daemon_sessions.py),
its memory bounds and prefetch hints (daemon_memory.py), and the server itself
(daemon_server.py); ``tierstore bench daemon`` is bench_daemon.py.
"""
from __future__ import annotations

import argparse
import logging
import signal

import torch

from tierstore.memory import parse_bytes
from tierstore.tools.cli import nonneg_float, nonneg_int, positive_float, positive_int
from tierstore.tools.daemon_config import DaemonConfig
from tierstore.tools.daemon_memory import return_freed_memory
from tierstore.tools.daemon_server import Daemon
from tierstore.tools.stats import require_store

__all__ = ["Daemon", "DaemonConfig", "main", "register"]


# -- the CLI verb --------------------------------------------------------------------------
def register(sub) -> None:
    p = sub.add_parser("prefetchd", help="serve a store's DDR tier and LMDB files to trainer processes over a Unix socket")
    p.add_argument("path", help="store directory (created beforehand by a TieredStore with tables=)")
    p.add_argument("--socket", required=True, help="Unix socket path (created with mode 0600)")
    p.add_argument("--ddr-rows", type=int, default=None, help="rows of the DDR tier per table (required without --memory-budget)")
    p.add_argument("--memory-budget", type=_budget, default=None,
                   help="the store's host memory, e.g. 1GiB: sizes the DDR tier (unless --ddr-rows), staging, the write-back "
                        "queue, LMDB's dirty pages and a share for the page cache (README \"Memory budget\")")
    p.add_argument("--policy", default="lru", help="eviction policy: lru or lfu")
    p.add_argument("--lookahead-source", default=None, help="trace (tierstore.trace format) to prefetch from, ahead of the slowest client's step")
    p.add_argument("--depth", type=int, default=2, help="steps to prefetch ahead of the slowest client (with --lookahead-source)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on 127.0.0.1:PORT/metrics")
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
    print(f"ready {config.socket}", flush=True)  # a line for supervisors and tests to wait on
    daemon.serve()
    return 0
