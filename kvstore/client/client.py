"""The blocking Python client of a store node (`AsyncClient` is its asyncio twin).

Every call has a timeout and raises the typed errors of `kvstore.errors`. `get_into` and
`put` move bytes over a data plane when both ends have it (`transport="auto"`: shared
memory on the node's host, else UCX, else TCP), straight into and out of the caller's
arrays; otherwise over the portable gRPC path. What each call sends and means is in
`calls`, which both clients share; this module only does the blocking I/O.

Example:
    >>> ns = Namespace("llama-3-8b", KVLayout("float16", 32, 8, 128, 16))
    >>> with Client("127.0.0.1:50051") as client:
    ...     client.register_namespace(ns)
    ...     keys = block_keys(ns, prompt_tokens)
    ...     n = client.match(ns.id, keys).num_matched
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import open_channel
from kvstore.client import calls
from kvstore.client.channel import NodeChannel
from kvstore.client.common import (
    TRANSPORT_CHOICES,
    Buffer,
    GetAssembler,
    GetResult,
    check_blocks,
    copy_into,
    put_result,
    raise_rpc_error,
)
from kvstore.dataplane.base import Admission, DataPlaneClient
from kvstore.dataplane.buffers import as_transfer_buffer
from kvstore.dataplane.retry import REFUSALS
from kvstore.dataplane.shm.client import ShmClient
from kvstore.keys import ChainPosition, Namespace
from kvstore.results import (
    Located,
    MatchResult,
    NamespaceInfo,
    PoolReport,
    PutResult,
    ReserveResult,
    StoreStats,
)

__all__ = ["TRANSPORT_CHOICES", "Client", "GetResult"]
T = TypeVar("T")


class Client(NodeChannel):
    """Blocking client. Thread-safe; use one per process and close it (or use `with`).

    Args:
        address: "host:port" of a store node.
        timeout_s: deadline of every call.
        chunk_bytes: size of the byte chunks streamed on the gRPC path.
        transport: how `get_into`/`put` move bytes: "shm" (shared memory with a node on
            this host), "ucx" or "tcp" (those data planes; each raises UnavailableError
            where it cannot be had), "grpc" (the portable path), "auto" (shm on the node's
            host; else ucx then tcp on a host with an RDMA device, tcp then ucx on one
            without; else grpc: `kvstore.dataplane.selection`).
        auth_token: bearer token sent with every call (a node with --auth-token-file
            answers calls without a known one UNAUTHENTICATED).
        tls_ca: PEM file of the CA the node's certificate chains to: connect over TLS.
        tls_cert, tls_key: PEM client certificate and key, for a node that asks for one
            (mutual TLS).
        dataplane_retry: when "auto" asks for the data plane again after a node refused
            it (`kvstore.dataplane.retry`; default: after 1 s, doubling up to 60 s).
    """

    open_channel = staticmethod(open_channel)
    new_lock = staticmethod(threading.Lock)
    _lock: threading.Lock

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if (connection := self._planes.take()) is not None:
                connection.close()
        self._channel.close()

    def _run(self, call: calls.Call[T]) -> T:
        method = getattr(self._stubs[call.stub], call.method)
        try:
            return call.read(method(call.request, timeout=self.timeout_s))
        except grpc.RpcError as err:
            raise_rpc_error(err)

    # -- data plane ----------------------------------------------------------------------

    def _handshake(self, transport: str, client_address: bytes) -> tuple[bytes, Admission]:
        return self._run(calls.handshake(transport, client_address))

    def data_plane(self) -> DataPlaneClient | None:
        """The data-plane connection `get_into`/`put` use (`kvstore.dataplane.selection`:
        shared memory on the node's host, else UCX, else TCP), made on first use; None
        means gRPC.

        With transport "shm", "ucx" or "tcp" raises UnavailableError where "auto" falls back to
        gRPC, and tries again when `dataplane_retry` says (`kvstore.dataplane.retry`).
        """
        with self._lock:
            if not self._planes.must_open():
                return self._planes.current()
            try:
                connection = self._planes.selection.open(self._handshake)
            except REFUSALS as exc:
                self._planes.refused(exc)
                return None
            return self._planes.opened(connection)

    def buffer(self, nbytes: int) -> np.ndarray:
        """`nbytes` of host memory (uint8) that `get_into` and `put` move blocks in and out
        of with the fewest copies: with a node on this host, memory shared with it (the
        node copies blocks straight in and out); else plain memory. Slice blocks from it."""
        dataplane = self.data_plane()
        if isinstance(dataplane, ShmClient):
            return dataplane.buffer(nbytes)
        return np.empty(nbytes, np.uint8)

    def share(self, arrays: Sequence[np.ndarray]) -> int:
        """Makes host memory this process already has and keeps for its life (uint8
        arrays, e.g. views of vLLM's paged KV cache) memory shared with a node on this
        host, in place: the same addresses and bytes, moved onto files the node maps, so
        gets and puts of blocks there need no copy on this side. Nothing may write the
        arrays meanwhile. Returns the bytes shared: 0 without a node on this host; blocks
        touching a partial page at an array's ends still go through staging."""
        dataplane = self.data_plane()
        return dataplane.share(arrays) if isinstance(dataplane, ShmClient) else 0

    def get_into(
        self, namespace_id: bytes, keys: Sequence[bytes], buffers: Sequence[Any]
    ) -> tuple[bool, ...]:
        """Reads the committed blocks of `keys` straight into `buffers` (one per key, each
        exactly the namespace's block size: numpy arrays, torch tensors, cupy arrays,
        bytearrays). Returns which keys were found; a miss leaves its buffer untouched."""
        check_blocks(keys, buffers)
        dataplane = self.data_plane() if keys else None
        if dataplane is None:
            return copy_into(self.get(namespace_id, keys), buffers)
        block_bytes = as_transfer_buffer(buffers[0], writable=True).nbytes
        return dataplane.get_into(namespace_id, keys, buffers, block_bytes)

    # -- control plane -------------------------------------------------------------------

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Blocks until the channel connects; raises UnavailableError after the timeout."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s or self.timeout_s)
        except grpc.FutureTimeoutError:
            raise errors.UnavailableError(f"store at {self.address} is not reachable") from None

    def health(self) -> bool:
        """Whether the store reports SERVING."""
        return self._run(calls.health())

    def register_namespace(self, namespace: Namespace) -> NamespaceInfo:
        return self._run(calls.register_namespace(namespace))

    def match(self, namespace_id: bytes, keys: Sequence[bytes]) -> MatchResult:
        """Longest committed prefix of `keys`."""
        return self._run(calls.match(namespace_id, keys))

    def reserve(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
    ) -> ReserveResult:
        return self._run(calls.reserve(namespace_id, keys, parents))

    def write(self, reservation_id: int, blocks: Sequence[tuple[int, Buffer]]) -> int:
        """Streams `(index, payload)` pairs into a reservation; returns bytes sent."""
        return self._run(calls.write(reservation_id, blocks, self.chunk_bytes))

    def commit(self, reservation_id: int) -> int:
        """Makes a reservation's blocks readable; `NO_RESERVATION` (nothing reserved) is a
        no-op that sends nothing."""
        call = calls.commit(reservation_id)
        return 0 if call is None else self._run(call)

    def abort(self, reservation_id: int) -> None:
        """Frees a reservation's slots; a no-op for `NO_RESERVATION`."""
        if (call := calls.abort(reservation_id)) is not None:
            self._run(call)

    def put(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        parents: Sequence[bytes | None] | None = None,
        position: ChainPosition | None = None,
    ) -> PutResult:
        """Stores `blocks` under `keys` (reserve, write, commit); keys already present
        are skipped. On failure the reservation is aborted and nothing becomes visible.
        Over the data plane each block carries a CRC32C the node checks before commit.
        `position`: the first key's parent is held on another node of the pool, and this
        is the first key's place in its chain (such a put goes over gRPC)."""
        check_blocks(keys, blocks)
        dataplane = self.data_plane() if keys and position is None else None
        if dataplane is not None:
            block_bytes = as_transfer_buffer(blocks[0], writable=False).nbytes
            return put_result(dataplane.put(namespace_id, keys, blocks, parents, block_bytes))
        steps = calls.put_steps(namespace_id, keys, blocks, parents, self.chunk_bytes, position)
        return calls.drive(steps, self._run)

    def put_chain(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        parent: bytes | None = None,
        position: ChainPosition | None = None,
    ) -> PutResult:
        """`put` of consecutive blocks of one chain that continues after `parent`."""
        return self.put(namespace_id, keys, blocks, [parent, *keys[:-1]], position)

    def get(self, namespace_id: bytes, keys: Sequence[bytes]) -> GetResult:
        """Committed blocks among `keys` over gRPC; misses are None."""
        assembler = GetAssembler()
        request = pb.GetRequest(namespace_id=namespace_id, keys=keys)
        try:
            for msg in self._stubs["store"].Get(request, timeout=self.timeout_s):
                assembler.feed(msg)
        except grpc.RpcError as err:
            raise_rpc_error(err)
        return assembler.result()

    def remove(self, namespace_id: bytes, keys: Sequence[bytes]) -> int:
        return self._run(calls.remove(namespace_id, keys))

    def stats(self) -> StoreStats:
        return self._run(calls.stats())

    def locate(
        self, namespace_id: bytes, keys: Sequence[bytes], position: ChainPosition | None = None
    ) -> Located:
        """Which nodes of the pool hold each block of the longest prefix of `keys` that some
        live node holds (a node alone answers its own). `position`: where `keys[0]` sits in
        its chain where it is not the root (`ChainPosition.of`)."""
        return self._run(calls.locate(namespace_id, keys, position))

    def pool_status(self, sample_blocks: int = 0) -> PoolReport:
        """The pool as this node sees it; with `sample_blocks`, how many live nodes hold
        each of that many blocks of the index (`holders_sampled`; for callers that see the
        node, as what its members hold)."""
        return self._run(calls.pool_status(sample_blocks))
