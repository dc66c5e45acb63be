"""Tenants: the node's tenant map, its operator and public tenants and the per-tenant
bounds; each call's `Caller` (`kvstore.store.caller`) is made here, once, at the edge."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.auth import ANONYMOUS
from kvstore.errors import InvalidArgumentError
from kvstore.store.caller import Caller
from kvstore.tenancy.tenant_map import TenantMap


@dataclass(frozen=True)
class TenantRoles:
    """Tenants with a role: `admin_tenant` sees node-wide stats, `public_tenant` publishes
    namespaces every tenant may read; "" for none."""

    admin_tenant: str = ""
    public_tenant: str = ""
    max_namespaces_per_tenant: int = 64

    def __post_init__(self) -> None:
        if self.max_namespaces_per_tenant < 1:
            raise InvalidArgumentError("max_namespaces_per_tenant must be >= 1")

    def check(self, known: frozenset[str]) -> None:
        """Raises InvalidArgumentError for a role given to a tenant with no token."""
        for role in ("admin_tenant", "public_tenant"):
            name = getattr(self, role)
            if name and name not in known:
                raise InvalidArgumentError(f"--{role.replace('_', '-')} {name} has no token")


class Tenants:
    """The tenants of one node; `secret` None: a node without tenants."""

    def __init__(self, secret: bytes | None, roles: TenantRoles | None = None) -> None:
        self.roles = roles or TenantRoles()
        self.tenant_map = TenantMap(secret, self.roles.public_tenant)

    def caller(self, tenant: str, peer: str) -> Caller:
        """Who a call from `peer` (its gRPC peer), authenticated as `tenant`, is for.

        With tenants, what the call opens (reservations, leases) belongs to and counts
        against its tenant, whose clients share it; without, against the peer. Its
        namespace ids are the tenant's own, mapped before the store sees them."""
        if not self.tenant_map.is_enabled:
            return Caller(owner=peer)
        return Caller(
            owner=peer if tenant == ANONYMOUS else tenant,
            tenant=tenant,
            namespaces=self.tenant_map.of(tenant),
            max_namespaces=self.roles.max_namespaces_per_tenant,
            sees_node=tenant == self.roles.admin_tenant,
        )
