"""A client's channel to a node: TLS when given trust roots, its bearer token on every call."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstore.auth.tls import read_pem
from kvstore.errors import InvalidArgumentError

Options = Sequence[tuple[str, Any]]


def read_token_file(path: str) -> str:
    """A client's token: the first non-blank line of `path`."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the token file {path}: {exc}") from None
    token = next((line.strip() for line in lines if line.strip()), "")
    if not token:
        raise InvalidArgumentError(f"the token file {path} is empty")
    return token


def _credentials(tls_ca: str, tls_cert: str, tls_key: str) -> grpc.ChannelCredentials:
    if bool(tls_cert) != bool(tls_key):
        raise InvalidArgumentError("a client certificate needs its key, and a key its cert")
    key = read_pem(tls_key, "TLS key") if tls_key else None
    cert = read_pem(tls_cert, "TLS certificate") if tls_cert else None
    roots = read_pem(tls_ca, "TLS CA") if tls_ca else None  # None: the system's roots
    return grpc.ssl_channel_credentials(roots, key, cert)


class _TokenMetadata:
    """Adds ``authorization: Bearer TOKEN`` to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=(*(details.metadata or ()), self._header))


class _SyncToken(
    _TokenMetadata,
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)

    intercept_stream_stream = intercept_stream_unary


class _AioUnaryUnary(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _AioUnaryStream(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), request)


class _AioStreamUnary(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return await continuation(self._details(details), requests)


def open_channel(
    address: str,
    options: Options = (),
    auth_token: str = "",
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
) -> grpc.Channel:
    """A blocking channel: TLS when `tls_ca` (or a client certificate) is given, else plain;
    `auth_token` rides on every call."""
    if tls_ca or tls_cert:
        channel = grpc.secure_channel(address, _credentials(tls_ca, tls_cert, tls_key), options)
    else:
        channel = grpc.insecure_channel(address, options)
    return grpc.intercept_channel(channel, _SyncToken(auth_token)) if auth_token else channel


def open_aio_channel(
    address: str,
    options: Options = (),
    auth_token: str = "",
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
) -> grpc.aio.Channel:
    """`open_channel` for grpc.aio."""
    interceptors: list[Any] = []
    if auth_token:
        interceptors = [
            cls(auth_token) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary)
        ]
    if tls_ca or tls_cert:
        credentials = _credentials(tls_ca, tls_cert, tls_key)
        return grpc.aio.secure_channel(address, credentials, options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options, interceptors=interceptors)
