"""`ConductorServer`: the conductor, its HTTP API and its gRPC service on one event loop;
`serve_conductor` runs it as `kvstore conductor` until SIGTERM or SIGINT.

At start every engine must answer Load within `ready_timeout_s`: its role places it in the
view (`Roles.of`) and its block size fixes the KV namespace block keys are computed in
(`gpu_engine.config.EngineConfig(...).namespace`, the one the engines publish under). A
profile made for another block size (the built-in `datacenter` has 512-token blocks) is
rescaled to the engines' blocks: per-token costs stay, block counts are converted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import ssl

import grpc
from aiohttp import web

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import ListenerSecurity, add_port, check_listener, read_token_file, read_tokens
from kvstore.bounds import StreamSlots
from kvstore.client.async_client import AsyncClient
from kvstore.conductor.base import PolicyContext
from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.front.conductor import Conductor, Roles
from kvstore.conductor.front.config import ConductorConfig
from kvstore.conductor.front.engine_handle import EngineBackend, EngineHandle, EngineStatus
from kvstore.conductor.front.grpc_api import SERVICE, ConductorServicer
from kvstore.conductor.front.http_api import HttpApi
from kvstore.conductor.front.live_view import LiveCluster, LiveDecode, LivePrefill
from kvstore.conductor.front.metrics import ConductorMetrics
from kvstore.conductor.front.openai_backend import OpenAIBackend, is_backend_address
from kvstore.conductor.profile import CostProfile, resolve_profile
from kvstore.conductor.registry import make_scheduling_policy
from kvstore.errors import InvalidArgumentError, KVStoreError, UnavailableError
from kvstore.grpc_service import register
from kvstore.keys import Namespace

log = logging.getLogger("kvstore.conductor")
HEALTH_TIMEOUT_S = 2.0
READY_POLL_S = 0.1


class ConductorServer:
    """Everything `kvstore conductor` runs; `await start()`, then `await stop()`.

    Args:
        config: what to front and where to listen.
        profile: the cost profile; default: `config.profile` resolved.

    Attributes: `streams`, the response streams' slots, HTTP and gRPC together; after
    start: `conductor`, `metrics`, `http_port`, `grpc_port` (-1: none).
    """

    def __init__(self, config: ConductorConfig, profile: CostProfile | None = None) -> None:
        self.config = config
        self._profile = profile
        self.http_port = -1
        self.grpc_port = -1
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._store: AsyncClient | None = None
        self._auth = read_tokens(config.security)
        self.streams = StreamSlots(config.streams.limits, "conductor")
        self.engines: list[EngineBackend] = []

    async def start(self) -> ConductorServer:
        c = self.config
        addresses = c.engine_addresses
        self.engines = [self._engine(a) for a in addresses]
        statuses = await asyncio.gather(*(self._ready(e) for e in self.engines))
        block_tokens = _block_tokens(addresses, statuses)
        profile = _for_blocks(self._profile or resolve_profile(c.profile), block_tokens)
        namespace = _namespace(c, block_tokens)
        self._store = await self._open_store(namespace)
        self.conductor = self._conductor(profile, namespace, Roles.of([s.role for s in statuses]))
        self.metrics = ConductorMetrics(addresses)
        roles = self.conductor.roles
        self.metrics.watch(self.conductor.cluster, roles.prefill, roles.decode)
        self.metrics.watch_streams(self.streams)
        self.conductor.listeners.append(self.metrics.observe)
        self.conductor.replication_listeners.append(self.metrics.replicated)
        await self.conductor.warm_up(c.warmup_rounds)  # before any request can arrive
        await self._start_http(addresses)
        await self._start_grpc()
        log.info(
            "event=conductor_serving http=%s:%d grpc_port=%d policy=%s prefill=%s decode=%s",
            c.host, self.http_port, self.grpc_port, c.policy,
            ",".join(addresses[i] for i in roles.prefill),
            ",".join(addresses[i] for i in roles.decode),
        )  # fmt: skip
        return self

    def _engine(self, address: str) -> EngineBackend:
        c = self.config
        if is_backend_address(address):
            return OpenAIBackend(address, c.engine_timeout_s, c.backend_block_tokens)
        token = read_token_file(c.engine_token_file) if c.engine_token_file else ""
        return EngineHandle(address, c.engine_timeout_s, token, c.engine_tls_ca)

    def _conductor(self, profile: CostProfile, namespace: Namespace, roles: Roles) -> Conductor:
        c = self.config
        cost = CostModel(profile)
        prefills = [LivePrefill(profile.prefill_cache_blocks) for _ in roles.prefill]
        decodes = [LiveDecode(profile.decode_kv_capacity_tokens) for _ in roles.decode]
        cluster = LiveCluster(cost, prefills, decodes, c.speed_window, c.speed_max_age_s)
        policy = make_scheduling_policy(c.policy, PolicyContext(cost, c.slo, c.seed))
        return Conductor(self.engines, roles, cluster, policy, namespace, self._store, seed=c.seed)

    async def _ready(self, engine: EngineBackend) -> EngineStatus:
        """The engine's Load, retried until `ready_timeout_s` (engines start slowly)."""
        deadline = asyncio.get_running_loop().time() + self.config.ready_timeout_s
        while True:
            try:
                return await engine.load(timeout_s=HEALTH_TIMEOUT_S)
            except UnavailableError:
                if asyncio.get_running_loop().time() > deadline:
                    raise UnavailableError(f"engine {engine.address} did not answer") from None
                await asyncio.sleep(READY_POLL_S)

    async def _open_store(self, namespace: Namespace) -> AsyncClient | None:
        if not self.config.store:
            return None
        c = self.config
        token = read_token_file(c.store_token_file) if c.store_token_file else ""
        store = AsyncClient(c.store, transport="grpc", auth_token=token, tls_ca=c.store_tls_ca)
        await store.register_namespace(namespace)  # idempotent; Match needs it known
        return store

    async def _start_http(self, addresses: list[str]) -> None:
        c = self.config
        api = HttpApi(
            self.conductor, self.metrics, c.slo, self.health, addresses, self._auth, self.streams
        )
        # A client that hangs up cancels its handler: its request is aborted on the engines
        # (a stream notices at its next write; a whole answer would otherwise run to its end).
        self._runner = web.AppRunner(api.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, c.host, c.port, ssl_context=_ssl_context(c.security))
        await site.start()
        server = site._server
        assert server is not None and server.sockets, "the HTTP site is listening"  # type: ignore[attr-defined]
        self.http_port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def _start_grpc(self) -> None:
        if self.config.grpc_port < 0:
            return
        c = self.config
        self._grpc = grpc.aio.server()
        servicer = ConductorServicer(self.conductor, c.slo)
        register(self._grpc, servicer, SERVICE, pb, auth=self._auth, streams=self.streams)
        self.grpc_port = add_port(self._grpc, f"{c.host}:{c.grpc_port}", c.security)
        await self._grpc.start()

    async def health(self) -> dict[str, bool]:
        """Each engine's address and whether it answered Load within 2 s."""

        async def answers(engine: EngineBackend) -> bool:
            try:
                await engine.load(timeout_s=HEALTH_TIMEOUT_S)
            except KVStoreError:
                return False
            return True

        found = await asyncio.gather(*(answers(e) for e in self.engines))
        return dict(zip((e.address for e in self.engines), found, strict=True))

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._store is not None:
            await self._store.close()
        for engine in self.engines:
            await engine.close()


def _ssl_context(security: ListenerSecurity) -> ssl.SSLContext | None:
    """The HTTP side's TLS, from the same --tls-* flags as the gRPC side's."""
    if not security.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_client_ca:
        context.load_verify_locations(security.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _block_tokens(addresses: list[str], statuses: list[EngineStatus]) -> int:
    sizes = {s.block_tokens for s in statuses}
    if len(sizes) != 1:
        found = dict(zip(addresses, (s.block_tokens for s in statuses), strict=True))
        raise InvalidArgumentError(f"engines disagree on block_tokens: {found}")
    return sizes.pop()


def _namespace(c: ConductorConfig, block_tokens: int) -> Namespace:
    from gpu_engine.config import EngineConfig  # torch: only where a conductor runs

    engine = EngineConfig(
        model=c.model,
        model_id=c.model_id,
        dtype=c.dtype,
        tenant_salt=c.tenant_salt,
        block_tokens=block_tokens,
        page_tokens=block_tokens,
    )
    return engine.namespace


def _for_blocks(profile: CostProfile, block_tokens: int) -> CostProfile:
    """`profile` with `block_tokens`-token blocks: per-token costs kept, capacities in
    blocks converted (the same bytes)."""
    if profile.block_tokens == block_tokens:
        return profile
    log.warning(
        "event=profile_rescaled profile_block_tokens=%d engine_block_tokens=%d",
        profile.block_tokens,
        block_tokens,
    )
    scale = profile.block_tokens / block_tokens
    return dataclasses.replace(
        profile,
        block_tokens=block_tokens,
        prefill_cache_blocks=int(profile.prefill_cache_blocks * scale),
        pool_capacity_blocks=int(profile.pool_capacity_blocks * scale),
    )


def serve_conductor(config: ConductorConfig) -> None:
    """Runs a conductor until SIGTERM or SIGINT."""

    check_listener(config.security, config.host)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # before "serving" is logged
            loop.add_signal_handler(sig, stop.set)
        server = await ConductorServer(config).start()
        await stop.wait()
        log.info("event=conductor_draining")
        await server.stop()
        log.info("event=conductor_stopped")

    asyncio.run(main())
    # torch's objects (imported for the namespace) make the interpreter's last collection
    # take seconds; nothing left needs finalizing, so exit without it.
    gc.freeze()
