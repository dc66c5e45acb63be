"""An engine's metrics: its load (read from `EngineRunner.load()` at each scrape) and what
its finished requests did (time to first token, time per output token, tokens by source)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# EngineLoad field -> (metric name, help, is_counter)
_LOAD = {
    "num_waiting": ("kvstore_engine_waiting_requests", "submitted, not yet admitted", False),
    "num_running": ("kvstore_engine_running_requests", "holding KV pages", False),
    "num_free_pages": ("kvstore_engine_free_pages", "KV pages free or evictable", False),
    "num_pages": ("kvstore_engine_pages", "KV pages in all", False),
    "num_cached_blocks": ("kvstore_engine_cached_blocks", "blocks in the prefix cache", False),
    "num_pending_blocks": ("kvstore_engine_pending_blocks", "staged, not yet stored", False),
    "num_store_loaded_blocks": ("kvstore_engine_store_loaded_blocks", "blocks loaded", True),
    "bytes_loaded": ("kvstore_engine_store_loaded_bytes", "bytes loaded from the store", True),
    "num_published_blocks": ("kvstore_engine_published_blocks", "blocks published", True),
    "num_dropped_blocks": ("kvstore_engine_dropped_blocks", "publishes dropped", True),
}
# From 1 ms, doubling to ~65 s: CPU prefills of long prompts are seconds.
_TTFT_BUCKETS_S = tuple(1e-3 * 2**i for i in range(17))
_TPOT_BUCKETS_S = tuple(1e-4 * 2**i for i in range(16))


class _LoadCollector(Collector):
    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        for field, (name, doc, is_counter) in _LOAD.items():
            family = CounterMetricFamily if is_counter else GaugeMetricFamily
            yield family(name, doc, value=getattr(load, field))


class EngineMetrics:
    """An engine's metrics in `registry`; `load` is `EngineRunner.load`."""

    def __init__(self, registry: CollectorRegistry, load: Callable[[], Any]) -> None:
        registry.register(_LoadCollector(load))
        self.requests = Counter(
            "kvstore_engine_requests", "finished requests", ["finish_reason"], registry=registry
        )
        self.tokens = Counter(
            "kvstore_engine_tokens", "tokens of finished requests", ["kind"], registry=registry
        )
        self.ttft = Histogram(
            "kvstore_engine_ttft_seconds", "arrival to first token", registry=registry,
            buckets=_TTFT_BUCKETS_S,
        )  # fmt: skip
        self.tpot = Histogram(
            "kvstore_engine_tpot_seconds", "mean time per output token after the first",
            registry=registry, buckets=_TPOT_BUCKETS_S,
        )  # fmt: skip

    def finished(self, out: Any) -> None:
        """Records a finished `gpu_engine.outputs.RequestOutput`."""
        usage, metrics = out.usage, out.metrics
        self.requests.labels(out.finish_reason).inc()
        for kind, count in (
            ("prompt", usage.prompt_tokens),
            ("completion", usage.completion_tokens),
            ("cached_local", usage.local_cached_tokens),
            ("cached_store", usage.store_cached_tokens),
        ):
            self.tokens.labels(kind).inc(count)
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        if metrics.tpot_s is not None:
            self.tpot.observe(metrics.tpot_s)
