"""`EngineHandle`: the conductor's asyncio client of one engine process (Generate, Load).

`gpu_engine.engine_client.EngineClient` blocks a thread per stream; the conductor serves
every request on one event loop, so it calls engines over `grpc.aio` instead, with the same
wire messages and the same error mapping (`raise_rpc_error`). Protobuf types stop here.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import NamedTuple, Protocol

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.auth import open_aio_channel
from kvstore.client.common import raise_rpc_error


class EngineStatus(NamedTuple):
    """What the conductor reads from an engine's Load: its role and its size."""

    role: str
    block_tokens: int
    num_pages: int
    num_running: int
    num_waiting: int
    store_connected: bool


class EngineChunk(NamedTuple):
    """One Generate message: new tokens; on the last one the finish reason and usage."""

    token_ids: tuple[int, ...]
    finish_reason: str  # "" while running
    cached_tokens: int = 0
    num_published_tokens: int = 0


class EngineBackend(Protocol):
    """What the conductor calls on an engine: `EngineHandle` (a `kvstore engine` process)
    or `openai_backend.OpenAIBackend` (an OpenAI-compatible server)."""

    address: str

    async def load(self, timeout_s: float | None = None) -> EngineStatus:
        """Its role and size; UnavailableError when it does not answer."""

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        temperature: float,
        seed: int | None,
        num_published_tokens: int = 0,
    ) -> AsyncGenerator[EngineChunk, None]:
        """Its messages for one request; the last has the finish reason. Closing the
        generator ends the request on the engine."""

    async def prefetch(self, prompt: Sequence[int]) -> int | None:
        """Loads the store's blocks of `prompt` that its prefix cache lacks into it; the
        tokens it loaded, or None where the engine cannot prefetch."""

    async def close(self) -> None:
        """Releases its connections."""


class EngineHandle:
    """One engine process, by address; `close` when done.

    Args:
        address: "host:port" of `kvstore engine`.
        timeout_s: deadline of one Generate stream or Load call.
        auth_token: bearer token, for an engine started with --auth-token-file.
        tls_ca: PEM CA of the engine's certificate: connect over TLS.
    """

    def __init__(
        self, address: str, timeout_s: float, auth_token: str = "", tls_ca: str = ""
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_aio_channel(address, auth_token=auth_token, tls_ca=tls_ca)
        self._stub = pb_grpc.EngineServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def load(self, timeout_s: float | None = None) -> EngineStatus:
        """The engine's Load; the typed error of the call when it fails (UnavailableError
        when the engine does not answer)."""
        try:
            msg = await self._stub.Load(pb.LoadRequest(), timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as err:
            raise_rpc_error(err)
        return EngineStatus(
            msg.role or "both",
            msg.block_tokens,
            msg.num_pages,
            msg.num_running,
            msg.num_waiting,
            msg.store_connected,
        )

    async def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        temperature: float,
        seed: int | None,
        num_published_tokens: int = 0,
    ) -> AsyncGenerator[EngineChunk, None]:
        """Streams one request's messages; the call is cancelled if the caller stops early.

        Raises:
            InvalidArgumentError: the engine refused the request (e.g. a token id outside
                its vocabulary).
            UnavailableError: the engine is unreachable, or as prefill could not commit
                the prompt's blocks in the store.
        """
        request = pb.GenerateRequest(
            prompt_token_ids=list(prompt),
            max_tokens=max_tokens,
            temperature=temperature,
            num_published_tokens=num_published_tokens,
        )
        if seed is not None:
            request.seed = seed
        call = self._stub.Generate(request, timeout=self.timeout_s)
        try:
            async for msg in call:
                yield EngineChunk(
                    tuple(msg.token_ids),
                    msg.finish_reason,
                    msg.usage.cached_tokens,
                    msg.num_published_tokens,
                )
        except grpc.RpcError as err:
            raise_rpc_error(err)
        finally:
            with contextlib.suppress(Exception):
                call.cancel()

    async def prefetch(self, prompt: Sequence[int]) -> int | None:
        request = pb.GenerateRequest(prompt_token_ids=list(prompt), max_tokens=1, prefetch=True)
        try:
            reply = [msg async for msg in self._stub.Generate(request, timeout=self.timeout_s)]
        except grpc.RpcError as err:
            raise_rpc_error(err)
        return reply[-1].usage.store_cached_tokens if reply else 0
