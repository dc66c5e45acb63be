"""Tenants of a store node: tokens name tenants, and the node scopes everything by them.

- `secret`: the node's tenant secret (a file, kept beside the SSD tier, or per start);
- `tenant_map`: (tenant, namespace id) -> internal id, the public tenant's rules;
- `tenants`: the node's tenants, roles and bounds, and the `Caller` each call is for.

Blocks of two tenants never meet: they live under different internal namespace ids, so one
tenant can neither read, overwrite, remove nor detect (by hit or miss, `Reserve` status,
stats or timing) what another has cached; with quotas it cannot evict another's blocks
either, nor make another's put fail. Per-tenant byte quotas per tier are the store's own
(`kvstore.store.quotas`), re-exported here for the node's flags.
"""

from kvstore.store.quotas import TenantQuotas
from kvstore.tenancy.secret import load_secret
from kvstore.tenancy.tenant_map import TenantMap
from kvstore.tenancy.tenants import TenantRoles, Tenants

__all__ = ["TenantMap", "TenantQuotas", "TenantRoles", "Tenants", "load_secret"]
