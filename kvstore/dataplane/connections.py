"""The data-plane connections of a node: who they are, and the bounds on how many there are.

A connection is counted the moment it is admitted, before its address is checked or its
endpoint made, so the bounds (in all and per client host) hold under concurrent
handshakes. Every method is safe to call from any thread.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvstore import errors
from kvstore.dataplane import frames
from kvstore.dataplane.base import ServerSettings
from kvstore.store import Lease, Reservation, Store
from kvstore.store.caller import Caller


@dataclass
class Connection:
    client_id: int
    peer: str  # the handshake's gRPC peer ("ipv4:127.0.0.1:5000"): the store's client
    peer_host: str  # without the port: what per-peer limits count
    store: Store
    caller: Caller  # who its frames are for: resolved once, at the handshake
    tags: frames.Tags
    deadline: float  # dropped if no frame arrives before this (monotonic seconds)
    ep: Any = None
    loop_task: asyncio.Task[None] | None = None
    in_flight: set[int] = field(default_factory=set)  # request ids being handled

    def acquire(self, req: frames.Request) -> Lease:
        """A lease of a GET's blocks, for the device reader a data plane is."""
        return self.store.acquire(req.namespace_id, req.keys, True, self.caller)

    def reserve(self, req: frames.Request) -> Reservation:
        return self.store.reserve(req.namespace_id, req.keys, req.parents, self.caller)

    def check_block_bytes(self, req: frames.Request) -> None:
        """Same errors as the gRPC path: short blocks are incomplete, long ones too big."""
        block_bytes = self.store.namespace(req.namespace_id, self.caller).block_bytes
        if req.op is frames.Op.PUT and req.block_bytes < block_bytes:
            raise errors.IncompleteWriteError(
                f"blocks of {req.block_bytes} bytes are not fully written; "
                f"each needs {block_bytes} bytes"
            )
        if req.block_bytes != block_bytes:
            raise errors.PayloadSizeError(
                f"{req.block_bytes}-byte buffers; the namespace's block size is {block_bytes}"
            )


class Connections:
    """A node's live connections, bounded by `settings`."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the gRPC threads admit, the data-plane loop drops
        self._by_id: dict[int, Connection] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def __contains__(self, client_id: object) -> bool:
        with self._lock:
            return client_id in self._by_id

    def admit(self, peer: str, store: Store, caller: Caller) -> Connection:
        """A new connection for `peer`, with a fresh secret and its hello deadline; raises
        TooManyConnectionsError past a bound."""
        s = self.settings
        secret = secrets.token_bytes(frames.SECRET_BYTES)
        conn = Connection(
            next(self._ids),
            peer,
            _peer_host(peer),
            store,
            caller,
            frames.Tags(secret),
            time.monotonic() + s.hello_timeout_s,
        )
        with self._lock:
            if len(self._by_id) >= s.max_connections:
                raise errors.TooManyConnectionsError(
                    f"node holds {len(self._by_id)} data-plane connections "
                    f"(max_dataplane_connections={s.max_connections})"
                )
            num_peer = sum(c.peer_host == conn.peer_host for c in self._by_id.values())
            if num_peer >= s.max_connections_per_peer:
                raise errors.TooManyConnectionsError(
                    f"{conn.peer_host} holds {num_peer} data-plane connections "
                    f"(max_dataplane_connections_per_peer={s.max_connections_per_peer})"
                )
            self._by_id[conn.client_id] = conn
        return conn

    def pop(self, client_id: int) -> Connection | None:
        """Forgets a connection; None if it was already gone."""
        with self._lock:
            return self._by_id.pop(client_id, None)

    def get(self, client_id: int) -> Connection | None:
        with self._lock:
            return self._by_id.get(client_id)

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._by_id)

    def late(self, now: float) -> list[int]:
        """The connections whose deadline has passed at `now` (monotonic seconds)."""
        with self._lock:
            return [c.client_id for c in self._by_id.values() if c.deadline <= now]


def _peer_host(peer: str) -> str:
    """A gRPC peer without its port ("ipv4:127.0.0.1:5000" -> "ipv4:127.0.0.1")."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer
