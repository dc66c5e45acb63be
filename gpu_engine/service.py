"""The engine process: `EngineService` over gRPC (Generate, Load) in front of an `EngineRunner`.

A thread-pool gRPC server: each Generate call submits its request to the runner and streams
the tokens from the request's output stream as the engine thread samples them. A caller
that cancels its stream, or goes away, aborts the request: the engine stops computing it
and frees its pages. Protobuf types stop here and in `gpu_engine.engine_client`.

Disaggregated, a conductor sends a request to a `--role prefill` engine, whose stream
carries the first token and ends (finish reason "prefill") with `num_published_tokens`
once the prompt's blocks are in the store, then sends the same request with that count to a
`--role decode` engine, which streams all max_tokens tokens.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from types import MappingProxyType

import grpc
from prometheus_client import CollectorRegistry

from gpu_engine.config import EngineConfig
from gpu_engine.connector import StoreConnector, StoreConnectorConfig
from gpu_engine.engine import Engine
from gpu_engine.errors import (
    BlockSizeError,
    EngineError,
    EngineFailedError,
    InvalidRequestError,
    OutOfPagesError,
    PublishError,
    RequestAbortedError,
)
from gpu_engine.outputs import RequestOutput
from gpu_engine.runner import EngineRunner
from gpu_engine.sampling import SamplingParams
from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.auth import ListenerSecurity, TokenInterceptor
from kvstore.config import option
from kvstore.metrics import EngineMetrics, MetricsExporter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineServiceConfig(ListenerSecurity):
    """Where the engine listens (and, from `ListenerSecurity`, who may call it)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50061, "gRPC port of the EngineService; 0 picks a free one")
    max_workers: int = option(64, "gRPC threads: the most Generate streams served at once")
    grace_s: float = option(5.0, "on SIGTERM, how long running streams may finish")
    metrics_port: int = option(0, "port of the Prometheus /metrics endpoint on --host (0: off)")

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise errors.InvalidArgumentError(f"{name} must be in [0, 65536)")
        if self.max_workers <= 0:
            raise errors.InvalidArgumentError("max_workers must be > 0")
        self.check_security()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


# The one mapping of engine errors to the wire: each travels as the store error of its
# status code, so `kvstore.client_common.raise_rpc_error` raises that class in the client.
_WIRE_ERRORS: MappingProxyType[type[EngineError], type[errors.KVStoreError]] = MappingProxyType(
    {
        InvalidRequestError: errors.InvalidArgumentError,
        BlockSizeError: errors.InvalidArgumentError,
        OutOfPagesError: errors.ResourceExhaustedError,
        PublishError: errors.UnavailableError,  # the store did not take the blocks in time
        EngineFailedError: errors.UnavailableError,
    }
)


def _abort(context: grpc.ServicerContext, exc: EngineError) -> None:
    wire = next((w for cls, w in _WIRE_ERRORS.items() if isinstance(exc, cls)), None)
    wire = wire if wire is not None else errors.KVStoreError  # INTERNAL
    context.set_trailing_metadata(((errors.ERROR_METADATA_KEY, wire.__name__),))
    context.abort(grpc.StatusCode[wire.code], str(exc))


def _params(request: pb.GenerateRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=request.max_tokens or 16,
        temperature=request.temperature,
        seed=request.seed if request.HasField("seed") else None,
        stop_token_ids=tuple(request.stop_token_ids),
    )


def _response(out: RequestOutput, num_sent: int, return_logits: bool) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.output_token_ids[num_sent:],
        finish_reason=out.finish_reason or "",
    )
    if out.finished:
        msg.num_published_tokens = out.num_published_tokens
        msg.usage.CopyFrom(pb.GenerateUsage(**out.usage._asdict()))
        ttft, tpot = out.metrics.ttft_s, out.metrics.tpot_s
        msg.metrics.CopyFrom(pb.GenerateMetrics(ttft_s=ttft or 0.0, tpot_s=tpot or 0.0))
        if return_logits and out.logits is not None:
            msg.logits = out.logits.float().numpy().astype("<f4").tobytes()
    return msg


class EngineServicer(pb_grpc.EngineServiceServicer):
    """Generate and Load over one `EngineRunner`."""

    def __init__(self, runner: EngineRunner, metrics: EngineMetrics | None = None) -> None:
        self.runner = runner
        self.metrics = metrics

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        try:
            params = _params(request)
        except (EngineError, ValueError) as exc:
            _abort(context, InvalidRequestError(str(exc)))
        prompt, num_published = list(request.prompt_token_ids), request.num_published_tokens
        stream = self.runner.submit(prompt, params, num_published, request.prefetch)
        # Called when the RPC ends, however: a caller who cancels or goes away frees the
        # engine of the request (a no-op if it finished first).
        if not context.add_callback(lambda: self.runner.cancel(stream)):
            self.runner.cancel(stream)
        num_sent = 0
        while True:
            out = stream.get()
            if isinstance(out, RequestAbortedError):
                return  # the RPC is over
            if isinstance(out, EngineError):
                _abort(context, out)
            assert isinstance(out, RequestOutput), f"unexpected stream item {out!r}"
            yield _response(out, num_sent, request.return_logits)
            num_sent = len(out.output_token_ids)
            if out.finished:
                if self.metrics is not None:
                    self.metrics.finished(out)
                return

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadResponse:
        return pb.LoadResponse(**self.runner.load()._asdict())


class EngineServer:
    """An engine, its store connector, its runner thread and its gRPC server.

    Example:
        >>> with EngineServer(EngineConfig(), StoreConnectorConfig(store="127.0.0.1:50051"),
        ...                   EngineServiceConfig(port=0)) as server:
        ...     client = EngineClient(server.address)
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        connector_config: StoreConnectorConfig,
        config: EngineServiceConfig,
    ) -> None:
        self.config = config
        self.connector = StoreConnector(connector_config) if connector_config.store else None
        self.runner = EngineRunner(Engine(engine_config, self.connector), self.connector)
        auth = config.authenticator()
        interceptors = [TokenInterceptor(auth)] if auth.is_enabled else []
        pool = futures.ThreadPoolExecutor(max_workers=config.max_workers)
        self._server = grpc.server(pool, interceptors=interceptors)
        self._exporter: MetricsExporter | None = None
        metrics = None
        if config.metrics_port:
            registry = CollectorRegistry()
            metrics = EngineMetrics(registry, self.runner.load)
            self._exporter = MetricsExporter(registry, config.host, config.metrics_port)
        servicer = EngineServicer(self.runner, metrics)
        pb_grpc.add_EngineServiceServicer_to_server(servicer, self._server)
        self.port = config.add_port(self._server, config.address)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> EngineServer:
        self.runner.start()
        self._server.start()
        if self._exporter is not None:
            self._exporter.start()
        return self

    @property
    def metrics_port(self) -> int:
        """The port of /metrics; 0 with metrics off."""
        return self._exporter.port if self._exporter is not None else 0

    def stop(self, grace_s: float | None = None) -> None:
        self._server.stop(grace_s).wait()
        if self._exporter is not None:
            self._exporter.stop()
        self.runner.stop()
        if self.connector is not None:
            self.connector.close()

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_engine(
    engine_config: EngineConfig,
    connector_config: StoreConnectorConfig,
    config: EngineServiceConfig,
) -> None:
    """Runs an engine process until SIGTERM or SIGINT, then lets streams finish and exits."""
    config.check_exposure(config.host)
    server = EngineServer(engine_config, connector_config, config).start()
    logger.info(
        "event=engine_serving address=%s model=%s store=%s",
        server.address,
        engine_config.model,
        connector_config.store or "-",
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    logger.info("event=engine_draining grace_s=%s", config.grace_s)
    server.stop(config.grace_s)
    logger.info("event=engine_stopped")
