"""TLS for a listening node: its certificate chain and key, and, for mutual TLS, the CA
that client certificates must chain to."""

from __future__ import annotations

from pathlib import Path

import grpc

from kvstore.errors import InvalidArgumentError


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file; InvalidArgumentError naming `what` when it cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read the {what} {path}: {exc}") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgumentError(f"the {what} {path} is not PEM")
    return data


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """Credentials of a TLS port; with `client_ca`, clients must present a certificate it
    signed (mutual TLS)."""
    chain = [(read_pem(key, "TLS key"), read_pem(cert, "TLS certificate"))]
    if not client_ca:
        return grpc.ssl_server_credentials(chain)
    roots = read_pem(client_ca, "client CA")
    return grpc.ssl_server_credentials(chain, root_certificates=roots, require_client_auth=True)
