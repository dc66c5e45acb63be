"""Tenants: the node's tenant map, its operator and public tenants, the per-tenant bounds,
and each tenant's own counters. A call acts through a `TenantScope` over them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.errors import InvalidArgumentError
from kvstore.keys import Namespace
from kvstore.results import StoreStats
from kvstore.store import Store
from kvstore.store.counters import StoreCounters
from kvstore.store.leases import Lease
from kvstore.store.tiering import TieringCounters
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
    """The tenants of one node, over `store`; `secret` None: a node without tenants."""

    def __init__(self, store: Store, secret: bytes | None, roles: TenantRoles | None = None):
        roles = roles or TenantRoles()
        self.store = store
        self.tenant_map = TenantMap(secret, roles.public_tenant)
        self.admin_tenant = roles.admin_tenant
        self.max_namespaces_per_tenant = roles.max_namespaces_per_tenant
        self._lock = threading.Lock()  # gRPC's loop and the data plane's thread count here
        self._counters: dict[str, StoreCounters] = {}

    def count_read(self, tenant: str, lease: Lease, namespace: Namespace) -> None:
        num_hits = sum(lease.found)
        num_misses = len(lease.found) - num_hits
        block_tokens, nbytes = namespace.block_tokens, num_hits * namespace.block_bytes
        with self._lock:
            c = self._counters.setdefault(tenant, StoreCounters())
            c.hits += num_hits
            c.misses += num_misses
            c.miss_tokens += num_misses * block_tokens
            c.bytes_read += nbytes

    def count_commit(self, tenant: str, num_blocks: int, nbytes: int) -> None:
        with self._lock:
            c = self._counters.setdefault(tenant, StoreCounters())
            c.blocks_committed += num_blocks
            c.bytes_written += nbytes

    def stats_of(self, tenant: str) -> StoreStats:
        """`tenant`'s own view: its blocks, namespaces, bytes per tier (its quota as the
        capacity) and counters; node-wide events (evictions, demotions, ...) read 0."""
        num_blocks, tiers = self.store.tenant_usage(tenant)
        num_namespaces = self.store.num_namespaces_of(tenant)
        with self._lock:
            counters = self._counters.get(tenant, StoreCounters())
            sizes = (num_blocks, num_namespaces, 0, 0)
            return counters.stats(sizes, TieringCounters(), tiers)
