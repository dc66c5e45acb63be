"""DRAM space: slots for new and promoted blocks, the DRAM policy, and eviction.

A victim that is on SSD is clean and leaves DRAM at once; one that is not is written to
SSD first when the DRAM policy thinks it worth keeping (`should_demote`), else dropped:
DRAM blocks are a cache. A block leaving DRAM leaves HBM with it (HBM is inclusive).

With tenant quotas (`tenant_bytes`), a tenant's slots count against its DRAM quota; a put
that would take it over evicts that tenant's own blocks, in the policy's order restricted to
them, and never another's (`StoreFullError` naming the quota when its own cannot make room).
Demotion then works per tenant too: a tenant over the high watermark of its quota is cleaned
down to the low watermark of its quota.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvstore import errors
from kvstore.auth import ANONYMOUS
from kvstore.store.eviction import BlockHint, EvictionPolicy
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.tiering.hbm_space import HbmCache
from kvstore.store.tiering.slots import MemorySlots
from kvstore.store.tiering.ssd_space import SsdSpace
from kvstore.store.tiering.ssd_writes import SsdWriter
from kvstore.store.tiering.tenant_bytes import ChargedDram, TenantOf
from kvstore.store.tiering.usage import TieringCounters
from kvstore.store.tiers.base import Slot


class DramSpace:
    """DRAM slots and victims; every method runs under the store's lock."""

    def __init__(
        self,
        index: BlockIndex,
        tier: ChargedDram,
        policy: EvictionPolicy,
        counters: TieringCounters,
        hbm: HbmCache | None,
        writer: SsdWriter | None,
        tenant_of: TenantOf = lambda namespace_id: ANONYMOUS,
    ) -> None:
        self.index = index
        self.tenant_of = tenant_of
        self.tier = tier
        self.policy = policy
        self.counters = counters
        self.hbm = hbm
        self.writer = writer
        self.ssd_space: SsdSpace | None = None if writer is None else writer.space
        self._slots = MemorySlots(tier)

    def allocate(self, nbytes: int, count: int, tenant: str = ANONYMOUS) -> list[Slot]:
        """`count` DRAM slots charged to `tenant`, evicting as needed (with quotas, only the
        tenant's own blocks); all or nothing (StoreFullError)."""
        slots: list[Slot] = []
        try:
            for _ in range(count):
                slots.append(self._allocate_one(nbytes, tenant))
        except errors.StoreFullError:
            for slot in slots:
                self.tier.free(slot)
            raise
        return slots

    def victim(self, nbytes: int | None, tenant: str | None = None) -> Entry | None:
        """The policy's best evictable block (of `tenant`, unless None), preferring one of
        the slot size of `nbytes`."""
        size_class = None if nbytes is None else self.tier.size_class(nbytes)
        fallback = None
        for key in self.policy.candidates():
            entry = self.index.get(key)
            assert entry is not None and entry.slot is not None, "DRAM policy is stale"
            if not entry.is_evictable:
                continue
            if tenant is not None and self.tenant_of(entry.namespace_id) != tenant:
                continue
            if size_class in (None, self.tier.size_class(entry.nbytes)):
                return entry
            if self.tier.has_free_slab():
                return entry
            fallback = fallback or entry
        return fallback

    def evict_now(self, victim: Entry) -> None:
        """Evicts a victim that needs no SSD write: it is clean, or not worth keeping."""
        self.counters.evictions += 1
        if not victim.on_ssd:
            self.counters.drops += 1
            self.index.pop(victim.block_id)
        self.free(victim)

    def free(self, entry: Entry) -> None:
        """Takes `entry` out of DRAM (and HBM); a leased slot is freed by its last lease."""
        assert entry.slot is not None
        if self.hbm is not None:
            self.hbm.forget(entry)
        if self.ssd_space is not None:
            self.ssd_space.drop_dram_copy(entry)
        self.policy.remove(entry.block_id)
        self._slots.release(entry, entry.slot)
        entry.slot = None
        self.index.note(entry)  # now on SSD only, or gone

    def end_lease(self, entry: Entry) -> None:
        """Ends one lease (or pin) of `entry`, in every memory tier: the one release path."""
        entry.num_leases -= 1
        self._slots.end_lease(entry)
        if self.hbm is not None:
            self.hbm.end_lease(entry)

    def is_over(self, fraction: float) -> bool:
        """Whether DRAM (with quotas: some tenant's quota) is fuller than `fraction`."""
        return any(excess > 0 for _, excess in self.excess(fraction))

    def excess(self, fraction: float) -> list[tuple[str | None, float]]:
        """Bytes over `fraction` of the tier, as `[(None, bytes)]`; with quotas, of each
        tenant's quota, as `[(tenant, bytes), ...]` (negative: under it)."""
        tenants = self.tier.tenants
        if not tenants.has_quotas:
            return [(None, self.tier.stats().used_bytes - fraction * self.tier.capacity_bytes)]
        out: list[tuple[str | None, float]] = []
        for tenant, held in tenants.by_tenant().items():
            quota = tenants.quota(tenant)
            if quota is not None:
                out.append((tenant, held - fraction * quota))
        return out

    def write_out(self, entries: list[Entry], hints: Mapping[bytes, BlockHint | None]) -> None:
        """Writes `entries` to SSD now, under the lock (the eviction path's fallback). If
        that fails they stay off SSD, and memory still describes the disk."""
        assert self.writer is not None
        batch = self.writer.prepare(entries)
        is_written = self.writer.run(batch)
        for entry in batch.copies:
            self.end_lease(entry)
        self.writer.end(batch, is_written)
        if is_written:
            self.writer.finish(entries, hints)

    def check(self, entries: Iterable[Entry]) -> None:
        """Asserts that policy, slots and `entries` (every indexed block) agree."""
        entries = list(entries)
        in_dram = sum(e.slot is not None and not e.is_demoting and e.is_readable for e in entries)
        assert in_dram == len(self.policy), "DRAM policy and entries disagree"
        assert not any(e.is_demoting for e in entries), "demotion left a pin"
        self._slots.check(sum(e.slot is not None for e in entries))
        charged = sum(self.tier.tenants.by_tenant().values())
        assert charged == self.tier.stats().used_bytes, "DRAM tenant bytes are off"

    def _allocate_one(self, nbytes: int, tenant: str) -> Slot:
        tenants = self.tier.tenants
        while tenants.room(tenant, nbytes) > 0:
            self._evict_one(nbytes, tenant, is_quota=True)
        scope = tenant if tenants.has_quotas else None
        slot = self._take(nbytes, tenant)
        while slot is None:
            self._evict_one(nbytes, scope)
            slot = self._take(nbytes, tenant)
        return slot

    def _take(self, nbytes: int, tenant: str) -> Slot | None:
        with self.tier.charged_to(tenant):
            return self.tier.allocate(nbytes)

    def _evict_one(self, nbytes: int, tenant: str | None = None, is_quota: bool = False) -> None:
        victim = self.victim(nbytes, tenant)
        if victim is None and is_quota:
            tenants = self.tier.tenants
            raise errors.StoreFullError(
                f"tenant {tenant} holds {tenants.held(tenant or '')} bytes of its DRAM quota of "
                f"{tenants.quota(tenant or '')}; none of its blocks can make room for {nbytes} "
                "more (leased or reserved)"
            )
        if victim is None:
            raise errors.StoreFullError(
                f"no evictable block for {nbytes} bytes: DRAM is leased or reserved"
            )
        is_worth_writing = self.writer is not None and self.policy.should_demote(victim.block_id)
        if not victim.on_ssd and is_worth_writing:
            self.write_out([victim], {victim.block_id: self.policy.hint(victim.block_id)})
        self.evict_now(victim)  # dropped if its write failed: DRAM blocks are a cache
