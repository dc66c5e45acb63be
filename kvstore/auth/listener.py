"""The security settings of anything that listens (store, engine, conductor): one set of
flags, one way to bind a port, one rule on where a service may listen without them."""

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
    """Tokens and TLS of a listening service; a service's config class inherits these fields
    (so they become its flags) and calls `check_security` from its `__post_init__`."""

    auth_token_file: str = option("", "file of 'TENANT TOKEN' lines; calls need a known token")
    tls_cert: str = option("", "PEM certificate chain: serve gRPC over TLS")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_client_ca: str = option("", "PEM CA that client certificates must chain to (mutual TLS)")
    insecure: bool = option(False, "allow a non-loopback --host without --auth-token-file")

    def check_security(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgumentError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key")

    def authenticator(self) -> Authenticator:
        """Reads --auth-token-file (InvalidArgumentError naming what is wrong with it)."""
        table = TokenTable.load(self.auth_token_file) if self.auth_token_file else None
        return Authenticator(table)

    def check_exposure(self, host: str) -> None:
        """Refuses a non-loopback `host` without authentication unless --insecure."""
        check_exposure(host, bool(self.auth_token_file), bool(self.tls_cert), self.insecure)

    def add_port(self, server: Any, address: str) -> int:
        """Binds `address` on a grpc or grpc.aio server, with TLS when a certificate is
        given; returns the port."""
        if not self.tls_cert:
            return int(server.add_insecure_port(address))
        creds = server_credentials(self.tls_cert, self.tls_key, self.tls_client_ca)
        return int(server.add_secure_port(address, creds))
