"""Prometheus metrics for tierstore: a collector that reads the stores' plain
counters at scrape time, and the HTTP endpoint that serves them."""
from .collector import METRICS, MetricsConfig, StoreMetrics, TierstoreCollector
from .server import DEFAULT_ADDR, MetricsServer

__all__ = ["DEFAULT_ADDR", "METRICS", "MetricsConfig", "MetricsServer", "StoreMetrics", "TierstoreCollector"]
