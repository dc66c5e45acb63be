"""The security settings of anything that listens (store, engine, conductor): one set of
flags, and the three things a service does with them as it starts: read its tokens, bind
its port, and refuse to listen beyond loopback without them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.auth.authenticator import Authenticator
from kvstore.auth.exposure import check_exposure
from kvstore.auth.tls import server_credentials
from kvstore.auth.tokens import TokenTable
from kvstore.config import option
from kvstore.errors import InvalidArgumentError


@dataclass(frozen=True)
class ListenerSecurity:
    """Tokens and TLS of a listening service: a table its config holds (`config.table`)."""

    auth_token_file: str = option("", "file of 'TENANT TOKEN' lines; calls need a known token")
    tls_cert: str = option("", "PEM certificate chain: serve gRPC over TLS")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_client_ca: str = option("", "PEM CA that client certificates must chain to (mutual TLS)")
    insecure: bool = option(False, "allow a non-loopback --host without --auth-token-file")

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgumentError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key")


def read_tokens(security: ListenerSecurity) -> Authenticator:
    """Reads --auth-token-file, once per start (InvalidArgumentError naming what is wrong
    with it); without one, every call is anonymous."""
    table = TokenTable.load(security.auth_token_file) if security.auth_token_file else None
    return Authenticator(table)


def check_listener(security: ListenerSecurity, host: str) -> None:
    """Refuses a non-loopback `host` without authentication unless --insecure."""
    has_auth, has_tls = bool(security.auth_token_file), bool(security.tls_cert)
    check_exposure(host, has_auth, has_tls, security.insecure)


def add_port(server: Any, address: str, security: ListenerSecurity) -> int:
    """Binds `address` on a grpc or grpc.aio server, with TLS when a certificate is given;
    returns the port."""
    if not security.tls_cert:
        return int(server.add_insecure_port(address))
    creds = server_credentials(security.tls_cert, security.tls_key, security.tls_client_ca)
    return int(server.add_secure_port(address, creds))
