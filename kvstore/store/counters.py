"""Store counters: the store's traffic counters, the node's and each tenant's own, and the
`StoreStats` built from them and tiering's."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.results import StoreStats, TierUsage
from kvstore.store.tiering import TieringCounters


@dataclass
class StoreCounters:
    hits: int = 0
    misses: int = 0
    miss_tokens: int = 0
    blocks_committed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    expired_reservations: int = 0
    expired_leases: int = 0

    def stats(
        self, sizes: tuple[int, int, int, int], t: TieringCounters, tiers: tuple[TierUsage, ...]
    ) -> StoreStats:
        """`sizes`: numbers of blocks, namespaces, reservations and leases."""
        num_blocks, num_namespaces, num_reservations, num_leases = sizes
        return StoreStats(
            num_blocks=num_blocks,
            num_namespaces=num_namespaces,
            num_reservations=num_reservations,
            num_leases=num_leases,
            hits=self.hits,
            misses=self.misses,
            miss_tokens=self.miss_tokens,
            evictions=t.evictions,
            demotions=t.demotions,
            promotions=t.promotions,
            drops=t.drops,
            blocks_committed=self.blocks_committed,
            bytes_written=self.bytes_written,
            bytes_read=self.bytes_read,
            checksum_failures=t.checksum_failures,
            ssd_write_failures=t.ssd_write_failures,
            expired_reservations=self.expired_reservations,
            expired_leases=self.expired_leases,
            tiers=tiers,
        )


class Counters:
    """The node's traffic counters and each tenant's own; the store counts under its lock."""

    def __init__(self) -> None:
        self.node = StoreCounters()
        self._by_tenant: dict[str, StoreCounters] = {}

    def of(self, tenant: str) -> StoreCounters:
        """`tenant`'s own counters (zeros for a tenant that has done nothing)."""
        return self._by_tenant.get(tenant, StoreCounters())

    def count_read(
        self, tenant: str, hits: int, misses: int, block_tokens: int, nbytes: int
    ) -> None:
        """A read of `hits` blocks (`nbytes` in all) and `misses` of `block_tokens` each."""
        for c in (self.node, self._by_tenant.setdefault(tenant, StoreCounters())):
            c.hits += hits
            c.misses += misses
            c.miss_tokens += misses * block_tokens
            c.bytes_read += nbytes

    def count_commit(self, tenant: str, num_blocks: int, nbytes: int) -> None:
        for c in (self.node, self._by_tenant.setdefault(tenant, StoreCounters())):
            c.blocks_committed += num_blocks
            c.bytes_written += nbytes
