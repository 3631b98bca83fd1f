"""Eviction policies (numpy only; no torch, LMDB or metrics)."""
from .policies import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, make_policy

__all__ = ["POLICIES", "EvictionPolicy", "LFUPolicy", "LRUPolicy", "make_policy"]
