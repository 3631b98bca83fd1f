"""Serving: stores of exported rows (float32 to int4) with their own tiers, the export from a training store, and the stream of deltas that keeps replicas current."""
from tierstore.serving.store import ServingEmbeddingBag, ServingEmbeddingBagCollection, ServingStore
from tierstore.serving.stream import DeltaCorruptError, DeltaGapError, Publisher, Replica

__all__ = ["DeltaCorruptError", "DeltaGapError", "Publisher", "Replica", "ServingEmbeddingBag",
           "ServingEmbeddingBagCollection", "ServingStore"]
