"""The asyncio client of a store node: `Client`'s methods as coroutines.

Bytes take the same paths as in `Client`: the UCX data plane when both ends have it
(`transport="auto"`), straight into and out of the caller's arrays, else gRPC. The UCX
connection runs on its own thread and loop (`kvstore.dataplane`), so transfers never
block the caller's event loop, and many can be in flight at once.

Example:
    >>> async with AsyncClient("127.0.0.1:50051") as client:
    ...     await client.register_namespace(ns)
    ...     found = await client.get_into(ns.id, keys, buffers)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import errors, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.auth import open_aio_channel
from kvstore.client.common import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    TRANSPORT_CHOICES,
    Buffer,
    GetAssembler,
    GetResult,
    as_bytes_view,
    blocks_to_write,
    check_blocks,
    copy_into,
    put_result,
    raise_rpc_error,
)
from kvstore.dataplane import DataPlaneClient
from kvstore.dataplane.base import Admission
from kvstore.dataplane.buffers import as_transfer_buffer
from kvstore.dataplane.retry import REFUSALS, HandshakeRetry
from kvstore.dataplane.selection import Selection
from kvstore.dataplane.shm.client import ShmClient
from kvstore.keys import Namespace
from kvstore.results import (
    NO_RESERVATION,
    MatchResult,
    NamespaceInfo,
    PutResult,
    ReserveResult,
    StoreStats,
)


class AsyncClient:
    """asyncio client with the same methods and arguments as `Client`, as coroutines."""

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
        if transport not in TRANSPORT_CHOICES:
            raise errors.InvalidArgumentError(f"transport must be one of {TRANSPORT_CHOICES}")
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.transport = transport
        self._dataplane: DataPlaneClient | None = None
        self._selection = Selection(transport, address, timeout_s)
        self.dataplane_retry = dataplane_retry or HandshakeRetry()
        self._dataplane_lock = asyncio.Lock()
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._channel = open_aio_channel(address, options, auth_token, tls_ca, tls_cert, tls_key)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        async with self._dataplane_lock:
            if self._dataplane is not None:
                await asyncio.to_thread(self._dataplane.close)
                self._dataplane = None
        await self._channel.close()

    async def _call(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise_rpc_error(err)

    # -- data plane ----------------------------------------------------------------------

    async def _handshake(self, transport: str, client_address: bytes) -> tuple[bytes, Admission]:
        request = pb.DataPlaneInfoRequest(transport=transport, client_address=client_address)
        response = await self._call(self._stub.DataPlaneInfo, request)
        return response.server_address, Admission(response.client_id, response.connection_secret)

    async def data_plane(self) -> DataPlaneClient | None:
        """`Client.data_plane`: the data-plane connection, made on first use (on a worker
        thread, so this loop keeps running); None means gRPC."""
        if self.transport == "grpc":
            return None
        async with self._dataplane_lock:
            if self._dataplane is not None and self._dataplane.is_open:
                return self._dataplane
            if self.transport == "auto" and not self.dataplane_retry.is_due:
                return None  # refused a moment ago: gRPC until the retry is due
            loop = asyncio.get_running_loop()

            def handshake(transport: str, client_address: bytes) -> tuple[bytes, Admission]:
                # Called on a worker thread while this loop is free to run the call.
                call = self._handshake(transport, client_address)
                return asyncio.run_coroutine_threadsafe(call, loop).result()

            try:
                self._dataplane = await asyncio.to_thread(self._selection.open, handshake)
            except REFUSALS as exc:
                if self.transport != "auto":
                    raise
                if not self.dataplane_retry.refused(self.address, exc, self._selection.can_succeed):
                    self.transport = "grpc"  # no data plane reachable from here: for good
                return None
            self.dataplane_retry.succeeded()
            return self._dataplane

    async def buffer(self, nbytes: int) -> np.ndarray:
        """`Client.buffer`: memory the data plane moves blocks in and out of with the
        fewest copies."""
        dataplane = await self.data_plane()
        if isinstance(dataplane, ShmClient):
            return await asyncio.to_thread(dataplane.buffer, nbytes)
        return np.empty(nbytes, np.uint8)

    async def get_into(
        self, namespace_id: bytes, keys: Sequence[bytes], buffers: Sequence[Any]
    ) -> tuple[bool, ...]:
        """`Client.get_into`: the committed blocks of `keys` straight into `buffers`.

        If the calling task is cancelled, the cancellation takes effect once the transfer
        has stopped writing into `buffers` (at the latest, at the call's deadline), so the
        caller may reuse them as soon as it sees the CancelledError.
        """
        check_blocks(keys, buffers)
        dataplane = await self.data_plane() if keys else None
        if dataplane is None:
            return copy_into(await self.get(namespace_id, keys), buffers)
        block_bytes = as_transfer_buffer(buffers[0], writable=True).nbytes
        transfer = asyncio.wrap_future(
            dataplane.submit_get_into(namespace_id, keys, buffers, block_bytes)
        )
        try:
            return await asyncio.shield(transfer)
        except asyncio.CancelledError:
            await asyncio.wait([transfer])  # blocks may still be landing in the buffers
            raise

    # -- control plane -------------------------------------------------------------------

    async def health(self) -> bool:
        request = health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME)
        response = await self._call(self._health.Check, request)
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def register_namespace(self, namespace: Namespace) -> NamespaceInfo:
        request = pb.RegisterNamespaceRequest(namespace=wire.namespace_to_pb(namespace))
        response = await self._call(self._stub.RegisterNamespace, request)
        return NamespaceInfo(response.namespace_id, response.block_bytes)

    async def match(self, namespace_id: bytes, keys: Sequence[bytes]) -> MatchResult:
        request = pb.MatchRequest(namespace_id=namespace_id, keys=keys)
        return wire.match_from_pb(await self._call(self._stub.Match, request))

    async def reserve(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
    ) -> ReserveResult:
        request = pb.ReserveRequest(
            namespace_id=namespace_id, keys=keys, parent_keys=wire.parents_to_pb(parents)
        )
        return wire.reserve_from_pb(await self._call(self._stub.Reserve, request))

    async def write(self, reservation_id: int, blocks: Sequence[tuple[int, Buffer]]) -> int:
        views = [(i, as_bytes_view(b)) for i, b in blocks]
        chunks = wire.write_chunks(reservation_id, views, self.chunk_bytes)
        return (await self._call(self._stub.Write, chunks)).bytes_written

    async def commit(self, reservation_id: int) -> int:
        if reservation_id == NO_RESERVATION:
            return 0
        request = pb.CommitRequest(reservation_id=reservation_id)
        return (await self._call(self._stub.Commit, request)).num_committed

    async def abort(self, reservation_id: int) -> None:
        if reservation_id == NO_RESERVATION:
            return
        await self._call(self._stub.Abort, pb.AbortRequest(reservation_id=reservation_id))

    async def put(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        parents: Sequence[bytes | None] | None = None,
    ) -> PutResult:
        """`Client.put`: over the data plane when there is one, else reserve, write, commit."""
        check_blocks(keys, blocks)
        dataplane = await self.data_plane() if keys else None
        if dataplane is not None:
            block_bytes = as_transfer_buffer(blocks[0], writable=False).nbytes
            # Submitted from a worker thread: the blocks' checksums are summed there.
            submit = dataplane.submit_put
            future = await asyncio.to_thread(
                submit, namespace_id, keys, blocks, parents, block_bytes
            )
            return put_result(await asyncio.wrap_future(future))
        reserved = await self.reserve(namespace_id, keys, parents)
        if reserved.num_reserved:
            try:
                await self.write(reserved.reservation_id, blocks_to_write(reserved, blocks))
                await self.commit(reserved.reservation_id)
            except BaseException:
                await self._abort_quietly(reserved.reservation_id)
                raise
        return put_result(reserved)

    async def put_chain(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        parent: bytes | None = None,
    ) -> PutResult:
        return await self.put(namespace_id, keys, blocks, [parent, *keys[:-1]])

    async def get(self, namespace_id: bytes, keys: Sequence[bytes]) -> GetResult:
        assembler = GetAssembler()
        request = pb.GetRequest(namespace_id=namespace_id, keys=keys)
        try:
            async for msg in self._stub.Get(request, timeout=self.timeout_s):
                assembler.feed(msg)
        except grpc.RpcError as err:
            raise_rpc_error(err)
        return assembler.result()

    async def remove(self, namespace_id: bytes, keys: Sequence[bytes]) -> int:
        request = pb.RemoveRequest(namespace_id=namespace_id, keys=keys)
        return (await self._call(self._stub.Remove, request)).num_removed

    async def stats(self) -> StoreStats:
        return wire.stats_from_pb(await self._call(self._stub.Stats, pb.StatsRequest()))

    async def _abort_quietly(self, reservation_id: int) -> None:
        with contextlib.suppress(errors.KVStoreError):
            await self.abort(reservation_id)
