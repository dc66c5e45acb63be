"""How the node's services meet grpc.aio: their method handlers, and one way errors leave.

The handlers are built from a service descriptor (KVStore's, and the standard health
service's), like the generated `add_..._to_server`, with one difference: a request that
does not parse as its message (in a stream, any one of them) decodes to a `Malformed`
marker instead of raising inside grpc, where it would end the call as UNKNOWN with a
traceback in the log. The handler turns the marker into `InvalidArgumentError`:
INVALID_ARGUMENT, one log line.

With an `Authenticator` that has tokens, a call without a known bearer token ends as
UNAUTHENTICATED before its handler runs. With `CallMetrics`, every call of every method is
timed, the bytes of its messages counted, and the error class it ended with (the trailing
metadata `abort` sets) recorded, in one place. With `StreamSlots`, every server-streaming
call takes a slot of its client (its tenant, or its peer on a node without tokens) and sends
its responses through a `StreamWriter`: past a bound the call ends RESOURCE_EXHAUSTED
(`TooManyStreamsError`), and a reader that takes nothing for the stall timeout has its call
ended (`StreamStalledError`) after the handler's own clean-up ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import Authenticator
from kvstore.bounds import StreamSlots, StreamWriter
from kvstore.errors import (
    ERROR_METADATA_KEY,
    InvalidArgumentError,
    KVStoreError,
    StreamStalledError,
)
from kvstore.metrics import CallMetrics

log = logging.getLogger("kvstore.node.server")
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]


class Malformed(NamedTuple):
    """What a request decodes to when its bytes are not a `message` message."""

    message: str
    reason: str


async def abort(context: grpc.aio.ServicerContext, exc: KVStoreError) -> None:
    """Ends the call with the status of `exc`, its class name in the trailing metadata."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
    await context.abort(grpc.StatusCode[exc.code], str(exc))


def register(
    server: grpc.aio.Server,
    servicer: Any,
    service: Any = SERVICE,
    messages: Any = pb,
    metrics: CallMetrics | None = None,
    auth: Authenticator | None = None,
    streams: StreamSlots | None = None,
) -> None:
    """Serves `servicer`'s methods (one per RPC of `service`, by name) on `server`;
    `messages` is the generated module that holds the service's message classes; `metrics`
    records every call; `auth` admits only calls with a known token; `streams` bounds the
    response streams."""
    handlers = {
        m.name: _handler(m, servicer, messages, metrics, auth, streams) for m in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def _handler(
    method: Any,
    servicer: Any,
    messages: Any,
    metrics: CallMetrics | None,
    auth: Authenticator | None,
    streams: StreamSlots | None,
) -> grpc.RpcMethodHandler:
    request_cls = getattr(messages, method.input_type.name)
    response_cls = getattr(messages, method.output_type.name)
    behavior = getattr(servicer, method.name)
    if method.server_streaming and not inspect.isasyncgenfunction(behavior):
        behavior = _generating(behavior)  # written against `context.write` (health's Watch)
    decode, encode = _decoder(request_cls), response_cls.SerializeToString
    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, _checked_unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, _checked_unary_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, _checked_stream),
    }
    make_handler, check = kinds[(method.client_streaming, method.server_streaming)]
    handle = check(method.name, behavior)
    if auth is not None and auth.is_enabled:
        handle = _authenticated(handle, auth, method.server_streaming)
    if metrics is not None:  # outermost: malformed requests are calls too
        handle = _timed(method.name, handle, metrics, method.server_streaming)
        decode, encode = _counted(method.name, decode, encode, metrics)
    if streams is not None and method.server_streaming:
        handle = _bounded(method.name, handle, streams, auth)
    return make_handler(
        handle,
        request_deserializer=decode,
        response_serializer=encode,
    )


def _authenticated(
    behavior: Callable[..., Any], auth: Authenticator, is_stream: bool
) -> Callable[..., Any]:
    """Ends a call without a known token as UNAUTHENTICATED, before anything else runs."""

    async def admit(context: grpc.aio.ServicerContext) -> None:
        try:
            auth.tenant(context.invocation_metadata())
        except KVStoreError as exc:
            log.warning("event=unauthenticated peer=%s reason=%r", context.peer(), str(exc))
            await abort(context, exc)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await admit(context)
        return await behavior(request, context)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await admit(context)
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    return stream if is_stream else unary


def _bounded(
    name: str, behavior: Callable[..., Any], slots: StreamSlots, auth: Authenticator | None
) -> Callable[..., Any]:
    """The streaming `behavior` as a handler that writes its responses itself, in a slot."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> None:
        responses = behavior(request, context)  # checks and admission run at the first step
        # Every wrapper closes what it wraps (`contextlib.aclosing`): closing `responses`
        # runs the handler's own clean-up, in order, before the slot is given back.
        try:
            slot = slots.take(_client(context, auth))
        except KVStoreError as exc:
            await responses.aclose()
            await abort(context, exc)
        writer = StreamWriter(context, slots, slot)
        stalled = None
        try:
            async for response in responses:
                await writer.write(response)
        except StreamStalledError as exc:
            stalled = exc
        finally:
            await responses.aclose()  # the handler's leases and the like end here
            writer.close()
        if stalled is not None:
            log.warning("event=stream_stalled method=%s peer=%s", name, context.peer())
            try:
                await abort(context, stalled)  # its status waits behind the stalled message
            except grpc.aio.AbortError:
                raise
            except Exception:  # the reader went away first: the status had nowhere to go
                log.info("event=stream_gone method=%s", name)

    return handle


class _Writes:
    """A call's context whose `write` is `write`; everything else is the context's."""

    def __init__(self, context: grpc.aio.ServicerContext, write: Callable[[Any], Any]) -> None:
        self._context = context
        self.write = write

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _generating(behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
    """A streaming handler that sends with `context.write`, as an async generator of what it
    sends (one message at a time: its write waits until the last one was taken)."""

    async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        sent: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
        task = asyncio.ensure_future(behavior(request, _Writes(context, sent.put)))
        try:
            while True:
                taken = asyncio.ensure_future(sent.get())
                await asyncio.wait({taken, task}, return_when=asyncio.FIRST_COMPLETED)
                if not taken.done():
                    taken.cancel()
                    break
                yield taken.result()
            while not sent.empty():
                yield sent.get_nowait()
            task.result()  # its error, if it raised one
        finally:
            task.cancel()

    return generate


def _client(context: grpc.aio.ServicerContext, auth: Authenticator | None) -> str:
    """Who a call's limits count against: its tenant, or its peer (one connection)."""
    if auth is not None and auth.is_enabled:
        try:
            return "tenant:" + auth.tenant(context.invocation_metadata())
        except KVStoreError:
            pass  # not admitted: its call ends UNAUTHENTICATED at its first step
    return context.peer()


def _counted(
    name: str, decode: Callable[[bytes], Any], encode: Callable[[Any], bytes], m: CallMetrics
) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    def counted_decode(data: bytes) -> Any:
        m.moved("grpc", name, len(data), 0)
        return decode(data)

    def counted_encode(message: Any) -> bytes:
        data = encode(message)
        m.moved("grpc", name, 0, len(data))
        return data

    return counted_decode, counted_encode


def _error_class(context: grpc.aio.ServicerContext) -> str | None:
    """The class name `abort` left in the trailing metadata; "Cancelled" or the status name
    for a call that ended otherwise than well."""
    for key, value in context.trailing_metadata() or ():
        if key == ERROR_METADATA_KEY:
            return str(value)
    if context.cancelled():
        return "Cancelled"
    code = context.code()
    return None if code in (None, grpc.StatusCode.OK) else str(code.name)


def _timed(
    name: str, behavior: Callable[..., Any], m: CallMetrics, is_stream: bool
) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        start = time.perf_counter()
        try:
            return await behavior(request, context)
        finally:
            m.observe("grpc", name, time.perf_counter() - start, _error_class(context))

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        start = time.perf_counter()
        try:
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            m.observe("grpc", name, time.perf_counter() - start, _error_class(context))

    return stream if is_stream else unary


def _decoder(message_cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            return Malformed(message_cls.DESCRIPTOR.name, str(exc))

    return decode


def _refusal(name: str, context: grpc.aio.ServicerContext, bad: Malformed) -> KVStoreError:
    log.warning("event=malformed_request method=%s peer=%s", name, context.peer())
    return InvalidArgumentError(f"the request is not a valid {bad.message}: {bad.reason}")


def _checked_unary(name: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await abort(context, _refusal(name, context, request))
        return await behavior(request, context)

    return handle


def _checked_unary_stream(name: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await abort(context, _refusal(name, context, request))
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    return handle


def _checked_stream(name: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    """The behaviour sees an `InvalidArgumentError` raised from its request iterator where a
    malformed message arrives, and answers it as any error of its own."""

    async def checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Malformed):
                raise _refusal(name, context, request)
            yield request

    async def handle(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(checked(requests, context), context)

    return handle
