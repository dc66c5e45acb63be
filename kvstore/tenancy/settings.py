"""The tenancy settings of a store node (a table `ServerConfig` holds: flags of `kvstore
serve`), and, as the node starts, the quotas and `Tenants` they make."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvstore.auth import Authenticator
from kvstore.config import option
from kvstore.errors import InvalidArgumentError
from kvstore.store import Store
from kvstore.store.config import StoreConfig
from kvstore.store.quotas import QUOTA_TIERS, TenantQuotas
from kvstore.tenancy.secret import load_secret
from kvstore.tenancy.tenants import TenantRoles, Tenants

log = logging.getLogger("kvstore.tenancy")


@dataclass(frozen=True)
class TenancySettings:
    """Who the tenants of an authenticating node are to each other, and what each may hold."""

    tenant_secret_file: str = option(
        "", "hex secret the tenants' namespace ids are derived with (default: kept with SSD)"
    )
    tenant_quotas_file: str = option("", "file of 'TENANT dram=SIZE ssd=SIZE' lines ('*': rest)")
    public_tenant: str = option("", "tenant whose namespaces every tenant may read")
    admin_tenant: str = option("", "tenant that sees node-wide stats (others: their own)")
    max_namespaces_per_tenant: int = option(64, "most namespaces one tenant registers")

    def __post_init__(self) -> None:
        if self.max_namespaces_per_tenant < 1:
            raise InvalidArgumentError("max_namespaces_per_tenant must be >= 1")


def load_quotas(settings: TenancySettings, auth: Authenticator) -> TenantQuotas | None:
    """The quotas file, read (None without one); needs authentication."""
    if not settings.tenant_quotas_file:
        return None
    if auth.table is None:
        raise InvalidArgumentError("--tenant-quotas-file needs --auth-token-file")
    return TenantQuotas.load(settings.tenant_quotas_file)


def make_tenants(settings: TenancySettings, store: Store, auth: Authenticator) -> Tenants:
    """The node's tenants over `store` (made with `load_quotas`); refuses quotas that sum
    above a tier's capacity and roles given to tenants without a token."""
    if auth.table is None:
        if settings.public_tenant or settings.admin_tenant or settings.tenant_secret_file:
            raise InvalidArgumentError("tenant settings need --auth-token-file")
        return Tenants(None)
    known = auth.table.tenants
    per_tenant = settings.max_namespaces_per_tenant
    roles = TenantRoles(settings.admin_tenant, settings.public_tenant, per_tenant)
    roles.check(known)
    if store.quotas is not None:
        _check_capacity(store.quotas, known, store)
    cfg: StoreConfig = store.config
    _warn_shared_bounds(cfg, len(known), per_tenant)
    secret = load_secret(settings.tenant_secret_file, cfg.ssd_path)
    if not settings.tenant_secret_file and not cfg.ssd_path:
        log.info("event=tenant_secret source=random hint='ids change at each start'")
    return Tenants(secret, roles)


def _check_capacity(quotas: TenantQuotas, tenants: frozenset[str], store: Store) -> None:
    capacity = {t.name: t.capacity_bytes for t in store.stats().tiers}
    for tier in QUOTA_TIERS:
        if tier in capacity:
            quotas.check_capacity(tenants, tier, capacity[tier])


def _warn_shared_bounds(cfg: StoreConfig, num_tenants: int, namespaces_per_tenant: int) -> None:
    """Warns where the node-wide bound is below every tenant's own summed: then tenants that
    fill theirs can make another's call fail with the node-wide error."""
    bounds = (
        ("namespaces", namespaces_per_tenant, cfg.max_namespaces),
        ("reservations", cfg.max_reservations_per_client, cfg.max_reservations),
        ("leases", cfg.max_leases_per_client, cfg.max_leases),
    )
    for noun, per_tenant, total in bounds:
        if per_tenant * num_tenants > total:
            msg = "event=shared_bound noun=%s per_tenant=%d tenants=%d node=%d"
            log.warning(msg, noun, per_tenant, num_tenants, total)
