"""A node's calls as values, for both clients: the request each method sends, the stub
method it goes to and how its reply reads, with no I/O. `Client` runs a `Call` by calling
the stub, `AsyncClient` by awaiting it; what a call means is written once, here.

A put over gRPC is several calls (reserve, write, commit; abort if any fails): `put_steps`
yields them one by one and each client drives it with `drive` / `drive_async`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from grpc_health.v1 import health_pb2

from kvstore import errors, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.common import Buffer, as_bytes_view, blocks_to_write, put_result
from kvstore.dataplane.base import Admission
from kvstore.keys import ChainPosition, Namespace
from kvstore.results import (
    NO_RESERVATION,
    Located,
    MatchResult,
    NamespaceInfo,
    PoolReport,
    PutResult,
    ReserveResult,
    StoreStats,
)

T = TypeVar("T")


class Call(NamedTuple, Generic[T]):
    """One unary call: `stub` ("store" or "health"), its `method`, the `request`, and
    `read`, which turns the reply into what the client returns."""

    stub: str
    method: str
    request: Any
    read: Callable[[Any], T]


def health() -> Call[bool]:
    def read(reply: health_pb2.HealthCheckResponse) -> bool:
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    request = health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME)
    return Call("health", "Check", request, read)


def handshake(transport: str, client_address: bytes) -> Call[tuple[bytes, Admission]]:
    def read(reply: pb.DataPlaneInfoResponse) -> tuple[bytes, Admission]:
        return reply.server_address, Admission(reply.client_id, reply.connection_secret)

    request = pb.DataPlaneInfoRequest(transport=transport, client_address=client_address)
    return Call("store", "DataPlaneInfo", request, read)


def register_namespace(namespace: Namespace) -> Call[NamespaceInfo]:
    def read(reply: pb.RegisterNamespaceResponse) -> NamespaceInfo:
        return NamespaceInfo(reply.namespace_id, reply.block_bytes)

    request = pb.RegisterNamespaceRequest(namespace=wire.namespace_to_pb(namespace))
    return Call("store", "RegisterNamespace", request, read)


def match(namespace_id: bytes, keys: Sequence[bytes]) -> Call[MatchResult]:
    request = pb.MatchRequest(namespace_id=namespace_id, keys=keys)
    return Call("store", "Match", request, wire.match_from_pb)


def reserve(
    namespace_id: bytes,
    keys: Sequence[bytes],
    parents: Sequence[bytes | None] | None,
    position: ChainPosition | None = None,
) -> Call[ReserveResult]:
    parent_keys = wire.parents_to_pb(parents)
    request = pb.ReserveRequest(namespace_id=namespace_id, keys=keys, parent_keys=parent_keys)
    if position is not None:
        request.chain_depth, request.chain_group = position
    return Call("store", "Reserve", request, wire.reserve_from_pb)


def write(reservation_id: int, blocks: Sequence[tuple[int, Buffer]], chunk_bytes: int) -> Call[int]:
    views = [(i, as_bytes_view(b)) for i, b in blocks]
    chunks = wire.write_chunks(reservation_id, views, chunk_bytes)
    return Call("store", "Write", chunks, lambda reply: reply.bytes_written)


def commit(reservation_id: int) -> Call[int] | None:
    """None for `NO_RESERVATION`: nothing was reserved, nothing is sent."""
    if reservation_id == NO_RESERVATION:
        return None
    request = pb.CommitRequest(reservation_id=reservation_id)
    return Call("store", "Commit", request, lambda reply: reply.num_committed)


def abort(reservation_id: int) -> Call[None] | None:
    """None for `NO_RESERVATION`."""
    if reservation_id == NO_RESERVATION:
        return None
    request = pb.AbortRequest(reservation_id=reservation_id)
    return Call("store", "Abort", request, lambda reply: None)


def remove(namespace_id: bytes, keys: Sequence[bytes]) -> Call[int]:
    request = pb.RemoveRequest(namespace_id=namespace_id, keys=keys)
    return Call("store", "Remove", request, lambda reply: reply.num_removed)


def locate(
    namespace_id: bytes, keys: Sequence[bytes], position: ChainPosition | None = None
) -> Call[Located]:
    request = pb.LocateRequest(namespace_id=namespace_id, keys=keys)
    if position is not None:
        request.chain_depth, request.chain_group = position
    return Call("store", "Locate", request, lambda r: wire.located_from_pb(r, len(keys)))


def pool_status(sample_blocks: int = 0) -> Call[PoolReport]:
    request = pb.PoolStatusRequest(sample_blocks=sample_blocks)
    return Call("store", "PoolStatus", request, wire.pool_report_from_pb)


def stats() -> Call[StoreStats]:
    return Call("store", "Stats", pb.StatsRequest(), wire.stats_from_pb)


Steps = Generator[Call[Any], Any, T]


def put_steps(
    namespace_id: bytes,
    keys: Sequence[bytes],
    blocks: Sequence[Buffer],
    parents: Sequence[bytes | None] | None,
    chunk_bytes: int,
    position: ChainPosition | None = None,
) -> Steps[PutResult]:
    """A put over gRPC: reserve, write what was reserved, commit; on any failure, abort
    (quietly: an expired or unreachable reservation is freed at its deadline anyway) and
    raise. Nothing becomes visible unless the commit succeeds."""
    reserved: ReserveResult = yield reserve(namespace_id, keys, parents, position)
    if reserved.num_reserved:
        rid = reserved.reservation_id
        try:
            yield write(rid, blocks_to_write(reserved, blocks), chunk_bytes)
            if (committing := commit(rid)) is not None:
                yield committing
        except BaseException:
            if (aborting := abort(rid)) is not None:
                with contextlib.suppress(errors.KVStoreError):
                    yield aborting
            raise
    return put_result(reserved)


class _Done(NamedTuple, Generic[T]):
    value: T


def _advance(steps: Steps[T], result: Any, error: BaseException | None) -> Call[Any] | _Done[T]:
    """The next call of `steps`, after sending it `result` or throwing in `error`; or what
    it returned."""
    try:
        return steps.throw(error) if error is not None else steps.send(result)
    except StopIteration as done:
        return _Done(done.value)


def drive(steps: Steps[T], run: Callable[[Call[Any]], Any]) -> T:
    """Runs each call `steps` yields with `run`, sending back its result or throwing in
    its error; returns what `steps` returns."""
    result, error = None, None
    while not isinstance(call := _advance(steps, result, error), _Done):
        try:
            result, error = run(call), None
        except BaseException as exc:
            result, error = None, exc
    return call.value


async def drive_async(steps: Steps[T], run: Callable[[Call[Any]], Awaitable[Any]]) -> T:
    """`drive`, awaiting each call."""
    result, error = None, None
    while not isinstance(call := _advance(steps, result, error), _Done):
        try:
            result, error = await run(call), None
        except BaseException as exc:
            result, error = None, exc
    return call.value
