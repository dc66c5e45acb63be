"""What a node's calls did, per plane (`grpc`, `ucx`) and method: how long they took, the
bytes they moved, and the errors they were refused with (by error class)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# 100 us to ~13 s, doubling: a cached match to a multi-GiB get.
LATENCY_BUCKETS_S = tuple(1e-4 * 2**i for i in range(18))


class CallMetrics:
    """One node's call metrics, registered in `registry`.

    Methods are safe to call from any thread (prometheus-client locks each child).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["plane", "method"]
        self.duration = Histogram(
            "kvstore_request_duration_seconds",
            "time from a call's arrival to its last reply",
            labels,
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.received = Counter(
            "kvstore_received_bytes", "request bytes received", labels, registry=registry
        )
        self.sent = Counter("kvstore_sent_bytes", "reply bytes sent", labels, registry=registry)
        self.rejected = Counter(
            "kvstore_rejected_requests",
            "calls that ended with an error, by its class",
            [*labels, "error"],
            registry=registry,
        )

        self.swept = Counter(
            "kvstore_swept_messages",
            "data-plane messages under tags no receive would match, dropped by the node",
            ["plane"],
            registry=registry,
        )

    def observe(self, plane: str, method: str, seconds: float, error: str | None) -> None:
        """Records one finished call; `error` is the class name of the error it ended with."""
        self.duration.labels(plane, method).observe(seconds)
        if error is not None:
            self.rejected.labels(plane, method, error).inc()

    def moved(self, plane: str, method: str, received: int, sent: int) -> None:
        """Records bytes a call of `method` received and sent."""
        if received:
            self.received.labels(plane, method).inc(received)
        if sent:
            self.sent.labels(plane, method).inc(sent)
