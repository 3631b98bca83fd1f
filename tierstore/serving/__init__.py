"""Serving: stores of exported rows (float32 to int4) with their own tiers, the export from a training store, and the stream of deltas that keeps replicas current."""
