"""The conductor's Prometheus metrics, on its own registry (no process globals).

Series (counters carry prometheus_client's ``_total`` suffix):

- ``kvstore_conductor_routed_requests_total{prefill, decode}``: accepted, by engine address.
- ``kvstore_conductor_rejected_requests_total{reason}``: refused up front, by reason.
- ``kvstore_conductor_failed_requests_total{error}``: accepted, then failed on an engine.
- ``kvstore_conductor_ttft_seconds`` and ``..._predicted_ttft_seconds``: measured (arrival
  at the conductor to first token out) and predicted TTFT of served requests;
  ``..._ttft_error_seconds``: predicted minus measured, per request.
- ``kvstore_conductor_tbt_seconds``: mean time between tokens of each served request.
- ``kvstore_conductor_replications_total{outcome}``: copies of hot blocks the policy planned
  (started, done, failed, unsupported), and ``..._replicated_blocks_total``: blocks they
  loaded into engines' prefix caches.
- ``kvstore_conductor_engine_queued_requests{engine, role}``, ``..._engine_queued_seconds``
  (predicted work ahead), ``..._engine_decoding_requests``, ``..._engine_context_tokens``:
  each engine's queue as the conductor's view holds it, read at scrape time.
- ``kvstore_conductor_speed_factor{phase}``: how many times the profile's time prefill and
  decode work, and the handoff between them, take on the engines, as measured
  (`speed.SpeedRatio`); predictions are the profile's times scaled by it.
- ``kvstore_conductor_ttft_latency_seconds``: what every first token takes beyond its
  predicted queue and prefill, added to each TTFT prediction (`latency.FixedLatency`).
- ``kvstore_open_streams{service="conductor"}``, ``kvstore_refused_streams_total`` and
  ``kvstore_stalled_streams_total``: response streams (HTTP and gRPC) open, refused past a
  bound and ended for a stalled reader (`kvstore.bounds.BoundsCollector`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.bounds import BoundsCollector, StreamSlots
from kvstore.conductor.front.completion import CompletionOutcome
from kvstore.conductor.front.live_view import LiveCluster

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ERROR_BUCKETS = (-10.0, -1.0, -0.25, -0.1, -0.025, -0.005, 0.0, 0.005, 0.025, 0.1, 0.25, 1.0)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ConductorMetrics:
    """The counters and histograms of one conductor, fed one outcome per request.

    Args:
        engines: engine addresses, by the index outcomes name.
    """

    def __init__(self, engines: Sequence[str]) -> None:
        self.engines = list(engines)
        self.registry = CollectorRegistry()
        r, name = self.registry, "kvstore_conductor_"
        self.routed = Counter(
            name + "routed_requests", "accepted", ["prefill", "decode"], registry=r
        )
        self.rejected = Counter(name + "rejected_requests", "refused", ["reason"], registry=r)
        self.failed = Counter(
            name + "failed_requests", "failed on an engine", ["error"], registry=r
        )
        self.ttft = Histogram(name + "ttft_seconds", "measured", buckets=TTFT_BUCKETS, registry=r)
        self.predicted_ttft = Histogram(
            name + "predicted_ttft_seconds", "predicted", buckets=TTFT_BUCKETS, registry=r
        )
        self.ttft_error = Histogram(
            name + "ttft_error_seconds", "predicted - measured", buckets=ERROR_BUCKETS, registry=r
        )
        self.tbt = Histogram(
            name + "tbt_seconds", "mean per request", buckets=TBT_BUCKETS, registry=r
        )
        self.replications = Counter(
            name + "replications", "hot-block copies", ["outcome"], registry=r
        )
        self.replicated_blocks = Counter(
            name + "replicated_blocks", "blocks prefetched by replications", registry=r
        )

    def observe(self, outcome: CompletionOutcome) -> None:
        """Counts one finished, failed or rejected request."""
        if outcome.rejected is not None:
            self.rejected.labels(outcome.rejected.reason.value).inc()
            return
        self.routed.labels(self.engines[outcome.prefill], self.engines[outcome.decode]).inc()
        if outcome.finish_reason.startswith("error"):
            self.failed.labels(outcome.finish_reason.removeprefix("error:")).inc()
        if outcome.ttft_s == outcome.ttft_s:  # not NaN: a first token came out
            self.ttft.observe(outcome.ttft_s)
            if outcome.predicted_ttft_s is not None:
                self.predicted_ttft.observe(outcome.predicted_ttft_s)
                self.ttft_error.observe(outcome.predicted_ttft_s - outcome.ttft_s)
        if outcome.tbt_s == outcome.tbt_s and len(outcome.output_token_ids) > 1:
            self.tbt.observe(outcome.tbt_s)

    def replicated(self, outcome: str, num_blocks: int) -> None:
        """Counts one replication's outcome and the blocks it loaded."""
        self.replications.labels(outcome).inc()
        self.replicated_blocks.inc(num_blocks)

    def watch(self, cluster: LiveCluster, prefill: Sequence[int], decode: Sequence[int]) -> None:
        """Exports `cluster`'s queues; `prefill`/`decode` map its instances to engines."""
        self.registry.register(_QueueCollector(cluster, self.engines, prefill, decode))

    def watch_streams(self, slots: StreamSlots) -> None:
        """Exports the open, refused and stalled streams of `slots`."""
        self.registry.register(BoundsCollector([slots]))

    def text(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class _QueueCollector(Collector):
    def __init__(
        self,
        cluster: LiveCluster,
        engines: Sequence[str],
        prefill: Sequence[int],
        decode: Sequence[int],
    ) -> None:
        self.cluster, self.engines = cluster, engines
        self.prefill, self.decode = prefill, decode

    def collect(self) -> Iterator[Metric]:
        name = "kvstore_conductor_engine_"
        queued = GaugeMetricFamily(name + "queued_requests", "in prefill", labels=["engine"])
        seconds = GaugeMetricFamily(name + "queued_seconds", "predicted work", labels=["engine"])
        decoding = GaugeMetricFamily(name + "decoding_requests", "decoding", labels=["engine"])
        context = GaugeMetricFamily(name + "context_tokens", "KV decoding", labels=["engine"])
        for view, e in zip(self.cluster.prefills, self.prefill, strict=True):
            queued.add_metric([self.engines[e]], view.num_queued())
            seconds.add_metric([self.engines[e]], view.queued_s())
        for dview, e in zip(self.cluster.decodes, self.decode, strict=True):
            decoding.add_metric([self.engines[e]], len(dview.running()) + len(dview.incoming()))
            context.add_metric([self.engines[e]], dview.context_tokens())
        speed = GaugeMetricFamily(
            "kvstore_conductor_speed_factor", "measured / profile time", labels=["phase"]
        )
        now_s = self.cluster.now_s
        speed.add_metric(["prefill"], self.cluster.prefill_speed.factor(now_s))
        speed.add_metric(["decode"], self.cluster.decode_speed.factor(now_s))
        speed.add_metric(["handoff"], self.cluster.handoff_speed.factor(now_s))
        latency = GaugeMetricFamily(
            "kvstore_conductor_ttft_latency_seconds", "added to each TTFT prediction"
        )
        latency.add_metric([], self.cluster.latency.seconds(now_s))
        yield from (queued, seconds, decoding, context, speed, latency)
