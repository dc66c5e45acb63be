"""The store's gRPC servicer: a thin layer that turns messages into store calls, each for the
`Caller` its token and peer name (`kvstore.tenancy.Tenants.caller`).

All store calls run on the event loop thread; each is short and bounded by the batch limit.
A typed store error becomes its status code, with the class name in trailing metadata so
the client can raise the same class (`kvstore.grpc_service.abort`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc

from kvstore import grpc_service, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.auth import Authenticator
from kvstore.cluster.pool import Pool
from kvstore.dataplane.base import DataPlaneServer
from kvstore.errors import KVStoreError, UnavailableError
from kvstore.results import Located, PoolNode, PoolReport
from kvstore.store import Store
from kvstore.store.caller import Caller
from kvstore.tenancy import Tenants

T = TypeVar("T")


def _unary(
    fn: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]:
    """Maps typed store errors raised by a unary handler to their status."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await fn(self, request, context)
        except KVStoreError as exc:
            await grpc_service.abort(context, exc)
            raise AssertionError("unreachable: abort raises") from exc

    return wrapper


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Each call is for the caller its token names (`kvstore.tenancy`): the namespace ids
    it carries are that tenant's own, mapped before the store sees them."""

    def __init__(
        self,
        store: Store,
        chunk_bytes: int,
        dataplanes: Mapping[str, DataPlaneServer] | None = None,
        tenants: Tenants | None = None,
        auth: Authenticator | None = None,
        pool: Pool | None = None,
    ) -> None:
        self.store = store
        self.pool = pool  # None: a node alone
        self.chunk_bytes = chunk_bytes
        self.dataplanes = dict(dataplanes or {})  # by transport name
        self.tenants = tenants or Tenants(None)
        self.auth = auth or Authenticator(None)

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        return self.auth.tenant(context.invocation_metadata())  # admitted: known already

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        return self.tenants.caller(self._tenant(context), context.peer())

    @_unary
    async def RegisterNamespace(self, request, context):
        limits = self.store.config.namespace_limits  # checked before the namespace is built
        namespace = wire.namespace_from_pb(request.namespace, limits)
        info = self.store.register_namespace(namespace, self._caller(context))
        return pb.RegisterNamespaceResponse(
            namespace_id=info.namespace_id, block_bytes=info.block_bytes
        )

    @_unary
    async def Match(self, request, context):
        match = self.store.match(request.namespace_id, list(request.keys), self._caller(context))
        return wire.match_to_pb(match)

    @_unary
    async def Reserve(self, request, context):
        parents = wire.parents_from_pb(request.parent_keys)
        position = wire.position_from_pb(request)
        caller = self._caller(context)
        keys = list(request.keys)
        res = self.store.reserve(request.namespace_id, keys, parents, caller, position)
        return wire.reserve_to_pb(res.result)

    @_unary
    async def Write(self, request_iterator, context):
        """All or nothing per block: a block this stream leaves short goes back to where it
        was before the stream, however the stream ended (a bad chunk, the client cancelling,
        or just ending: grpc.aio ends a cancelled stream as if it had finished)."""
        starts = {}  # (reservation, block) -> the offset this stream began it at
        total = 0
        caller = self._caller(context)
        try:
            async for chunk in request_iterator:
                res = self.store.reservation(chunk.reservation_id, caller)
                res.write(chunk.index, chunk.offset, chunk.data)
                starts.setdefault((res, chunk.index), chunk.offset)
                total += len(chunk.data)
        finally:
            for (res, index), offset in starts.items():
                res.rewind(index, offset)  # a block written whole, or an ended one: no-op
        return pb.WriteResponse(bytes_written=total)

    @_unary
    async def Commit(self, request, context):
        num = self.store.reservation(request.reservation_id, self._caller(context)).commit()
        return pb.CommitResponse(num_committed=num)

    @_unary
    async def Abort(self, request, context):
        self.store.reservation(request.reservation_id, self._caller(context)).abort()
        return pb.AbortResponse()

    async def Get(self, request, context) -> AsyncIterator[pb.GetResponse]:
        try:
            caller = self._caller(context)
            lease = self.store.acquire(request.namespace_id, list(request.keys), caller=caller)
        except KVStoreError as exc:
            await grpc_service.abort(context, exc)
            return
        try:
            block_bytes = self.store.namespace(request.namespace_id, caller).block_bytes
            sums = [c for c, hit in zip(lease.checksums, lease.found, strict=True) if hit]
            header = pb.GetHeader(found=lease.found, block_bytes=block_bytes, checksums=sums)
            yield pb.GetResponse(header=header)
            for index in (i for i, is_found in enumerate(lease.found) if is_found):
                for offset in range(0, block_bytes, self.chunk_bytes):
                    # Copied under the store's lock while the lease lives (each copy renews
                    # it); a reader that stalled past it gets LeaseExpiredError, never the
                    # bytes of whatever reused the slot.
                    # Built in place, no name kept on the bytes: a stalled send holds the
                    # message, its serialized form and the transport's copy, nothing more.
                    response = pb.GetResponse()
                    response.chunk.index, response.chunk.offset = index, offset
                    response.chunk.data = lease.read_chunk(index, offset, self.chunk_bytes)
                    yield response
        except KVStoreError as exc:
            await grpc_service.abort(context, exc)
        finally:
            lease.release()

    @_unary
    async def Remove(self, request, context):
        num = self.store.remove(request.namespace_id, list(request.keys), self._caller(context))
        return pb.RemoveResponse(num_removed=num)

    @_unary
    async def Stats(self, request, context):
        return wire.stats_to_pb(self.store.stats(self._caller(context)))

    @_unary
    async def DataPlaneInfo(self, request, context):
        dataplane = self.dataplanes.get(request.transport)
        if dataplane is None:
            raise UnavailableError(f"this node has no {request.transport[:16]!r} data plane")
        # Checking the address and connecting wait on other threads; keep this loop free.
        peer, tenant = context.peer(), self._tenant(context)  # frames act as this tenant
        connect = dataplane.connect
        admission = await asyncio.to_thread(connect, request.client_address, peer, tenant)
        return pb.DataPlaneInfoResponse(
            transport=request.transport,
            server_address=dataplane.address,
            client_id=admission.client_id,
            connection_secret=admission.secret,
        )

    @_unary
    async def Locate(self, request, context):
        keys, caller = list(request.keys), self._caller(context)
        position = wire.position_from_pb(request)
        if position is not None and keys:
            position.check(keys[0])
        own, _ = self.store.internal_ids(request.namespace_id, keys, caller)
        if self.pool is None:  # a node alone: its own blocks are the pool's
            match = self.store.match(request.namespace_id, keys, caller)
            return wire.located_to_pb(Located.on_one_node(match, PoolNode("", {}, {})))
        # A lookup in Redis waits on the network: keep the loop free meanwhile.
        located = await asyncio.to_thread(self.pool.locate, own, keys, position)
        if located is None:
            located = self.pool.alone(self.store.match(request.namespace_id, keys, caller))
        return wire.located_to_pb(located)

    @_unary
    async def PoolStatus(self, request, context):
        if self.pool is None:
            return wire.pool_report_to_pb(PoolReport(in_pool=False))
        sees_node = self._caller(context).sees_node
        # A sample reads Redis: keep the loop free meanwhile.
        report = await asyncio.to_thread(self.pool.report, sees_node, request.sample_blocks)
        return wire.pool_report_to_pb(report)
