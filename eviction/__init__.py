"""Eviction policies (numpy only; no torch, LMDB or metrics)."""
from .policies import POLICIES, UNUSED, EvictionPolicy, LFUPolicy, LRUPolicy, make_policy, register

__all__ = ["POLICIES", "UNUSED", "EvictionPolicy", "LFUPolicy", "LRUPolicy", "make_policy", "register"]
