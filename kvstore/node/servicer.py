"""The store's gRPC servicer: a thin layer that turns messages into store calls, each through
the caller's tenant scope (`kvstore.tenancy.TenantScope`).

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
from kvstore.dataplane.base import DataPlaneServer
from kvstore.errors import KVStoreError, UnavailableError
from kvstore.store import Store
from kvstore.tenancy import Tenants, TenantScope

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
    """Each call acts through the scope of the tenant its token names (`kvstore.tenancy`):
    the namespace ids it carries are that tenant's own, mapped before the store sees them."""

    def __init__(
        self,
        store: Store,
        chunk_bytes: int,
        dataplanes: Mapping[str, DataPlaneServer] | None = None,
        tenants: Tenants | None = None,
        auth: Authenticator | None = None,
    ) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.dataplanes = dict(dataplanes or {})  # by transport name
        self.tenants = tenants or Tenants(store, None)
        self.auth = auth or Authenticator(None)

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        return self.auth.tenant(context.invocation_metadata())  # admitted: known already

    def _scope(self, context: grpc.aio.ServicerContext) -> TenantScope:
        return TenantScope(self.tenants, self._tenant(context))

    @_unary
    async def RegisterNamespace(self, request, context):
        limits = self.store.config.namespace_limits  # checked before the namespace is built
        namespace = wire.namespace_from_pb(request.namespace, limits)
        info = self._scope(context).register_namespace(namespace)
        return pb.RegisterNamespaceResponse(
            namespace_id=info.namespace_id, block_bytes=info.block_bytes
        )

    @_unary
    async def Match(self, request, context):
        scope = self._scope(context)
        return wire.match_to_pb(scope.match(request.namespace_id, list(request.keys)))

    @_unary
    async def Reserve(self, request, context):
        parents = wire.parents_from_pb(request.parent_keys)
        owner = context.peer()  # the client; with tenants, the scope makes it the tenant
        result = self._scope(context).reserve(
            request.namespace_id, list(request.keys), parents, owner
        )
        return wire.reserve_to_pb(result)

    @_unary
    async def Write(self, request_iterator, context):
        """All or nothing per block: a block this stream leaves short goes back to where it
        was before the stream, however the stream ended (a bad chunk, the client cancelling,
        or just ending: grpc.aio ends a cancelled stream as if it had finished)."""
        starts = {}  # (reservation, block) -> the offset this stream began it at
        total = 0
        scope = self._scope(context)
        try:
            async for chunk in request_iterator:
                scope.write(
                    chunk.reservation_id, chunk.index, chunk.offset, chunk.data, context.peer()
                )
                starts.setdefault((chunk.reservation_id, chunk.index), chunk.offset)
                total += len(chunk.data)
        finally:
            for (reservation_id, index), offset in starts.items():
                scope.rewind(reservation_id, index, offset, context.peer())  # whole: no-op
        return pb.WriteResponse(bytes_written=total)

    @_unary
    async def Commit(self, request, context):
        num = self._scope(context).commit(request.reservation_id, owner=context.peer())
        return pb.CommitResponse(num_committed=num)

    @_unary
    async def Abort(self, request, context):
        self._scope(context).abort(request.reservation_id, context.peer())
        return pb.AbortResponse()

    async def Get(self, request, context) -> AsyncIterator[pb.GetResponse]:
        try:
            keys = list(request.keys)
            scope = self._scope(context)
            lease = scope.acquire(request.namespace_id, keys, owner=context.peer())
        except KVStoreError as exc:
            await grpc_service.abort(context, exc)
            return
        try:
            block_bytes = scope.namespace(request.namespace_id).block_bytes
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
                    response.chunk.data = scope.read_chunk(
                        lease.lease_id, index, offset, self.chunk_bytes
                    )
                    yield response
        except KVStoreError as exc:
            await grpc_service.abort(context, exc)
        finally:
            scope.release(lease.lease_id)

    @_unary
    async def Remove(self, request, context):
        num = self._scope(context).remove(request.namespace_id, list(request.keys))
        return pb.RemoveResponse(num_removed=num)

    @_unary
    async def Stats(self, request, context):
        return wire.stats_to_pb(self._scope(context).stats())

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
