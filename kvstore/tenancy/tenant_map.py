"""The tenant map: which internal namespace a tenant's namespace id names, and what the
tenant may do there.

Keys stay what clients compute (`block_keys` over their `Namespace`). The node maps each
(tenant, client namespace id) to an internal id, a keyed BLAKE2b of the node's secret and
both: the server-derived salt. Index, tiers and SSD records use internal ids only, so two
tenants with the same model never share a block, and none can name another's namespace.
Responses carry client ids only.

Sharing on purpose: an operator-named public tenant (`--public-tenant`) publishes
namespaces every tenant may read (match, get) and only it may write or remove. A tenant's
read of namespace N looks in its own N first, block by block, then in the public N; a write
goes to its own N (registering N is how a tenant makes its own). A tenant that has not
registered N but names it in a write or remove, where the public tenant has N, gets
PERMISSION_DENIED. What is public is observable by every tenant: that is its point.

Without a secret (a node that does not authenticate) there is one tenant, `ANONYMOUS`, and
ids map to themselves, so existing SSD data stays readable.
"""

from __future__ import annotations

import hashlib

from kvstore.auth import ANONYMOUS
from kvstore.errors import PermissionDeniedError, UnknownNamespaceError
from kvstore.keys import KEY_BYTES
from kvstore.store.caller import IsRegistered

_DOMAIN = b"kvstore-tenant-namespace-v1\x00"


class TenantMap:
    """Tenant namespace ids -> internal ids, and the rules of the public tenant.

    Args:
        secret: the node's tenant secret (`kvstore.tenancy.secret`); None: identity mapping.
        public_tenant: the tenant whose namespaces all may read; "" for none.
    """

    def __init__(self, secret: bytes | None, public_tenant: str = "") -> None:
        self._secret = secret
        self.public_tenant = public_tenant

    @property
    def is_enabled(self) -> bool:
        return self._secret is not None

    def internal_id(self, tenant: str, namespace_id: bytes) -> bytes:
        """The id the node files `tenant`'s namespace `namespace_id` under."""
        if self._secret is None:
            return namespace_id
        data = _DOMAIN + tenant.encode() + b"\x00" + namespace_id
        return hashlib.blake2b(data, key=self._secret[:64], digest_size=KEY_BYTES).digest()

    def of(self, tenant: str) -> TenantNamespaces:
        """`tenant`'s namespace ids as the store sees them."""
        return TenantNamespaces(self, tenant)

    def public_id(self, tenant: str, namespace_id: bytes) -> bytes | None:
        """The public namespace `tenant`'s `namespace_id` reads beneath its own, if any."""
        if not self.public_tenant or tenant == self.public_tenant or tenant == ANONYMOUS:
            return None
        return self.internal_id(self.public_tenant, namespace_id)


class TenantNamespaces:
    """One tenant's namespace ids -> internal ids, under the public tenant's rules: the
    store's `NamespaceMap` for that tenant's calls."""

    def __init__(self, tenant_map: TenantMap, tenant: str) -> None:
        self._map = tenant_map
        self._tenant = tenant

    def register_id(self, namespace_id: bytes) -> bytes:
        return self._map.internal_id(self._tenant, namespace_id)

    def read_ids(
        self, namespace_id: bytes, is_registered: IsRegistered
    ) -> tuple[bytes, bytes | None]:
        """Its own namespace, then the public one; the public one alone where it has not
        registered its own (UnknownNamespaceError: neither)."""
        own = self._map.internal_id(self._tenant, namespace_id)
        public = self._map.public_id(self._tenant, namespace_id)
        if public is not None and not is_registered(public):
            public = None
        if is_registered(own):
            return own, public
        if public is not None:
            return public, None
        raise _unknown(namespace_id)

    def write_id(self, namespace_id: bytes, is_registered: IsRegistered) -> bytes:
        """Its own namespace; PERMISSION_DENIED for one only the public tenant has,
        UnknownNamespaceError for one nobody has."""
        own = self._map.internal_id(self._tenant, namespace_id)
        if is_registered(own):
            return own
        public = self._map.public_id(self._tenant, namespace_id)
        if public is not None and is_registered(public):
            raise PermissionDeniedError(
                f"namespace {namespace_id.hex()[:16]}... is public: only "
                f"{self._map.public_tenant} may write or remove there; "
                "register it to write your own"
            )
        raise _unknown(namespace_id)


def _unknown(namespace_id: bytes) -> UnknownNamespaceError:
    return UnknownNamespaceError(
        f"unknown namespace {namespace_id.hex()[:16]}...; register it first"
    )
