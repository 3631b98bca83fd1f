"""Capacity analysis of access traces: how many HBM and DDR rows a table needs.

The public face of the capacity tools, kept so that ``from tierstore.tools.capacity
import ...`` goes on working. Each part lives in the module named for it:

- in the library, importable by the store's own modules:
  tierstore/trace_streams.py (a trace's calls as the store sees them),
  tierstore/curves.py (stack distances, exact LRU curves),
  tierstore/shards.py (SHARDS), tierstore/cachesim.py (replay at one size: LRU,
  LFU, lookahead, Belady), tierstore/budget.py (targets and byte budgets),
  tierstore/admission_replay.py (``TableSpec.admit_after`` on a trace);
- in tools/: capacity_analysis.py (the report), capacity_report.py (text, JSON),
  capacity_plots.py (PNG), capacity_progress.py (progress bars), capacity_cli.py
  (``tierstore capacity``), bench_capacity.py (``tierstore bench capacity``).

Tuning constants that used to live here (``SMALL_CALLS``, ``_GROUP_CELLS``,
``PROGRESS_SECONDS``, ``PROGRESS_ACCESSES``) are read and set through this module
in the modules that use them, so setting ``tierstore.tools.capacity.X`` still
changes what the code does.
"""
from __future__ import annotations

import sys
import types

from tierstore import curves, trace_streams
from tierstore.admission_replay import predict_admission
from tierstore.budget import rows_for_targets, split_budget, total_curve
from tierstore.cachesim import (HEAP_ID_NS, SCAN_CALL_NS, SCAN_ROW_NS, CacheSim, HeapSim, TierCounts, belady_hits,
                                clamp_sizes, simulate)
from tierstore.curves import LruCurve, RemovedSet, lru_curves, mean_abs_error, stack_distances
from tierstore.shards import ERROR_SIGMAS, MIN_SAMPLE_ROWS, SUB_SAMPLES, ShardsResult, shards_curves, shards_sample
from tierstore.tools import capacity_progress
from tierstore.tools.bench_capacity import run as bench
from tierstore.tools.capacity_analysis import DECADES, DEFAULT_ROW_BYTES, CapacityConfig, analyze
from tierstore.tools.capacity_plots import plot_report
from tierstore.tools.capacity_report import format_report, to_json
from tierstore.trace_streams import TableStream, build_stream, build_streams, trace_counts

__all__ = [
    "CacheSim", "CapacityConfig", "DECADES", "DEFAULT_ROW_BYTES", "ERROR_SIGMAS", "HEAP_ID_NS", "HeapSim", "LruCurve",
    "MIN_SAMPLE_ROWS", "RemovedSet", "SCAN_CALL_NS", "SCAN_ROW_NS", "SUB_SAMPLES", "ShardsResult", "TableStream",
    "TierCounts", "analyze", "belady_hits", "bench", "build_stream", "build_streams", "clamp_sizes", "format_report",
    "lru_curves", "mean_abs_error", "plot_report", "predict_admission", "rows_for_targets", "shards_curves",
    "shards_sample", "simulate", "split_budget", "stack_distances", "to_json", "total_curve", "trace_counts",
]


_TUNING = {"SMALL_CALLS": trace_streams, "_GROUP_CELLS": curves,
           "PROGRESS_SECONDS": capacity_progress, "PROGRESS_ACCESSES": capacity_progress}


class _CapacityModule(types.ModuleType):
    """This module, with its tuning constants forwarded to the modules that read them."""

    def __getattr__(self, name: str):
        if name in _TUNING:
            return getattr(_TUNING[name], name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in _TUNING:
            setattr(_TUNING[name], name, value)
        else:
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _CapacityModule  # PEP 549's way: a module's own __setattr__
