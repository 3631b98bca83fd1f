"""Capacity analysis of access traces: how many HBM and DDR rows a table needs.

The public face of the capacity tools, kept so that ``from tierstore.tools.capacity
import ...`` goes on working. Each part lives in the module named for it:

- in the library, importable by the store's own modules:
  tierstore/capacity/trace_streams.py (a trace's calls as the store sees them),
  tierstore/capacity/curves.py (stack distances, exact LRU curves),
  tierstore/capacity/shards.py (SHARDS), tierstore/capacity/cachesim.py (replay at one size: LRU,
  LFU, lookahead, Belady), tierstore/capacity/budget.py (targets and byte budgets),
  tierstore/capacity/admission_replay.py (``TableSpec.admit_after`` on a trace);
- in tools/: capacity_analysis.py (the report), capacity_report.py (text, JSON),
  capacity_plots.py (PNG), capacity_progress.py (progress bars), capacity_cli.py
  (``tierstore capacity``), bench_capacity.py (``tierstore bench capacity``).

Tuning constants live in the modules that read them (``trace_streams.SMALL_CALLS``,
``curves._GROUP_CELLS``, ``capacity_progress.PROGRESS_SECONDS`` and
``PROGRESS_ACCESSES``): set them there.
"""
from __future__ import annotations

from tierstore.capacity.admission_replay import predict_admission
from tierstore.capacity.budget import rows_for_targets, split_budget, total_curve
from tierstore.capacity.cachesim import (HEAP_ID_NS, SCAN_CALL_NS, SCAN_ROW_NS, CacheSim, HeapSim, TierCounts, belady_hits,
                                clamp_sizes, simulate)
from tierstore.capacity.curves import LruCurve, RemovedSet, lru_curves, mean_abs_error, stack_distances
from tierstore.capacity.shards import ERROR_SIGMAS, MIN_SAMPLE_ROWS, SUB_SAMPLES, ShardsResult, shards_curves, shards_sample
from tierstore.tools.bench_capacity import run as bench
from tierstore.tools.capacity_analysis import DECADES, DEFAULT_ROW_BYTES, CapacityConfig, analyze
from tierstore.tools.capacity_plots import plot_report
from tierstore.tools.capacity_report import format_report, to_json
from tierstore.capacity.trace_streams import TableStream, build_stream, build_streams, trace_counts

__all__ = [
    "CacheSim", "CapacityConfig", "DECADES", "DEFAULT_ROW_BYTES", "ERROR_SIGMAS", "HEAP_ID_NS", "HeapSim", "LruCurve",
    "MIN_SAMPLE_ROWS", "RemovedSet", "SCAN_CALL_NS", "SCAN_ROW_NS", "SUB_SAMPLES", "ShardsResult", "TableStream",
    "TierCounts", "analyze", "belady_hits", "bench", "build_stream", "build_streams", "clamp_sizes", "format_report",
    "lru_curves", "mean_abs_error", "plot_report", "predict_admission", "rows_for_targets", "shards_curves",
    "shards_sample", "simulate", "split_budget", "stack_distances", "to_json", "total_curve", "trace_counts",
]

