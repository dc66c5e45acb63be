"""The store's counters and gauges, read from `Store.stats()` when Prometheus scrapes.

Nothing is counted twice: the store already counts every event under its lock, and a scrape
turns one consistent `StoreStats` into metric families, so the hot path pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.results import StoreStats

# StoreStats field -> (metric name without the _total suffix, help)
_COUNTERS = {
    "misses": ("kvstore_miss_blocks", "blocks asked for and not held"),
    "miss_tokens": ("kvstore_miss_tokens", "tokens of the blocks asked for and not held"),
    "evictions": ("kvstore_evictions", "blocks that left DRAM to make room"),
    "demotions": ("kvstore_demotions", "blocks copied from DRAM to SSD"),
    "promotions": ("kvstore_promotions", "blocks copied from SSD to DRAM on a read"),
    "drops": ("kvstore_drops", "blocks that left the store to make room"),
    "blocks_committed": ("kvstore_committed_blocks", "blocks committed by puts"),
    "bytes_written": ("kvstore_committed_bytes", "bytes committed by puts"),
    "bytes_read": ("kvstore_read_bytes", "bytes handed to readers"),
    "checksum_failures": ("kvstore_checksum_failures", "blocks dropped for a bad checksum"),
    "ssd_write_failures": ("kvstore_ssd_write_failures", "SSD transactions that failed"),
    "expired_reservations": ("kvstore_expired_reservations", "reservations freed by timeout"),
    "expired_leases": ("kvstore_expired_leases", "read leases ended by timeout"),
}
_GAUGES = {
    "num_blocks": ("kvstore_blocks", "committed blocks held"),
    "num_namespaces": ("kvstore_namespaces", "registered namespaces"),
    "num_reservations": ("kvstore_reservations", "open reservations"),
    "num_leases": ("kvstore_leases", "open read leases"),
}
# TierUsage field -> (metric name, help, is_counter)
_TIER_METRICS = {
    "capacity_bytes": ("kvstore_tier_capacity_bytes", "capacity of the tier", False),
    "used_bytes": ("kvstore_tier_used_bytes", "bytes of the tier in use", False),
    "num_blocks": ("kvstore_tier_blocks", "blocks in the tier", False),
    "hits": ("kvstore_hit_blocks", "reads served from the tier", True),
    "hit_tokens": ("kvstore_hit_tokens", "tokens of the reads served from the tier", True),
    "bytes_read": ("kvstore_tier_read_bytes", "bytes read out of the tier", True),
    "bytes_written": ("kvstore_tier_written_bytes", "bytes written into the tier", True),
}


TenantBytes = Mapping[str, Mapping[str, int]]  # tier -> tenant -> bytes held


class StoreCollector(Collector):
    """Collects `stats()` (a store's `Store.stats`) at each scrape, and with `tenant_bytes`
    (`Store.tenant_bytes`) what each tenant holds of each tier: the operator's view (the
    metrics endpoint takes no tokens; keep it where only the operator reaches it)."""

    def __init__(
        self, stats: Callable[[], StoreStats], tenant_bytes: Callable[[], TenantBytes] | None = None
    ) -> None:
        self._stats = stats
        self._tenant_bytes = tenant_bytes

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for field, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        for field, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
        for field, (name, doc, is_counter) in _TIER_METRICS.items():
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
                name, doc, labels=["tier"]
            )
            for tier in stats.tiers:
                family.add_metric([tier.name], getattr(tier, field))
            yield family
        if self._tenant_bytes is not None:
            yield self._tenants(self._tenant_bytes())

    def _tenants(self, held: TenantBytes) -> Metric:
        family = GaugeMetricFamily(
            "kvstore_tenant_used_bytes",
            "bytes a tenant holds in the tier",
            labels=["tenant", "tier"],
        )
        for tier, by_tenant in held.items():
            for tenant, nbytes in sorted(by_tenant.items()):
                family.add_metric([tenant or "anonymous", tier], nbytes)
        return family
