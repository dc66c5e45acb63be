"""Serves a registry as Prometheus text on `GET /metrics` from a thread of this process."""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("kvstore.metrics")


class MetricsExporter:
    """The HTTP endpoint of one registry; `start` binds `host:port` (0: a free port)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsExporter:
        self._server, self._thread = start_http_server(self.port, self.host, self.registry)
        self.port = self._server.server_port
        log.info("event=metrics_on address=%s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join()
            self._server = self._thread = None

    def __enter__(self) -> MetricsExporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
