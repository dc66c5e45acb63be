"""The data-plane contract: how bulk block bytes move between a client and a store node.

The control plane (gRPC) tells a client where a node's data plane listens and hands it a
connection id; everything after that — requests, block bytes, replies — goes over the
transport. A node starts the servers of `kvstore.dataplane.servers`; a client picks its plane in
`kvstore.dataplane.selection`.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvstore import errors
from kvstore.results import ReserveResult

if TYPE_CHECKING:  # the node's side only: a client never loads the bounds
    from kvstore.bounds import UnprovenSockets

ChecksumMismatchError = errors.ChecksumMismatchError  # raised by Reservation.commit


@dataclass(frozen=True)
class ServerSettings:
    """How a node's data plane runs and what it lets clients hold (from `ServerConfig`)."""

    timeout_s: float = 30.0  # a transfer not done by then fails and drops its connection
    error_handling: bool = False  # UCX peer error handling (disables shared memory)
    net_devices: str = ""  # UCX_NET_DEVICES of the worker; empty: every interface
    max_connections: int = 1024
    max_connections_per_peer: int = 64  # admissions (authenticated handshakes) per address
    max_unproven_sockets: int = 256  # sockets with no hello yet, in all (`UnprovenSockets`)
    max_unproven_sockets_per_peer: int = 32  # and from one address
    max_address_bytes: int = 8192
    hello_timeout_s: float = 10.0  # a connection that never sends a frame is dropped
    idle_timeout_s: float = 300.0  # and one that sends none for this long
    max_region_bytes: int = 1 << 30  # largest shared-memory region a same-host client maps
    max_regions: int = 16  # most regions one same-host connection hands over
    host: str = "127.0.0.1"  # where the tcp plane listens (the node's --host)
    tcp_port: int = 0  # and on which port (0: a free one)


class Admission(NamedTuple):
    """What a client learns from the handshake: a connection id (for logs only) and the
    secret every tag of the connection is derived from."""

    client_id: int
    secret: bytes


class DataPlaneServer(ABC):
    """A store node's side: receives requests and moves bytes to and from tier slots.

    Runs on its own thread; every method is safe to call from any thread.
    """

    @property
    @abstractmethod
    def address(self) -> bytes:
        """Opaque address a client needs to reach this server (e.g. a UCX worker address)."""

    @property
    def unproven(self) -> UnprovenSockets | None:
        """The sockets this plane accepted that said no hello yet; None for a plane that
        accepts none (its connections are made by the authenticated handshake)."""
        return None

    @abstractmethod
    def connect(self, client_address: bytes, peer: str, tenant: str = "") -> Admission:
        """Admits a client reachable at `client_address`, calling from `peer` (its network
        identity, for per-peer limits), authenticated as `tenant` by the handshake: every
        frame of the connection acts as that tenant ("": a node without tenants).

        Raises InvalidArgumentError for an address the transport cannot use (checked where
        it cannot harm this process), TooManyConnectionsError past a connection limit,
        UnavailableError if the client cannot be reached.
        """

    @abstractmethod
    def stop(self) -> None:
        """Drops every connection; leases and reservations of unfinished calls are ended."""


class DataPlaneClient(ABC):
    """A client's side. Every call has a deadline: a dead peer raises, never hangs.

    After a DeadlineExceededError or UnavailableError the connection is closed and the
    caller should make a new client; the buffers of a failed get hold unspecified bytes.
    """

    plane = ""  # the transport's name in `servers.SERVERS`

    @abstractmethod
    def submit_get_into(
        self, namespace_id: bytes, keys: Sequence[bytes], buffers: Sequence[Any], block_bytes: int
    ) -> concurrent.futures.Future[tuple[bool, ...]]:
        """Receives each committed block of `keys` straight into `buffers[i]`, without
        waiting: the future gives which keys were found, and calls can be pipelined.

        A missed key's buffer is left untouched. A block whose bytes do not match the
        CRC32C the node sent for it is reported missed too (its buffer then holds
        unspecified bytes). The store holds a lease on the blocks until they have arrived.
        """

    @abstractmethod
    def submit_get_parts(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parts: Sequence[Sequence[Any]],
        block_bytes: int,
        on_part: Callable[[int], None] | None = None,
    ) -> concurrent.futures.Future[tuple[bool, ...]]:
        """`submit_get_into` in `len(parts)` equal parts per block: part s of key i lands
        in `parts[s][i]` (block_bytes / len(parts) bytes), and part s of every found block
        arrives before any block's part s + 1. So a block laid out layer after layer can
        land straight in per-layer memory, and a reader can use layer s early:
        `on_part(s)` is called (on the transport's thread; it must be quick) once part s
        of every found block has landed. Those bytes are not checked yet: a block is
        checked against its CRC32C when its last part lands, and the future's flags say
        which blocks were found and whole, as `submit_get_into`'s do.
        """

    @abstractmethod
    def submit_put(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes | None] | None,
        block_bytes: int,
    ) -> concurrent.futures.Future[ReserveResult]:
        """Reserves, sends the blocks to reserve into their slots, verifies and commits,
        without waiting.

        Keys already present or in flight are skipped (their statuses say so). On any
        failure nothing of this call becomes visible.
        """

    def get_into(
        self, namespace_id: bytes, keys: Sequence[bytes], buffers: Sequence[Any], block_bytes: int
    ) -> tuple[bool, ...]:
        """`submit_get_into`, waited for."""
        return self.submit_get_into(namespace_id, keys, buffers, block_bytes).result()

    def put(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes | None] | None,
        block_bytes: int,
    ) -> ReserveResult:
        """`submit_put`, waited for."""
        return self.submit_put(namespace_id, keys, blocks, parents, block_bytes).result()

    @property
    @abstractmethod
    def is_open(self) -> bool:
        """False once closed or broken by a failed transfer."""

    @abstractmethod
    def close(self) -> None:
        """Tells the server goodbye and frees the connection; idempotent."""

    def warm_up(self) -> None:
        """Pays now what a connection's first large calls would (nothing by default); a
        caller about to serve requests calls it once."""
        return None
