"""A tenant scope: the store as one tenant sees it, the only way a call reaches the store.

Every method takes the tenant's own namespace ids (the `Namespace.id` it computed) and maps
them through the node's `TenantMap` before the store sees them, so what a tenant names is
always its own namespace (or, for reads, the public one); nothing it can send names another
tenant's. Reservations and leases are owned by, and counted against, the tenant (its
clients share them); on a node without tenants, by the calling client as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore.auth import ANONYMOUS
from kvstore.keys import Namespace
from kvstore.limits import LOCAL_OWNER
from kvstore.results import MatchResult, NamespaceInfo, ReserveResult, StoreStats
from kvstore.store import Store
from kvstore.store.config import StoreConfig
from kvstore.store.leases import Lease

if TYPE_CHECKING:
    from kvstore.tenancy.tenants import Tenants


class TenantScope:
    """The store as `tenant` sees it; made by `Tenants.scope`."""

    def __init__(self, tenants: Tenants, tenant: str) -> None:
        self.tenants = tenants
        self.tenant = tenant
        self.store: Store = tenants.store
        self._map = tenants.tenant_map

    @property
    def config(self) -> StoreConfig:
        return self.store.config

    # -- namespaces ----------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace) -> NamespaceInfo:
        """Registers `namespace` as the tenant's own; its id in the reply is the one the
        tenant computed (internal ids never leave the node)."""
        internal = self._map.internal_id(self.tenant, namespace.id)
        limit = self.tenants.max_namespaces_per_tenant if self._map.is_enabled else None
        return self.store.register_namespace(namespace, internal, self.tenant, limit)

    def namespace(self, namespace_id: bytes) -> Namespace:
        """The namespace a read of `namespace_id` reads (UnknownNamespaceError: none)."""
        return self.store.namespace(self._read_ids(namespace_id)[0])

    # -- reads ---------------------------------------------------------------------------

    def match(self, namespace_id: bytes, keys: Sequence[bytes]) -> MatchResult:
        own, public = self._read_ids(namespace_id)
        return self.store.match(own, keys, public)

    def acquire(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        device: bool = False,
        owner: str = LOCAL_OWNER,
    ) -> Lease:
        own, public = self._read_ids(namespace_id)
        lease = self.store.acquire(own, keys, device, self._owner(owner), public)
        self.tenants.count_read(self.tenant, lease, self.store.namespace(own))
        return lease

    def release(self, lease_id: int) -> None:
        self.store.release(lease_id)  # lease ids come from this node's own calls only

    def read_chunk(self, lease_id: int, index: int, offset: int, nbytes: int) -> bytes:
        return self.store.read_chunk(lease_id, index, offset, nbytes)

    # -- writes --------------------------------------------------------------------------

    def reserve(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
        owner: str = LOCAL_OWNER,
    ) -> ReserveResult:
        """Reserves in the tenant's own namespace. A parent that is a public block (the
        tenant's chain goes on from a published prefix) is taken as no parent: the block is
        a root of the tenant's namespace, as chains never cross namespaces."""
        internal = self._write_id(namespace_id)
        public = self._map.public_id(self.tenant, namespace_id, self.store.is_registered)
        if public is not None and parents is not None:
            parents = self._own_parents(internal, public, keys, parents)
        return self.store.reserve(internal, keys, parents, self._owner(owner))

    def write(
        self,
        reservation_id: int,
        index: int,
        offset: int,
        data: memoryview | bytes,
        owner: str = LOCAL_OWNER,
    ) -> None:
        self.store.write(reservation_id, index, offset, data, self._owner(owner))

    def rewind(
        self, reservation_id: int, index: int, offset: int, owner: str = LOCAL_OWNER
    ) -> None:
        self.store.rewind(reservation_id, index, offset, self._owner(owner))

    def reservation_views(self, reservation_id: int, owner: str = LOCAL_OWNER) -> dict:
        return self.store.reservation_views(reservation_id, self._owner(owner))

    def commit(
        self,
        reservation_id: int,
        checksums: Sequence[int] | None = None,
        owner: str = LOCAL_OWNER,
        written: Mapping[int, int] | None = None,
    ) -> int:
        owner = self._owner(owner)
        views = self.store.reservation_views(reservation_id, owner) if reservation_id else {}
        num = self.store.commit(reservation_id, checksums, owner, written)
        self.tenants.count_commit(self.tenant, num, sum(len(v) for v in views.values()))
        return num

    def abort(self, reservation_id: int, owner: str = LOCAL_OWNER) -> None:
        self.store.abort(reservation_id, self._owner(owner))

    def remove(self, namespace_id: bytes, keys: Sequence[bytes]) -> int:
        return self.store.remove(self._write_id(namespace_id), keys)

    # -- stats ---------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """Node-wide for the operator (`--admin-tenant`) and on a node without tenants;
        for any other tenant, its own blocks, namespaces, bytes and counters only."""
        if not self._map.is_enabled or self.tenant == self.tenants.admin_tenant:
            return self.store.stats()
        return self.tenants.stats_of(self.tenant)

    # -- internals -----------------------------------------------------------------------

    def _owner(self, owner: str) -> str:
        return owner if self.tenant == ANONYMOUS else self.tenant

    def _read_ids(self, namespace_id: bytes) -> tuple[bytes, bytes | None]:
        """(where a read looks first, where next); a public-only namespace is read there."""
        target = self._map.read_target(self.tenant, namespace_id, self.store.is_registered)
        if target.own is None:
            assert target.public is not None
            return target.public, None
        return target.own, target.public

    def _own_parents(
        self,
        internal: bytes,
        public: bytes,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None],
    ) -> list[bytes | None]:
        earlier = set(keys)
        out = list(parents)
        for i, parent in enumerate(parents):
            if parent is None or parent in earlier or len(parent) != len(keys[i]):
                continue  # malformed ones stay, for the store to refuse
            if not self.store.has_key(internal, parent) and self.store.has_key(public, parent):
                out[i] = None
        return out

    def _write_id(self, namespace_id: bytes) -> bytes:
        return self._map.write_target(self.tenant, namespace_id, self.store.is_registered)
