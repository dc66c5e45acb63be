"""The asyncio client of a store node: `Client`'s methods as coroutines.

Bytes take the same paths as in `Client`, and every call means what it means there: both
run the calls of `calls` and keep their data plane in `DataPlanes`; this module only does
the awaiting. A data-plane connection runs on its own thread (and, for UCX, its own loop),
so transfers never block the caller's event loop, and many can be in flight at once.

Example:
    >>> async with AsyncClient("127.0.0.1:50051") as client:
    ...     await client.register_namespace(ns)
    ...     found = await client.get_into(ns.id, keys, buffers)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import open_aio_channel
from kvstore.client import calls
from kvstore.client.channel import NodeChannel
from kvstore.client.common import (
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

T = TypeVar("T")


class AsyncClient(NodeChannel):
    """asyncio client with the same methods and arguments as `Client`, as coroutines."""

    open_channel = staticmethod(open_aio_channel)
    new_lock = staticmethod(asyncio.Lock)
    _lock: asyncio.Lock

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        async with self._lock:
            if (connection := self._planes.take()) is not None:
                await asyncio.to_thread(connection.close)
        await self._channel.close()

    async def _run(self, call: calls.Call[T]) -> T:
        method = getattr(self._stubs[call.stub], call.method)
        try:
            return call.read(await method(call.request, timeout=self.timeout_s))
        except grpc.RpcError as err:
            raise_rpc_error(err)

    # -- data plane ----------------------------------------------------------------------

    async def data_plane(self) -> DataPlaneClient | None:
        """`Client.data_plane`: the data-plane connection, made on first use (on a worker
        thread, so this loop keeps running); None means gRPC."""
        async with self._lock:
            if not self._planes.must_open():
                return self._planes.current()
            loop = asyncio.get_running_loop()

            def handshake(transport: str, client_address: bytes) -> tuple[bytes, Admission]:
                # Called on a worker thread while this loop is free to run the call.
                call = self._run(calls.handshake(transport, client_address))
                return asyncio.run_coroutine_threadsafe(call, loop).result()

            try:
                connection = await asyncio.to_thread(self._planes.selection.open, handshake)
            except REFUSALS as exc:
                self._planes.refused(exc)
                return None
            return self._planes.opened(connection)

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
        return await self._run(calls.health())

    async def register_namespace(self, namespace: Namespace) -> NamespaceInfo:
        return await self._run(calls.register_namespace(namespace))

    async def match(self, namespace_id: bytes, keys: Sequence[bytes]) -> MatchResult:
        return await self._run(calls.match(namespace_id, keys))

    async def reserve(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
    ) -> ReserveResult:
        return await self._run(calls.reserve(namespace_id, keys, parents))

    async def write(self, reservation_id: int, blocks: Sequence[tuple[int, Buffer]]) -> int:
        return await self._run(calls.write(reservation_id, blocks, self.chunk_bytes))

    async def commit(self, reservation_id: int) -> int:
        call = calls.commit(reservation_id)
        return 0 if call is None else await self._run(call)

    async def abort(self, reservation_id: int) -> None:
        if (call := calls.abort(reservation_id)) is not None:
            await self._run(call)

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
        steps = calls.put_steps(namespace_id, keys, blocks, parents, self.chunk_bytes)
        return await calls.drive_async(steps, self._run)

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
            async for msg in self._stubs["store"].Get(request, timeout=self.timeout_s):
                assembler.feed(msg)
        except grpc.RpcError as err:
            raise_rpc_error(err)
        return assembler.result()

    async def remove(self, namespace_id: bytes, keys: Sequence[bytes]) -> int:
        return await self._run(calls.remove(namespace_id, keys))

    async def stats(self) -> StoreStats:
        return await self._run(calls.stats())

    async def locate(
        self, namespace_id: bytes, keys: Sequence[bytes], position: ChainPosition | None = None
    ) -> Located:
        return await self._run(calls.locate(namespace_id, keys, position))

    async def pool_status(self, sample_blocks: int = 0) -> PoolReport:
        return await self._run(calls.pool_status(sample_blocks))
