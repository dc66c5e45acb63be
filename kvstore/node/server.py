"""A store node: its settings (`ServerConfig`), the gRPC service (grpc.aio) over
`kvstore.node.servicer.KVStoreServicer`, health, metrics, `serve()` and `EmbeddedServer`.

Beside it run the data planes (`kvstore.dataplane`: shared memory for clients on this host,
UCX for all) on their own threads: `DataPlaneInfo` hands a client a plane's address, and
bulk bytes then bypass gRPC entirely.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry

from kvstore import grpc_service, wire
from kvstore.auth import Authenticator, ListenerSecurity, add_port, check_listener, read_tokens
from kvstore.bounds import BoundsCollector, StreamSettings, StreamSlots
from kvstore.cluster.pool import Pool, advertised_host
from kvstore.cluster.settings import PoolSettings
from kvstore.config import option, parse_bytes, table
from kvstore.dataplane.base import DataPlaneServer
from kvstore.errors import InvalidArgumentError
from kvstore.metrics import CallMetrics, MetricsExporter, StoreCollector
from kvstore.node.servicer import KVStoreServicer
from kvstore.store import Clock, Store, StoreConfig
from kvstore.tenancy import Tenants
from kvstore.tenancy.settings import TenancySettings, load_quotas, make_tenants

log = logging.getLogger("kvstore.node.server")


@dataclass(frozen=True)
class ServerConfig:
    """Where and how the gRPC service listens; `security`: who may call; `tenancy`: what
    tenants may see and hold; `streams`: how many response streams stay open; `pool`: the
    global pool the node takes part in, if any."""

    security: ListenerSecurity = table(ListenerSecurity)
    tenancy: TenancySettings = table(TenancySettings)
    pool: PoolSettings = table(PoolSettings)
    # A stalled Get stream holds about 3.5 x chunk_bytes (its message, serialized, and the
    # transport's copy): about 56 MiB per client and 224 MiB in all with these defaults.
    streams: StreamSettings = table(StreamSettings, max_streams_per_client=16, max_streams=64)
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(50051, "gRPC port (0 picks a free one)")
    max_message_bytes: int = option(8 << 20, "largest gRPC message accepted or sent", parse_bytes)
    chunk_bytes: int = option(1 << 20, "size of the byte chunks streamed by Get", parse_bytes)
    grace_s: float = option(5.0, "on SIGTERM, how long in-flight calls may finish")
    expire_interval_s: float = option(1.0, "how often expired leases and reservations are swept")
    dataplane: str = option(
        "auto",
        "bulk byte transports: auto (shm for clients on this host, ucx if installed, and tcp), "
        "ucx, shm, tcp, none",
    )
    dataplane_tcp_port: int = option(0, "port of the tcp data plane on --host (0 picks a free one)")
    ucx_error_handling: bool = option(
        False, "UCX peer error handling (fails fast on a dead peer, but disables shared memory)"
    )
    transfer_timeout_s: float = option(30.0, "a data-plane transfer not done by then fails")
    max_dataplane_connections: int = option(1024, "most data-plane connections in all")
    max_dataplane_connections_per_peer: int = option(
        64, "most data-plane connections admitted for one client address"
    )
    max_unproven_sockets: int = option(
        256, "most data-plane sockets open that said no hello yet (the oldest silent is shed)"
    )
    max_unproven_sockets_per_peer: int = option(
        32, "most data-plane sockets from one address that said no hello yet"
    )
    max_calls_per_connection: int = option(
        256, "most calls open at once on one gRPC connection (HTTP/2 max concurrent streams)"
    )
    dataplane_hello_timeout_s: float = option(
        10.0, "a data-plane connection that sends no frame by then is dropped"
    )
    dataplane_idle_timeout_s: float = option(
        300.0, "a data-plane connection silent this long is dropped (clients ping every 30 s)"
    )
    max_shm_region_bytes: int = option(
        1 << 30, "largest shared-memory region a same-host client may hand over", parse_bytes
    )
    max_shm_regions: int = option(
        16, "most shared-memory regions one same-host connection may hand over (staging included)"
    )
    metrics_port: int = option(0, "port of the Prometheus /metrics endpoint on --host (0: off)")

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "dataplane_tcp_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise InvalidArgumentError(f"{name} out of range: {getattr(self, name)}")
        if self.dataplane not in ("auto", "ucx", "shm", "tcp", "none"):
            raise InvalidArgumentError(
                f"dataplane must be auto, ucx, shm, tcp or none: {self.dataplane!r}"
            )
        if self.max_shm_region_bytes < 64 << 10:
            raise InvalidArgumentError("max_shm_region_bytes must be at least 64KiB")
        if not 1 <= self.max_shm_regions <= 256:
            raise InvalidArgumentError("max_shm_regions must be 1 to 256")
        if self.transfer_timeout_s <= 0:
            raise InvalidArgumentError("transfer_timeout_s must be positive")
        if min(self.max_dataplane_connections, self.max_dataplane_connections_per_peer) < 1:
            raise InvalidArgumentError("data-plane connection limits must be >= 1")
        if not 1 <= self.max_unproven_sockets_per_peer <= self.max_unproven_sockets:
            raise InvalidArgumentError(
                "unproven socket limits need 1 <= max_unproven_sockets_per_peer "
                "<= max_unproven_sockets"
            )
        if self.max_calls_per_connection < 1:
            raise InvalidArgumentError("max_calls_per_connection must be >= 1")
        if min(self.dataplane_hello_timeout_s, self.dataplane_idle_timeout_s) <= 0:
            raise InvalidArgumentError("data-plane timeouts must be positive")
        if not 0 < self.chunk_bytes < self.max_message_bytes:
            raise InvalidArgumentError("chunk_bytes must be positive and below max_message_bytes")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_calls_per_connection),
        ]


def make_dataplanes(
    store: Store,
    config: ServerConfig,
    metrics: CallMetrics | None = None,
    tenants: Tenants | None = None,
) -> dict[str, DataPlaneServer]:
    """The node's data planes by transport name: "shm" for clients on this host, "ucx" (if
    installed, with `auto`) and "tcp", as `config.dataplane` says; empty when disabled."""
    from kvstore.dataplane.base import ServerSettings
    from kvstore.dataplane.servers import SERVERS
    from kvstore.dataplane.ucx.runtime import is_available, net_devices_for

    names = {"auto": ["shm", "ucx", "tcp"], "none": []}.get(config.dataplane, [config.dataplane])
    if config.dataplane == "auto" and not is_available():
        names.remove("ucx")
    settings = ServerSettings(
        timeout_s=config.transfer_timeout_s,
        error_handling=config.ucx_error_handling,
        net_devices=net_devices_for(config.host),
        max_connections=config.max_dataplane_connections,
        max_connections_per_peer=config.max_dataplane_connections_per_peer,
        max_unproven_sockets=config.max_unproven_sockets,
        max_unproven_sockets_per_peer=config.max_unproven_sockets_per_peer,
        hello_timeout_s=config.dataplane_hello_timeout_s,
        idle_timeout_s=config.dataplane_idle_timeout_s,
        max_region_bytes=config.max_shm_region_bytes,
        max_regions=config.max_shm_regions,
        host=config.host,
        tcp_port=config.dataplane_tcp_port,
    )
    planes = {name: SERVERS[name](store, settings, metrics, tenants) for name in names}
    log.info(
        "event=dataplane transports=%s ucx_error_handling=%s net_devices=%s",
        ",".join(names) or "none",
        config.ucx_error_handling,
        settings.net_devices or "all",
    )
    return planes


def _watch_sockets(bounds: BoundsCollector, dataplanes: Mapping[str, DataPlaneServer]) -> None:
    """Adds the unproven sockets of every plane that accepts sockets to `bounds`."""
    pools = (plane.unproven for plane in dataplanes.values())
    bounds.sockets.extend(pool for pool in pools if pool is not None)  # an empty pool is falsy


async def _expire_forever(store: Store, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        store.expire()


def start_metrics(
    store: Store, config: ServerConfig, bounds: BoundsCollector
) -> tuple[CallMetrics, MetricsExporter] | None:
    """The node's call metrics and its started /metrics endpoint (which also serves
    `bounds`); None with metrics off."""
    if not config.metrics_port:
        return None
    registry = CollectorRegistry()
    registry.register(StoreCollector(store.stats, store.tenant_bytes))
    registry.register(bounds)
    return CallMetrics(registry), MetricsExporter(
        registry, config.host, config.metrics_port
    ).start()


async def start_server(
    store: Store,
    config: ServerConfig,
    dataplanes: Mapping[str, DataPlaneServer] | None = None,
    metrics: CallMetrics | None = None,
    tenants: Tenants | None = None,
    streams: StreamSlots | None = None,
    auth: Authenticator | None = None,
    pool: Pool | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Starts the service for `store` (its `tenants`: none by default; `streams`: the slots of
    its response streams, from `config` by default; `auth`: the tokens read as the node
    started, read here if not; `pool`: the global pool it answers lookups from, joined
    once the port is known); returns the server, its health servicer and port."""
    server = grpc.aio.server(options=config.grpc_options)
    auth = auth or read_tokens(config.security)
    if streams is None:
        streams = StreamSlots(config.streams.limits, "kvstore")
    servicer = KVStoreServicer(store, config.chunk_bytes, dataplanes or {}, tenants, auth, pool)
    # Malformed requests: INVALID_ARGUMENT; without a known token: UNAUTHENTICATED.
    grpc_service.register(server, servicer, metrics=metrics, auth=auth, streams=streams)
    health_servicer = health.aio.HealthServicer()
    health_service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    # Health stays open: probes carry no tokens, and it tells nothing about any namespace.
    # Its Watch streams count in the same slots, by peer.
    grpc_service.register(server, health_servicer, health_service, health_pb2, streams=streams)
    port = add_port(server, config.address, config.security)
    await server.start()
    if pool is not None:
        address = f"{advertised_host(config.pool, config.host)}:{port}"
        await asyncio.to_thread(pool.start, {"grpc": address})
    for service in ("", wire.SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


def make_store(
    store_config: StoreConfig,
    config: ServerConfig,
    auth: Authenticator,
    clock: Clock = time.monotonic,
) -> tuple[Store, Tenants]:
    """The node's store, with the quotas of its tenants, and its tenants (closing the store
    if they are refused: quotas over a tier, a role without a token)."""
    if config.pool.cluster and auth.table is not None and not config.tenancy.tenant_secret_file:
        raise InvalidArgumentError(
            "--cluster with --auth-token-file needs --tenant-secret-file: every node of the "
            "pool must derive the same namespace ids"
        )
    store = Store(store_config, clock=clock, quotas=load_quotas(config.tenancy, auth))
    try:
        return store, make_tenants(config.tenancy, store, auth)
    except BaseException:
        store.close()
        raise


def make_pool(store: Store, config: ServerConfig) -> Pool | None:
    """The node's part in the global pool `config.pool.cluster` (None: a node alone)."""
    if not config.pool.cluster:
        return None
    capacity = {"dram": store.config.dram_bytes, "ssd": store.config.ssd_bytes}
    return Pool(store, config.pool, capacity)


async def serve(store_config: StoreConfig, config: ServerConfig) -> None:
    """Runs a store node until SIGTERM or SIGINT, then drains in-flight calls and exits."""
    check_listener(config.security, config.host)
    auth = read_tokens(config.security)  # once: the store's quotas and every call use it
    store, tenants = make_store(store_config, config, auth)
    streams = StreamSlots(config.streams.limits, "kvstore")
    bounds = BoundsCollector([streams])
    metrics = start_metrics(store, config, bounds)
    call_metrics = metrics[0] if metrics else None
    dataplanes = make_dataplanes(store, config, call_metrics, tenants)
    _watch_sockets(bounds, dataplanes)
    pool = make_pool(store, config)
    started = await start_server(
        store, config, dataplanes, call_metrics, tenants, streams, auth, pool
    )
    server, health_servicer, port = started
    log.info(
        "event=serving address=%s:%d dram_bytes=%d policy=%s",
        config.host,
        port,
        store_config.dram_bytes,
        store_config.policy,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    expirer = asyncio.create_task(_expire_forever(store, config.expire_interval_s))
    await stop.wait()
    log.info("event=draining grace_s=%s", config.grace_s)
    await health_servicer.enter_graceful_shutdown()
    if pool is not None:
        await asyncio.to_thread(pool.stop)  # out of the pool first: readers go elsewhere
    await server.stop(config.grace_s)
    for dataplane in dataplanes.values():
        dataplane.stop()
    if metrics is not None:
        metrics[1].stop()
    expirer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await expirer
    num_blocks = store.stats().num_blocks
    store.close()  # stops the demoter, flushes and closes the SSD tier
    log.info("event=stopped blocks=%d", num_blocks)


class EmbeddedServer:
    """A store node served from a background thread of this process, for demos and tests.

    `clock` is the store's (`Store.clock`): tests move it to expire leases and reservations.

    Example:
        >>> with EmbeddedServer(StoreConfig(dram_bytes=256 << 20)) as server:
        ...     client = Client(server.address)
    """

    def __init__(
        self,
        store_config: StoreConfig,
        config: ServerConfig | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config or ServerConfig(port=0)
        self.auth = read_tokens(self.config.security)
        self.store, self.tenants = make_store(store_config, self.config, self.auth, clock)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None
        self.dataplanes: dict[str, DataPlaneServer] = {}  # by transport, while started
        self._metrics: tuple[CallMetrics, MetricsExporter] | None = None
        self.streams = StreamSlots(self.config.streams.limits, "kvstore")
        self.pool: Pool | None = None  # while started, in a pool
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def metrics_port(self) -> int:
        """The port of /metrics (`ServerConfig.metrics_port`, resolved); 0 with metrics off."""
        return self._metrics[1].port if self._metrics else 0

    def start(self) -> EmbeddedServer:
        self._thread.start()
        bounds = BoundsCollector([self.streams])
        self._metrics = start_metrics(self.store, self.config, bounds)
        call_metrics = self._metrics[0] if self._metrics else None
        self.dataplanes = make_dataplanes(self.store, self.config, call_metrics, self.tenants)
        _watch_sockets(bounds, self.dataplanes)
        self.pool = make_pool(self.store, self.config)
        started = asyncio.run_coroutine_threadsafe(
            start_server(
                self.store,
                self.config,
                self.dataplanes,
                call_metrics,
                self.tenants,
                self.streams,
                self.auth,
                self.pool,
            ),
            self._loop,
        )
        self._server, _, self.port = started.result()
        return self

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result()
            self._server = None
        for dataplane in self.dataplanes.values():
            dataplane.stop()
        self.dataplanes = {}
        if self._metrics is not None:
            self._metrics[1].stop()
            self._metrics = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self.store.close()

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
