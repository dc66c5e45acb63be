"""Prometheus metrics of the bounds (`StreamSlots`, `UnprovenSockets`), read at each scrape."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.bounds.stream_slots import StreamSlots
from kvstore.bounds.unproven_sockets import UnprovenSockets


class BoundsCollector(Collector):
    """Open, refused and stalled response streams per service; unproven and shed sockets
    per data plane."""

    def __init__(
        self, slots: Sequence[StreamSlots] = (), sockets: Sequence[UnprovenSockets] = ()
    ) -> None:
        self.slots = list(slots)
        self.sockets = list(sockets)

    def collect(self) -> Iterator[Metric]:
        service = ["service"]
        open_ = GaugeMetricFamily("kvstore_open_streams", "response streams open", labels=service)
        refused = CounterMetricFamily(
            "kvstore_refused_streams", "streams refused past a bound", labels=service
        )
        stalled = CounterMetricFamily(
            "kvstore_stalled_streams", "streams ended because their reader stalled", labels=service
        )
        for s in self.slots:
            open_.add_metric([s.service], len(s))
            refused.add_metric([s.service], s.num_refused)
            stalled.add_metric([s.service], s.num_stalled)
        unproven = GaugeMetricFamily(
            "kvstore_unproven_sockets", "data-plane sockets with no hello yet", labels=["plane"]
        )
        shed = CounterMetricFamily(
            "kvstore_shed_sockets", "silent sockets closed to make room", labels=["plane"]
        )
        for p in self.sockets:
            unproven.add_metric([p.plane], len(p))
            shed.add_metric([p.plane], p.num_shed)
        yield from (open_, refused, stalled, unproven, shed)
