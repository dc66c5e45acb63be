"""Checks a call's bearer token (gRPC metadata ``authorization: Bearer TOKEN``)."""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.auth.tokens import TokenTable
from kvstore.errors import UnauthenticatedError

ANONYMOUS = ""  # the one tenant of a node without a token table
_SCHEME = "bearer "


class Authenticator:
    """The tenant of a call, from its metadata; with no table every call is `ANONYMOUS`.

    Args:
        table: the node's tokens, or None for a node that does not authenticate.
    """

    def __init__(self, table: TokenTable | None) -> None:
        self.table = table

    @property
    def is_enabled(self) -> bool:
        return self.table is not None

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The tenant the call acts as.

        Raises:
            UnauthenticatedError: authentication is on and the call has no known token.
        """
        if self.table is None:
            return ANONYMOUS
        values = [v for k, v in metadata or () if k.lower() == "authorization"]  # HTTP: any case
        if len(values) != 1 or not isinstance(values[0], str):
            raise UnauthenticatedError("the call needs one 'authorization: Bearer TOKEN'")
        value = values[0]
        if value[: len(_SCHEME)].lower() != _SCHEME:
            raise UnauthenticatedError("the authorization scheme must be Bearer")
        tenant = self.table.tenant_of(value[len(_SCHEME) :].strip())
        if tenant is None:
            raise UnauthenticatedError("unknown token")
        return tenant
