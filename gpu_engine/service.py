"""The engine process: `EngineService` over gRPC (Generate, Load) in front of an `EngineRunner`.

A grpc.aio server on an event loop thread of its own: each Generate call submits its request
to the runner and streams the tokens the engine thread samples, handed to the loop without
blocking it (`_LatestOutput`). The service is registered through `kvstore.grpc_service`, so
a call without a known token ends UNAUTHENTICATED, and each Generate stream takes a slot of
its client (its tenant, or its connection) and of the engine (`StreamSettings`): past a
bound a new stream ends RESOURCE_EXHAUSTED (`TooManyStreamsError`), and a reader that takes
nothing for `stream_stall_timeout_s` has its stream ended (`StreamStalledError`). A stream
that ends before its request does, however (cancelled, gone, stalled), aborts the request:
the engine stops computing it and frees its pages. Protobuf types stop here and in
`gpu_engine.engine_client`.

Disaggregated, a conductor sends a request to a `--role prefill` engine, whose stream
carries the first token and ends (finish reason "prefill") with `num_published_tokens`
once the prompt's blocks are in the store, then sends the same request with that count to a
`--role decode` engine, which streams all max_tokens tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

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
from kvstore import errors, grpc_service
from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import ListenerSecurity, add_port, check_listener, read_tokens
from kvstore.bounds import BoundsCollector, StreamSettings, StreamSlots
from kvstore.config import option, table
from kvstore.metrics import EngineMetrics, MetricsExporter

logger = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["EngineService"]
T = TypeVar("T")


@dataclass(frozen=True)
class EngineServiceConfig:
    """Where the engine listens; `security`: who may call it; `streams`: how many Generate
    streams it serves at once."""

    security: ListenerSecurity = table(ListenerSecurity)
    # One conductor is usually an engine's only client: half of max_streams leaves room
    # for a second one (the store's default, 32, would refuse a busy conductor).
    streams: StreamSettings = table(StreamSettings, max_streams_per_client=128)
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50061, "gRPC port of the EngineService; 0 picks a free one")
    grace_s: float = option(5.0, "on SIGTERM, how long running streams may finish")
    metrics_port: int = option(0, "port of the Prometheus /metrics endpoint on --host (0: off)")

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise errors.InvalidArgumentError(f"{name} must be in [0, 65536)")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


# The one mapping of engine errors to the wire: each travels as the store error of its
# status code, so `kvstore.client.common.raise_rpc_error` raises that class in the client.
_WIRE_ERRORS: MappingProxyType[type[EngineError], type[errors.KVStoreError]] = MappingProxyType(
    {
        InvalidRequestError: errors.InvalidArgumentError,
        BlockSizeError: errors.InvalidArgumentError,
        OutOfPagesError: errors.ResourceExhaustedError,
        PublishError: errors.UnavailableError,  # the store did not take the blocks in time
        EngineFailedError: errors.UnavailableError,
    }
)


async def _abort(context: grpc.aio.ServicerContext, exc: EngineError) -> None:
    """Ends the call with the wire error of `exc` (INTERNAL for one not in the mapping)."""
    wire = next((w for cls, w in _WIRE_ERRORS.items() if isinstance(exc, cls)), None)
    wire = wire if wire is not None else errors.KVStoreError
    await grpc_service.abort(context, wire(str(exc)))


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


class _LatestOutput:
    """One request's `OutputSink`: the engine thread puts, an event loop `take`s.

    A request's outputs are cumulative (each holds every token so far), so a newer one
    replaces one not taken yet: however slowly its reader takes them, a request holds at
    most one output here, not one per token. Nothing follows the last output (finished, or
    an error: `OutputSink`), so that one is never replaced.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._item: RequestOutput | EngineError | None = None
        self._ready = asyncio.Event()  # touched on the loop only

    def put(self, item: RequestOutput | EngineError) -> None:
        with self._lock:
            self._item = item
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody takes it
            self._loop.call_soon_threadsafe(self._ready.set)

    async def take(self) -> RequestOutput | EngineError:
        """The newest output not taken yet, waiting for one without blocking the loop."""
        while True:
            self._ready.clear()  # a put after this sets it again (a stale set: one more turn)
            with self._lock:
                item, self._item = self._item, None
            if item is not None:
                return item
            await self._ready.wait()


class EngineServicer:
    """Generate and Load over one `EngineRunner`, for `kvstore.grpc_service.register`."""

    def __init__(self, runner: EngineRunner, metrics: EngineMetrics | None = None) -> None:
        self.runner = runner
        self.metrics = metrics

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            params = _params(request)
        except (EngineError, ValueError) as exc:
            await _abort(context, InvalidRequestError(str(exc)))
        outputs = _LatestOutput(asyncio.get_running_loop())
        prompt, num_published = list(request.prompt_token_ids), request.num_published_tokens
        self.runner.submit_to(outputs, prompt, params, num_published, request.prefetch)
        try:
            num_sent = 0
            while True:
                out = await outputs.take()
                if isinstance(out, RequestAbortedError):
                    return  # cancelled, not by this stream: nothing more comes
                if isinstance(out, EngineError):
                    await _abort(context, out)
                assert isinstance(out, RequestOutput), f"unexpected stream item {out!r}"
                yield _response(out, num_sent, request.return_logits)
                num_sent = len(out.output_token_ids)
                if out.finished:
                    if self.metrics is not None:
                        self.metrics.finished(out)
                    return
        finally:
            # However the stream ends (finished, cancelled, gone, stalled), the engine is
            # freed of the request: a no-op where it finished first.
            self.runner.cancel(outputs)

    async def Load(
        self, request: pb.LoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadResponse:
        return pb.LoadResponse(**self.runner.load()._asdict())


class EngineServer:
    """An engine, its store connector, its runner thread and its gRPC server (grpc.aio, on an
    event loop thread of its own).

    Attributes: `runner`; `streams`, the slots of its Generate streams.

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
        self.streams = StreamSlots(config.streams.limits, "engine")
        self._auth = read_tokens(config.security)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-grpc", daemon=True
        )
        self._server: grpc.aio.Server | None = None
        self._exporter: MetricsExporter | None = None
        self._metrics: EngineMetrics | None = None
        if config.metrics_port:
            registry = CollectorRegistry()
            self._metrics = EngineMetrics(registry, self.runner.load)
            registry.register(BoundsCollector([self.streams]))
            self._exporter = MetricsExporter(registry, config.host, config.metrics_port)
        self.port = 0  # resolved by `start`

    @property
    def address(self) -> str:
        """host:port, once started."""
        return f"{self.config.host}:{self.port}"

    def start(self) -> EngineServer:
        self.runner.start()
        self._thread.start()
        self._server, self.port = self._call(self._start_grpc())
        if self._exporter is not None:
            self._exporter.start()
        return self

    async def _start_grpc(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()  # bound to this loop: made on it
        servicer = EngineServicer(self.runner, self._metrics)
        grpc_service.register(server, servicer, SERVICE, pb, auth=self._auth, streams=self.streams)
        port = add_port(server, self.config.address, self.config.security)
        await server.start()
        return server, port

    @property
    def metrics_port(self) -> int:
        """The port of /metrics; 0 with metrics off."""
        return self._exporter.port if self._exporter is not None else 0

    def stop(self, grace_s: float | None = None) -> None:
        """Refuses new calls, lets running ones finish for `grace_s` (None: ends them now),
        then stops the engine; the streams it ended abort their requests."""
        if self._server is not None:
            self._call(self._server.stop(grace_s))
            self._server = None
        if self._exporter is not None:
            self._exporter.stop()
        self.runner.stop()
        if self._thread.is_alive():
            self._call(self._loop.shutdown_asyncgens())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()
        if self.connector is not None:
            self.connector.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the server's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

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
    check_listener(config.security, config.host)
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
