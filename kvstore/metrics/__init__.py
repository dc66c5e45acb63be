"""Prometheus metrics of a node: what its store holds and did (`StoreCollector`, read from
`Store.stats()` at each scrape), how its calls went (`CallMetrics`), what an engine does
(`EngineMetrics`), and the HTTP endpoint that serves them (`MetricsExporter`). Each node
has its own registry: no process globals."""

from kvstore.metrics.call_metrics import CallMetrics
from kvstore.metrics.engine_metrics import EngineMetrics
from kvstore.metrics.exporter import MetricsExporter
from kvstore.metrics.store_collector import StoreCollector

__all__ = ["CallMetrics", "EngineMetrics", "MetricsExporter", "StoreCollector"]
