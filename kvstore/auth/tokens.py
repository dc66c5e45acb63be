"""The node's token table: lines of ``TENANT TOKEN`` in a file only the operator can read.

Lookups compare a presented token with every known one in constant time (digests, so
lengths leak nothing either): how long a lookup takes says nothing about which tokens exist.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path
from typing import NamedTuple

from kvstore.errors import InvalidArgumentError

MIN_TOKEN_CHARS = 16  # a bearer token shorter than this is guessable
_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class _Entry(NamedTuple):
    tenant: str
    digest: bytes  # SHA-256 of the token


class TokenTable:
    """Tokens and the tenant each one acts as; one tenant may have several tokens."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        if not pairs:
            raise InvalidArgumentError("the token table is empty")
        digests = [_digest(token) for _, token in pairs]
        if len(set(digests)) != len(digests):
            raise InvalidArgumentError("the same token is listed twice")
        self._entries = [_Entry(t, d) for (t, _), d in zip(pairs, digests, strict=True)]

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Reads `path`: one ``TENANT TOKEN`` per line; blank lines and ``#`` comments skipped.

        Raises:
            InvalidArgumentError: a line that is not a valid pair (its number is named, never
                its text: it may hold a secret), or a file that cannot be read.
        """
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read the token file {path}: {exc}") from None
        pairs = []
        for number, line in enumerate(lines, start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            pairs.append(_pair(line, number, path))
        return cls(pairs)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(e.tenant for e in self._entries)

    def tenant_of(self, token: str) -> str | None:
        """The tenant `token` acts as, or None; the time taken does not depend on which."""
        digest = _digest(token)
        found = None
        for entry in self._entries:  # no early exit
            if hmac.compare_digest(entry.digest, digest):
                found = entry.tenant
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _pair(line: str, number: int, path: str | Path) -> tuple[str, str]:
    fields = line.split()
    if len(fields) != 2:
        raise InvalidArgumentError(f"{path}:{number}: expected 'TENANT TOKEN'")
    tenant, token = fields
    if not _TENANT.fullmatch(tenant):
        raise InvalidArgumentError(f"{path}:{number}: a tenant is 1-64 of [A-Za-z0-9_.-]")
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidArgumentError(f"{path}:{number}: a token needs {MIN_TOKEN_CHARS}+ chars")
    return tenant, token
