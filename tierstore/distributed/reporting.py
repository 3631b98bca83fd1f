"""What a sharded collection reports: future batches announced to the ranks that own their rows
(for LookaheadLoader), and its per-rank lookup counters (for Prometheus)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily

from tierstore.engine.prefetch import PrefetchGroup

if TYPE_CHECKING:
    from tierstore.distributed.collection import ShardedEmbeddingBagCollection


class Announcer:
    """What LookaheadLoader calls ``module.store``: announces a future batch to the
    ranks that own its rows (a collective: every rank's loader runs the same depth)."""

    def __init__(self, module: ShardedEmbeddingBagCollection):
        self.module = module

    def prefetch_batch(self, reads: Mapping[str, torch.Tensor]) -> PrefetchGroup:
        return self.module._announce(reads)

    def report_step_seconds(self, seconds: float) -> None:
        if self.module.local_store is not None:
            self.module.local_store.report_step_seconds(seconds)

    def report_prefetch_depth(self, effective_depth: int, shrunk_steps: int) -> None:
        if self.module.local_store is not None:
            self.module.local_store.report_prefetch_depth(effective_depth, shrunk_steps)


class ShardedMetrics:
    """Per-rank lookup counters of a sharded collection: ids this rank requested
    (sent) and rows it served to the ranks asking (itself included), with a ``rank``
    label; max/mean over ranks of the served rate is the load imbalance."""

    def __init__(self, module: ShardedEmbeddingBagCollection, registry: CollectorRegistry):
        self.module, self.registry = module, registry
        registry.register(self)

    def describe(self):
        return self.collect()

    def collect(self):
        m = self.module
        for key, doc in (("sent", "Unique ids a rank requested from the shards' owners (itself included)."),
                         ("served", "Rows a rank's shards served to the requesting ranks."),
                         ("steps", "Forward steps of the sharded collection.")):
            f = CounterMetricFamily(f"tierstore_sharded_lookups_{key}" if key != "steps" else "tierstore_sharded_steps", doc,
                                    labels=["rank"])
            f.add_metric([str(m.rank)], m.lookups[key])
            yield f

    def close(self) -> None:
        try:
            self.registry.unregister(self)
        except KeyError:
            pass
