"""Authentication for blocking gRPC servers (the engine service): calls without a known
token end as UNAUTHENTICATED before their handler runs. (The asyncio services check in
`kvstore.grpc_service`, where their handlers are built.)"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from kvstore.auth.authenticator import Authenticator
from kvstore.errors import ERROR_METADATA_KEY, KVStoreError

log = logging.getLogger("kvstore.auth")

_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


class TokenInterceptor(grpc.ServerInterceptor):
    """Admits calls whose metadata carries a token `auth` knows."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        try:
            self.auth.tenant(details.invocation_metadata)
        except KVStoreError as exc:
            log.warning("event=unauthenticated method=%s reason=%r", details.method, str(exc))
            return _refusal(handler, exc)
        return handler


def _refusal(handler: Any, exc: KVStoreError) -> Any:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
        context.abort(grpc.StatusCode[exc.code], str(exc))

    for kind, make in _KINDS:
        if getattr(handler, kind) is not None:
            return make(
                refuse,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise AssertionError("a handler of no known kind")
