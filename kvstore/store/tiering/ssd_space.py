"""SSD space: which blocks are on SSD, in what order they go, and what makes room there.

SSD is inclusive: a promoted block keeps its SSD record, so evicting a clean block from
DRAM is free. Under pressure the SSD copies of blocks still in DRAM (`redundant`) go first:
the block stays servable, and SSD holds DRAM + SSD distinct blocks instead of SSD alone.
Only then do SSD-only blocks leave the store, in the SSD policy's order.

With tenant quotas (`tenant_bytes`), a write first makes room within the quota of each
tenant it writes for, from that tenant's own copies only (redundant ones first); the space
of the whole tier is then made from blocks of tenants without a quota alone (those left by
a node that ran without tenants), since quotas that fit the tier leave room for every
tenant's own. A tenant whose SSD blocks are all leased may pass its quota by one write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore.auth import ANONYMOUS
from kvstore.store.eviction import BlockHint, EvictionPolicy
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.tiering.tenant_bytes import TenantBytes, TenantOf
from kvstore.store.tiering.usage import TieringCounters
from kvstore.store.tiers.ssd import SsdTier

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig


class SsdSpace:
    """The SSD policy and the tracking of blocks on SSD; runs under the store's lock.

    It changes memory only: whoever gives a copy up here deletes its record (`SsdWriter`).
    """

    def __init__(
        self,
        config: StoreConfig,
        index: BlockIndex,
        ssd: SsdTier,
        policy: EvictionPolicy,
        counters: TieringCounters,
        tenants: TenantBytes | None = None,
        tenant_of: TenantOf = lambda namespace_id: ANONYMOUS,
    ) -> None:
        self.config = config
        self.index = index
        self.ssd = ssd
        self.policy = policy
        self.counters = counters
        self.tenants = tenants or TenantBytes()
        self.tenant_of = tenant_of
        self._redundant: dict[bytes, Entry] = {}  # on SSD and in DRAM, oldest first

    def track(self, entry: Entry, hint: BlockHint | None = None, is_reused: bool = False) -> None:
        """Tracks `entry`, whose record is on SSD, as on SSD; `hint`: the DRAM policy's, for
        a demoted block; `is_reused`: read in DRAM, which the SSD policy hears of too."""
        entry.on_ssd = True
        self.tenants.add(self.tenant_of(entry.namespace_id), entry.nbytes)
        if entry.slot is not None:
            self._redundant[entry.block_id] = entry
        self.policy.insert(entry.block_id, entry.parent_id, moved=True, hint=hint)
        if is_reused:
            self.policy.touch([entry.block_id])

    def untrack(self, entry: Entry) -> None:
        """Forgets the SSD copy of `entry` (the caller deletes the record)."""
        self.policy.remove(entry.block_id)
        self._redundant.pop(entry.block_id, None)
        entry.on_ssd = False
        self.tenants.remove(self.tenant_of(entry.namespace_id), entry.nbytes)

    def add_dram_copy(self, entry: Entry) -> None:
        """`entry`, on SSD, has just got a DRAM slot (a promotion)."""
        self._redundant[entry.block_id] = entry

    def drop_dram_copy(self, entry: Entry) -> None:
        """`entry` is leaving DRAM."""
        self._redundant.pop(entry.block_id, None)

    def touch(self, entries: Sequence[Entry]) -> None:
        self.policy.touch([e.block_id for e in entries if e.on_ssd])

    def make_room(
        self, needed: int, by_tenant: Mapping[str, int] | None = None
    ) -> tuple[list[Entry], list[Entry]]:
        """Gives up SSD copies until `needed` more bytes fit (`by_tenant`: of those, how many
        each tenant writes, for its quota), for the write that follows to delete. Returns the
        copies of blocks still in DRAM (pinned until that write ends), and those of blocks it
        dropped (out of the index)."""
        copies: list[Entry] = []
        dropped: list[Entry] = []
        for tenant, nbytes in (by_tenant or {}).items():
            excess = self.tenants.room(tenant, nbytes)
            if excess > 0:
                self._free(excess, self._of_tenant(tenant), copies, dropped)
        cap = self.ssd.capacity_bytes
        used = self.ssd.stats().used_bytes - sum(e.nbytes for e in copies + dropped)
        if used + needed <= self.config.ssd_high_watermark * cap:
            return copies, dropped
        target = self.config.ssd_low_watermark * cap - needed
        self._free(used - target, self._is_unquoted, copies, dropped)
        return copies, dropped

    def _free(
        self,
        nbytes: float,
        is_mine: Callable[[Entry], bool],
        copies: list[Entry],
        dropped: list[Entry],
    ) -> None:
        """Gives up copies of blocks `is_mine` accepts, redundant ones first, until `nbytes`
        are freed or none is left; appends them to `copies` and `dropped`."""
        for entry in [e for e in self._redundant.values() if is_mine(e)]:
            if nbytes <= 0:
                return
            entry.num_leases += 1  # stays in DRAM till the write ends: if it fails, back on SSD
            copies.append(entry)
            self._give_up(entry)
            nbytes -= entry.nbytes
        while nbytes > 0:
            victims = self._victims(nbytes, is_mine)
            if not victims:
                return
            for entry in victims:
                dropped.append(entry)
                self._give_up(entry)
                nbytes -= entry.nbytes

    def _of_tenant(self, tenant: str) -> Callable[[Entry], bool]:
        return lambda entry: self._tenant(entry) == tenant

    def _tenant(self, entry: Entry) -> str:
        return self.tenant_of(entry.namespace_id)

    def _is_unquoted(self, entry: Entry) -> bool:
        return not self.tenants.has_quotas or self.tenants.quota(self._tenant(entry)) is None

    def check(self, committed: Iterable[Entry]) -> None:
        """Asserts that policy, records and `committed` (every committed block) agree."""
        committed = list(committed)
        assert sum(e.on_ssd for e in committed) == len(self.policy), "SSD policy"
        assert self.ssd.stats().num_slots == len(self.policy), "SSD records and entries"
        both = {e.block_id for e in committed if e.slot is not None and e.on_ssd}
        assert set(self._redundant) == both, "redundant copies are mistracked"
        on_ssd = sum(e.nbytes for e in committed if e.on_ssd)
        assert sum(self.tenants.by_tenant().values()) == on_ssd, "SSD tenant bytes are off"

    def _victims(self, nbytes: float, is_mine: Callable[[Entry], bool]) -> list[Entry]:
        """Evictable SSD entries `is_mine` accepts, in policy order, enough to free `nbytes`
        (one pass)."""
        victims = []
        for key in self.policy.candidates():
            if nbytes <= 0:
                break
            entry = self.index.get(key)
            assert entry is not None and entry.on_ssd, "SSD policy is stale"
            if entry.num_leases == 0 and is_mine(entry):
                victims.append(entry)
                nbytes -= entry.nbytes
        return victims

    def _give_up(self, entry: Entry) -> None:
        """Forgets the SSD copy; drops a block left nowhere."""
        self.untrack(entry)
        if entry.slot is None:
            self.index.pop(entry.block_id)
            self.counters.drops += 1
