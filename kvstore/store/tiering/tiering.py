"""The tiering facade: the one object the store calls to place, read, release and remove
blocks across HBM, DRAM and SSD. See the package docstring for the invariants."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lmdb

from kvstore import errors
from kvstore.auth import ANONYMOUS
from kvstore.checksum import checksum
from kvstore.results import TierUsage
from kvstore.store.eviction import make_policy
from kvstore.store.index import BlockIndex, Entry
from kvstore.store.tiering.demoter import Demoter
from kvstore.store.tiering.demotion import Demotion
from kvstore.store.tiering.dram_space import DramSpace
from kvstore.store.tiering.hbm_space import HbmCache
from kvstore.store.tiering.promotion import Promotion
from kvstore.store.tiering.recovery import recover_index
from kvstore.store.tiering.ssd_space import SsdSpace
from kvstore.store.tiering.ssd_writes import SsdWriter
from kvstore.store.tiering.tenant_bytes import ChargedDram, TenantBytes, TenantOf
from kvstore.store.tiering.usage import TieringCounters, usage
from kvstore.store.tiers.base import Slot, Tier
from kvstore.store.tiers.ssd import SsdTier

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig
    from kvstore.store.quotas import TenantQuotas

log = logging.getLogger(__name__)


class Tiering:
    """Moves blocks between tiers; every method runs under the store's lock `lock`.

    `dram`, `ssd` (None without an SSD tier) and `hbm` (None without an HBM tier) are the
    tiers; `dram_policy` and `ssd_policy` order their blocks; `counters` count events.
    `quotas`: bytes each tenant may hold in DRAM and on SSD (None: no limits); `tenant_of`
    names the tenant of a namespace id.
    """

    def __init__(
        self,
        config: StoreConfig,
        index: BlockIndex,
        lock: threading.RLock,
        quotas: TenantQuotas | None = None,
        tenant_of: TenantOf = lambda namespace_id: ANONYMOUS,
    ) -> None:
        self.config = config
        self.index = index
        self.lock = lock
        self.counters = TieringCounters()
        self.tenant_of = tenant_of
        dram_quota = None if quotas is None else (lambda t: quotas.quota(t, "dram"))
        self.dram = ChargedDram(config.dram_bytes, config.slab_bytes, dram_quota)
        ssd_quota = None if quotas is None else (lambda t: quotas.quota(t, "ssd"))
        self.ssd_tenants = TenantBytes(ssd_quota)
        self.ssd = (
            SsdTier(config.ssd_path, config.ssd_bytes, config.ssd_sync) if config.ssd_path else None
        )
        self.dram_policy = make_policy(config.policy)
        self.ssd_policy = make_policy(config.ssd_policy)
        self.hbm = HbmCache.from_config(config, self.counters.tiers["hbm"])
        counters = self.counters
        self._ssd_space: SsdSpace | None = None
        self._writer: SsdWriter | None = None
        if self.ssd is not None:
            self._ssd_space = SsdSpace(
                config, index, self.ssd, self.ssd_policy, counters, self.ssd_tenants, tenant_of
            )
            self._writer = SsdWriter(index, lock, self.dram, self._ssd_space, counters)
        self._dram = DramSpace(
            index, self.dram, self.dram_policy, counters, self.hbm, self._writer, tenant_of
        )
        self._promotion: Promotion | None = None
        self._demotion: Demotion | None = None
        if self._ssd_space is not None and self._writer is not None:
            self._promotion = Promotion(self._dram, self._ssd_space, counters)
            self._demotion = Demotion(config, index, lock, self._dram, self._writer)
        self._seq = 0
        self._demoter: Demoter | None = None
        if self.ssd is not None and config.background_demotion:
            # `demote_pass` looked up at each pass, so a test may stand in for it.
            self._demoter = Demoter(lock, counters, self._is_dram_high, lambda: self.demote_pass())

    # -- placement -----------------------------------------------------------------------

    @property
    def slab_bytes(self) -> int:
        """The DRAM tier's slab size: no block is larger."""
        return self.dram.slab_bytes

    def fits_dram(self, nbytes: int) -> bool:
        """Whether a block of `nbytes` fits one DRAM slab (`slab_bytes`)."""
        return self.dram.can_fit(nbytes)

    def views(self, entries: dict[int, Entry]) -> dict[int, memoryview]:
        """The DRAM bytes of each entry that has a DRAM slot, by the entries' own keys."""
        return {i: self.dram.view(e.slot) for i, e in entries.items() if e.slot is not None}

    def eviction_order(self, tier: str) -> list[bytes]:
        """The block ids `tier`'s policy ("dram" or "ssd") would evict, best victim first."""
        policy = {"dram": self.dram_policy, "ssd": self.ssd_policy}[tier]
        return list(policy.candidates())

    def allocate(self, nbytes: int, count: int, tenant: str = ANONYMOUS) -> list[Slot]:
        """`count` DRAM slots charged to `tenant`, evicting as needed (with quotas, only
        the tenant's own blocks); all or nothing (StoreFullError)."""
        return self._dram.allocate(nbytes, count, tenant)

    def tenant_bytes(self) -> dict[str, dict[str, int]]:
        """tier -> tenant -> bytes the tenant holds there."""
        out = {"dram": self.dram.tenants.by_tenant()}
        if self.ssd is not None:
            out["ssd"] = self.ssd_tenants.by_tenant()
        return out

    def tenant_usage(self, tenant: str) -> tuple[int, tuple[TierUsage, ...]]:
        """`tenant`'s committed blocks, and what it holds of each tier: its quota there as
        the capacity (the tier's own without one), the bytes and blocks it holds; O(blocks)."""
        mine = [e for e in self.index if e.is_readable and self.tenant_of(e.namespace_id) == tenant]
        held = self.tenant_bytes()
        rows = []
        for tier in self.usage():
            if tier.name in held:
                quota = self.quota(tenant, tier.name)
                in_tier = (e.slot is not None if tier.name == "dram" else e.on_ssd for e in mine)
                capacity = tier.capacity_bytes if quota is None else quota
                used = held[tier.name].get(tenant, 0)
                rows.append(TierUsage(tier.name, capacity, used, sum(in_tier)))
        return len(mine), tuple(rows)

    def quota(self, tenant: str, tier: str) -> int | None:
        """`tenant`'s quota in `tier` ("dram" or "ssd"), None for none."""
        return (self.dram.tenants if tier == "dram" else self.ssd_tenants).quota(tenant)

    def free_reserved(self, entry: Entry) -> None:
        """Frees the slot of a reserved block that will not be committed (out of the index)."""
        assert entry.slot is not None and not entry.is_readable, "reserved entries live in DRAM"
        self.dram.free(entry.slot)
        entry.slot = None

    def on_commit(self, entries: Sequence[Entry]) -> None:
        """Starts tracking newly committed DRAM blocks; cleans DRAM if it is too full."""
        for entry in entries:
            self._seq += 1
            entry.seq = self._seq
            self.index.note(entry)
            self.dram_policy.insert(entry.block_id, entry.parent_id)
            self.counters.tiers["dram"].bytes_written += entry.nbytes
        if self._is_dram_high():
            if self._demoter is None:
                self.demote_pass()
            else:
                self._demoter.wake()

    # -- reads ---------------------------------------------------------------------------

    def touch(self, entries: Sequence[Entry]) -> None:
        """Records hits, in chain order, with each tier's policy."""
        for entry in entries:
            entry.num_hits += 1
        self.dram_policy.touch([e.block_id for e in entries if e.slot is not None])
        if self._ssd_space is not None:
            self._ssd_space.touch(entries)
        if self.hbm is not None:
            self.hbm.touch(entries)

    def read(
        self, entries: Sequence[Entry | None], device: bool = False, block_tokens: int = 0
    ) -> tuple[list[Any], list[Entry]]:
        """Views of committed `entries` (None for a miss), and the entries read, each now
        leased once more (`end_lease` ends it); records the hits with every policy, and in
        the counters of the tier each was served from (`block_tokens` tokens each).

        A block whose bytes fail their checksum is dropped and reads as a miss. `device`: the
        reader takes device memory, so blocks with a device copy (HBM) are served from it,
        and the others read from DRAM get one for next time.
        """
        for entry in entries:  # pinned first: promoting one must not evict another
            if entry is not None:
                entry.num_leases += 1
        views: list[Any] = []
        hits = []
        for entry in entries:
            view = None if entry is None else self._load(entry, device, block_tokens)
            if entry is not None and view is None:
                self.end_lease(entry)  # failed its checksum: now dropped
            elif entry is not None:
                hits.append(entry)
            views.append(view)
        self.touch(hits)
        if device and self.hbm is not None:
            self.hbm.admit_read(hits, [v for v in views if v is not None])
        return views, hits

    def _load(self, entry: Entry, device: bool, block_tokens: int) -> Any | None:
        """A view of a committed block: its device copy when `device` asks for one and it
        has one, else a DRAM view, promoting it from SSD if needed; None, after dropping the
        block, when its bytes fail their checksum."""
        if device and self.hbm is not None and (view := self.hbm.view(entry)) is not None:
            tier = "hbm"
        else:
            tier = "dram" if entry.slot is not None else "ssd"
            view = self._dram_view(entry) if entry.slot is not None else self._promote(entry)
        if view is None:
            self._corrupted(entry)
            return None
        counters = self.counters.tiers[tier]
        counters.hits += 1
        counters.hit_tokens += block_tokens
        counters.bytes_read += entry.nbytes
        return view

    def end_lease(self, entry: Entry) -> None:
        """Ends one lease of `entry`: frees, in every memory tier, a slot it left meanwhile."""
        self._dram.end_lease(entry)

    # -- removal -------------------------------------------------------------------------

    def drop(self, entry: Entry) -> None:
        """Removes a committed entry from every tier; a leased slot is freed later. If its
        SSD record cannot be deleted (a full disk), it stays, as an SSD block only."""
        if entry.on_ssd and not self._delete_records([entry]):
            if entry.slot is not None:
                self._dram.free(entry)
            return
        self._forget(entry)

    def remove(self, entries: Sequence[Entry]) -> None:
        """Removes committed `entries` from every tier, all or none.

        Raises `StoreFullError`, having changed nothing, when their SSD records cannot be
        deleted (on a full disk even a delete needs free pages).
        """
        on_ssd = [e for e in entries if e.on_ssd]
        if not self._delete_records(on_ssd):
            raise errors.StoreFullError(
                f"the SSD tier could not delete {len(on_ssd)} records (disk full?); "
                "nothing was removed"
            )
        for entry in entries:
            self._forget(entry)

    # -- demotion ------------------------------------------------------------------------

    def demote_pass(self) -> int:
        """Frees DRAM down to its low watermark (`Demotion.demote_pass`); returns how many
        blocks left DRAM. Needs an SSD tier."""
        assert self._demotion is not None, "no SSD tier"
        return self._demotion.demote_pass()

    # -- lifecycle -----------------------------------------------------------------------

    def recover(self) -> int:
        """Rebuilds the index from SSD records; returns how many blocks were recovered."""
        if self._ssd_space is None:
            return 0
        recovered = recover_index(self.index, self._ssd_space)
        self.index.link_depths()
        self._seq = recovered.last_seq
        self.counters.checksum_failures += recovered.num_bad
        return recovered.num_blocks

    def load_meta(self) -> dict[bytes, bytes]:
        """The metadata values stored beside the SSD blocks (none without an SSD tier)."""
        return {} if self.ssd is None else self.ssd.load_meta()

    def save_meta(self, name: bytes, value: bytes) -> None:
        """Stores a metadata value beside the SSD blocks (a no-op without an SSD tier).

        Raises `StoreFullError`, having stored nothing, when the disk is full.
        """
        if self.ssd is None:
            return
        try:
            self.ssd.save_meta(name, value)
        except lmdb.Error as exc:
            log.error("event=ssd_meta_write_failed error=%r", exc)
            raise errors.StoreFullError(f"the SSD tier could not store metadata: {exc}") from None

    def close(self) -> None:
        if self._demoter is not None:
            self._demoter.close()
        if self.ssd is not None:
            self.ssd.close()

    def usage(self) -> tuple[TierUsage, ...]:
        tiers: list[Tier] = [self.dram] if self.ssd is None else [self.dram, self.ssd]
        if self.hbm is not None:
            tiers.insert(0, self.hbm.tier)
        return usage(tiers, self.counters)

    def check(self) -> None:
        """Asserts tiering's invariants (the package docstring) over every indexed block."""
        with self.lock:
            entries = list(self.index)
            committed = [e for e in entries if e.is_readable]
            assert all(e.slot is not None or e.on_ssd for e in committed), "entry in no tier"
            self._dram.check(entries)
            if self._ssd_space is not None:
                self._ssd_space.check(committed)
            else:
                assert not any(e.on_ssd for e in entries), "on SSD without an SSD tier"
            if self.hbm is not None:
                self.hbm.check(entries)

    # -- internals -----------------------------------------------------------------------

    def _is_dram_high(self) -> bool:
        return self.ssd is not None and self._dram.is_over(self.config.dram_high_watermark)

    def _dram_view(self, entry: Entry) -> memoryview | None:
        assert entry.slot is not None
        view = self.dram.view(entry.slot)
        if self.config.verify_reads and checksum(view) != entry.checksum:
            return None
        return view

    def _promote(self, entry: Entry) -> memoryview | None:
        assert self._promotion is not None, "an SSD block without an SSD tier"
        return self._promotion.promote(entry)

    def _corrupted(self, entry: Entry) -> None:
        log.warning("event=checksum_failure key=%s tier=%s", entry.key.hex()[:16], entry.tier)
        self.counters.checksum_failures += 1
        self.drop(entry)

    def _delete_records(self, entries: list[Entry]) -> bool:
        return not entries or (self._writer is not None and self._writer.delete(entries))

    def _forget(self, entry: Entry) -> None:
        self.index.pop(entry.block_id)
        if entry.slot is not None:
            self._dram.free(entry)
        if entry.on_ssd:
            assert self._ssd_space is not None
            self._ssd_space.untrack(entry)
