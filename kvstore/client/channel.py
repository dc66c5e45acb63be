"""The channel both clients hold: one gRPC channel to a node, its stubs, and the data planes
`get_into`/`put` move bytes over. `Client` and `AsyncClient` differ only in how they wait."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpc_health.v1 import health_pb2_grpc

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.common import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    channel_options,
)
from kvstore.client.data_planes import DataPlanes
from kvstore.dataplane.retry import HandshakeRetry


class NodeChannel:
    """A node's address, channel, stubs and data planes (`Client` says what each argument
    means); a subclass names how it opens the channel and the lock its calls share."""

    open_channel: Callable[..., Any]  # kvstore.auth's open_channel or open_aio_channel
    new_lock: Callable[[], Any]  # threading.Lock or asyncio.Lock

    def __init__(
        self,
        address: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        transport: str = "auto",
        auth_token: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        dataplane_retry: HandshakeRetry | None = None,
    ) -> None:
        self._planes = DataPlanes(transport, address, timeout_s, dataplane_retry)
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._lock = self.new_lock()
        options = channel_options(max_message_bytes)
        self._channel = self.open_channel(address, options, auth_token, tls_ca, tls_cert, tls_key)
        self._stubs = {
            "store": pb_grpc.KVStoreStub(self._channel),
            "health": health_pb2_grpc.HealthStub(self._channel),
        }

    @property
    def transport(self) -> str:
        """The transport asked for; "grpc" once "auto" found no data plane reachable."""
        return self._planes.transport

    @property
    def dataplane_retry(self) -> HandshakeRetry:
        return self._planes.retry

    @property
    def plane(self) -> str:
        """The path `get_into`/`put` take now: "shm", "ucx", "tcp" or "grpc"."""
        return self._planes.plane
