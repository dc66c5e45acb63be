"""Which path a client's transfers take, for both clients: its open data-plane connection,
gRPC, or a connection to open now. The clients do the opening (on the caller's thread or a
worker thread) under their own lock; what each outcome means is decided here once.

Transport "auto" falls back to gRPC when the node refuses a handshake and asks again when
`HandshakeRetry` says; where no data plane can ever be reached from here it stays on gRPC
for good. Transports "shm", "ucx" and "tcp" raise instead.
"""

from __future__ import annotations

from kvstore import errors
from kvstore.client.common import TRANSPORT_CHOICES
from kvstore.dataplane.base import DataPlaneClient
from kvstore.dataplane.retry import HandshakeRetry
from kvstore.dataplane.selection import Selection


class DataPlanes:
    """The data-plane state of one client; not thread-safe (the client holds its lock)."""

    def __init__(
        self, transport: str, address: str, timeout_s: float, retry: HandshakeRetry | None
    ) -> None:
        if transport not in TRANSPORT_CHOICES:
            raise errors.InvalidArgumentError(f"transport must be one of {TRANSPORT_CHOICES}")
        self.transport = transport
        self.address = address
        self.retry = retry or HandshakeRetry()
        self.selection = Selection(transport, address, timeout_s)
        self.connection: DataPlaneClient | None = None

    @property
    def plane(self) -> str:
        """The path transfers take now: "shm", "ucx", "tcp" or "grpc"."""
        connection = self.connection
        return connection.plane if connection is not None and connection.is_open else "grpc"

    def must_open(self) -> bool:
        """Whether the caller should open a connection now (`selection.open`): not while
        one is open, on gRPC, or before a refused handshake's retry is due."""
        if self.transport == "grpc" or (self.connection is not None and self.connection.is_open):
            return False
        return self.transport != "auto" or self.retry.is_due

    def current(self) -> DataPlaneClient | None:
        """The open connection; None: gRPC."""
        connection = self.connection
        return connection if connection is not None and connection.is_open else None

    def opened(self, connection: DataPlaneClient) -> DataPlaneClient:
        self.connection = connection
        self.retry.succeeded()
        return connection

    def refused(self, exc: Exception) -> None:
        """After `selection.open` raised one of `retry.REFUSALS`: re-raises it unless the
        transport is "auto", which takes gRPC until the retry is due (or for good)."""
        if self.transport != "auto":
            raise exc
        if not self.retry.refused(self.address, exc, self.selection.can_succeed):
            self.transport = "grpc"  # no data plane reachable from here: for good

    def take(self) -> DataPlaneClient | None:
        """The connection, for the client to close; none is left."""
        connection, self.connection = self.connection, None
        return connection
