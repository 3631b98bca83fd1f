"""The prefetch daemon, ``tierstore prefetchd``: one process per host that owns a store's
DDR tier and LMDB files and serves them to trainer processes over a Unix socket.

- wire.py: the frames both sides speak (header, text, ids, rows; the shared-memory
  segment; claims; errors by status code).
- client.py: a trainer's side, ``DaemonStore``, which ``tierstore.open_store(PATH,
  daemon=SOCK)`` returns, with its own HBM tier.
- server.py: the ``Daemon`` that owns the store and answers each client (its docstring
  states the contracts: claims, durability, limits, concurrency), helped by config.py
  (``DaemonConfig``, checked), sessions.py (the listening socket, client sessions,
  claims), snapshot.py (its figures and their Prometheus collector) and memory.py
  (the bound on frames in flight, the prefetch hints held).

The command-line verb is tierstore.tools.daemon (tools/daemon.py); ``tierstore bench
daemon`` is tierstore.tools.bench_daemon.
"""

from tierstore.lazy import exports

# tierstore.daemon.client without importing it first
__getattr__, __dir__ = exports(globals(), {}, modules=True)
