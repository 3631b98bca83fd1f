"""What the daemon reports of itself: a snapshot of its clients and counters (STATS replies,
``Daemon.snapshot``) and the Prometheus collector that publishes them per client."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STATS_CLAIMS = 16  # claims STATS lists per client (and how many it has)


@dataclass(frozen=True)
class ClientInfo:
    """One attached client as a snapshot saw it (STATS lists these, in this order)."""

    name: str
    pid: int | None
    claims: tuple[tuple[str, int, int], ...]  # its first STATS_CLAIMS claims
    n_claims: int
    readonly: bool
    step: int | None  # the step it last reported
    shm_bytes: int
    hints: int  # prefetch hints the store holds for it
    hint_bytes: int


@dataclass(frozen=True)
class DaemonSnapshot:
    """The daemon's own figures at one moment, copied under its lock (Daemon.snapshot)."""

    connections: int  # connected now, attached or not
    clients: tuple[ClientInfo, ...]  # attached (said HELLO)
    requests: Mapping[str, Mapping[str, int]]  # client name -> op -> requests served, kept after it left
    rows: Mapping[str, Mapping[str, int]]  # client name -> op -> rows read, written or hinted


class ClientCollector:
    """Per-client request and row counters, labelled by client name, from a snapshot taken at scrape time."""

    def __init__(self, snapshot: Callable[[], DaemonSnapshot]):
        self._snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        req = CounterMetricFamily("tierstore_daemon_client_requests", "Requests served per client and operation.", labels=["client", "op"])
        rows = CounterMetricFamily("tierstore_daemon_client_rows", "Rows read, written or hinted per client and operation.", labels=["client", "op"])
        steps = GaugeMetricFamily("tierstore_daemon_client_step", "Training step each client last reported.", labels=["client"])
        clients = GaugeMetricFamily("tierstore_daemon_clients", "Connected clients.")
        snap = self._snapshot()
        for name, ops in snap.requests.items():
            for op, n in ops.items():
                req.add_metric([name, op], n)
                rows.add_metric([name, op], snap.rows[name].get(op, 0))
        for c in snap.clients:
            if c.step is not None:
                steps.add_metric([c.name], c.step)
        clients.add_metric([], snap.connections)
        yield from (req, rows, steps, clients)
