"""Tenant bytes: how many bytes of one tier each tenant holds, and its quota there.

DRAM is charged by slot (`ChargedDram`): a slot counts against the tenant it was allocated
for until it is freed, stale slots of leased blocks included, so the tier is never fuller
than the sum of what its tenants are charged. SSD is charged by tracked record (`SsdSpace`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

from kvstore.auth import ANONYMOUS
from kvstore.store.tiers.base import Slot
from kvstore.store.tiers.dram import DramTier

QuotaOf = Callable[[str], "int | None"]  # tenant -> its bytes in a tier, None: no limit
TenantOf = Callable[[bytes], str]  # namespace id -> the tenant that registered it


class TenantBytes:
    """Bytes held per tenant in one tier; `quota_of` gives each one's quota there."""

    def __init__(self, quota_of: QuotaOf | None = None) -> None:
        self._held: Counter[str] = Counter()
        self._quota_of = quota_of

    @property
    def has_quotas(self) -> bool:
        return self._quota_of is not None

    def quota(self, tenant: str) -> int | None:
        return None if self._quota_of is None else self._quota_of(tenant)

    def held(self, tenant: str) -> int:
        return self._held[tenant]

    def by_tenant(self) -> dict[str, int]:
        return {t: n for t, n in self._held.items() if n}

    def add(self, tenant: str, nbytes: int) -> None:
        self._held[tenant] += nbytes

    def remove(self, tenant: str, nbytes: int) -> None:
        self._held[tenant] -= nbytes
        assert self._held[tenant] >= 0, f"{tenant} holds less than nothing"

    def room(self, tenant: str, nbytes: int) -> int:
        """How many bytes `tenant` must give up before `nbytes` more fit its quota."""
        quota = self.quota(tenant)
        return 0 if quota is None else max(0, self._held[tenant] + nbytes - quota)


class ChargedDram(DramTier):
    """A DRAM tier whose slots are charged to the tenant named by `charged_to`."""

    def __init__(self, capacity_bytes: int, slab_bytes: int, quota_of: QuotaOf | None) -> None:
        super().__init__(capacity_bytes, slab_bytes)
        self.tenants = TenantBytes(quota_of)
        self._charged = ANONYMOUS
        self._owners: dict[int, str] = {}  # slot offset -> tenant charged

    @contextlib.contextmanager
    def charged_to(self, tenant: str) -> Iterator[None]:
        """Slots allocated inside count against `tenant` (under the store's lock)."""
        before, self._charged = self._charged, tenant
        try:
            yield
        finally:
            self._charged = before

    def allocate(self, nbytes: int) -> Slot | None:
        slot = super().allocate(nbytes)
        if slot is not None:
            self._owners[slot.offset] = self._charged
            self.tenants.add(self._charged, slot.nbytes)
        return slot

    def free(self, slot: Slot) -> None:
        super().free(slot)
        self.tenants.remove(self._owners.pop(slot.offset), slot.nbytes)
