"""Per-tenant byte quotas per tier, from a file of lines ``TENANT dram=4GiB ssd=100GiB``.

A ``*`` line gives every tenant without a line of its own. A tier a line does not name is
unlimited for that tenant, unless the ``*`` line names it. The node refuses to start when
the quotas of a tier, over every tenant of its token table, sum above the tier's capacity:
then each tenant's quota is always there, whatever the others hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from kvstore.config import parse_bytes
from kvstore.errors import InvalidArgumentError

QUOTA_TIERS = ("dram", "ssd")
DEFAULT = "*"
_TENANT = re.compile(r"\*|[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class TenantQuotas:
    """Quotas: tenant (or `DEFAULT`) -> tier -> bytes."""

    by_tenant: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tenant, tiers in self.by_tenant.items():
            if not _TENANT.fullmatch(tenant):
                raise InvalidArgumentError(f"not a tenant name: {tenant!r}")
            for tier, nbytes in tiers.items():
                if tier not in QUOTA_TIERS or nbytes < 0:
                    raise InvalidArgumentError(f"bad quota {tier}={nbytes} of {tenant}")
        frozen = {t: MappingProxyType(dict(q)) for t, q in self.by_tenant.items()}
        object.__setattr__(self, "by_tenant", MappingProxyType(frozen))

    @classmethod
    def load(cls, path: str | Path) -> TenantQuotas:
        """Reads `path`; blank lines and ``#`` comments are skipped.

        Raises:
            InvalidArgumentError: naming the line that is wrong, or the file.
        """
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read the quotas file {path}: {exc}") from None
        by_tenant: dict[str, dict[str, int]] = {}
        for number, line in enumerate(lines, start=1):
            if line.strip() and not line.lstrip().startswith("#"):
                tenant, tiers = _line(line, f"{path}:{number}")
                if tenant in by_tenant:
                    raise InvalidArgumentError(f"{path}:{number}: {tenant} is listed twice")
                by_tenant[tenant] = tiers
        return cls(by_tenant)

    def quota(self, tenant: str, tier: str) -> int | None:
        """The bytes `tenant` may hold in `tier`, or None for no limit."""
        own = self.by_tenant.get(tenant, self.by_tenant.get(DEFAULT, {}))
        if tier in own:
            return own[tier]
        return self.by_tenant.get(DEFAULT, {}).get(tier)

    def check_capacity(self, tenants: Iterable[str], tier: str, capacity_bytes: int) -> None:
        """Raises InvalidArgumentError when the quotas of `tenants` in `tier` sum above
        `capacity_bytes`, or when one of them has none there while others do."""
        quotas = {t: self.quota(t, tier) for t in sorted(tenants)}
        if all(q is None for q in quotas.values()):
            return
        unlimited = [t for t, q in quotas.items() if q is None]
        if unlimited:
            raise InvalidArgumentError(
                f"tenants {unlimited} have no {tier} quota while others do: give them one "
                "(or a '*' line), or none can be sure of its own"
            )
        total = sum(q or 0 for q in quotas.values())
        if total > capacity_bytes:
            raise InvalidArgumentError(
                f"the {tier} quotas sum to {total} bytes, over the tier's {capacity_bytes}"
            )


def _line(line: str, where: str) -> tuple[str, dict[str, int]]:
    tenant, *fields = line.split()
    if not _TENANT.fullmatch(tenant) or not fields:
        raise InvalidArgumentError(f"{where}: expected 'TENANT dram=SIZE ssd=SIZE'")
    tiers = {}
    for item in fields:
        tier, sep, size = item.partition("=")
        if not sep or tier not in QUOTA_TIERS or tier in tiers:
            raise InvalidArgumentError(f"{where}: {item!r} is not one of {QUOTA_TIERS}=SIZE")
        try:
            tiers[tier] = parse_bytes(size)
        except (InvalidArgumentError, ValueError) as exc:
            raise InvalidArgumentError(f"{where}: {tier}: {exc}") from None
    return tenant, tiers
