"""Usage: each tier's traffic counters, tiering's event counters, and the `TierUsage` rows
built from them and the tiers' own space accounting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.results import TierUsage
from kvstore.store.tiers.base import Tier


@dataclass
class TierCounters:
    hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    hit_tokens: int = 0


@dataclass
class TieringCounters:
    evictions: int = 0  # blocks that left DRAM to make room (demoted or dropped)
    drops: int = 0  # blocks that left the store to make room
    demotions: int = 0
    promotions: int = 0
    checksum_failures: int = 0
    ssd_write_failures: int = 0  # SSD transactions that failed (and changed nothing)
    tiers: dict[str, TierCounters] = field(
        default_factory=lambda: {
            "hbm": TierCounters(),
            "dram": TierCounters(),
            "ssd": TierCounters(),
        }
    )


def usage(tiers: Sequence[Tier], counters: TieringCounters) -> tuple[TierUsage, ...]:
    """One row per tier of `tiers`, fastest first as given."""
    out = []
    for tier in tiers:
        st, c = tier.stats(), counters.tiers[tier.name]
        out.append(
            TierUsage(
                tier.name,
                st.capacity_bytes,
                st.used_bytes,
                st.num_slots,
                c.hits,
                c.bytes_read,
                c.bytes_written,
                c.hit_tokens,
            )
        )
    return tuple(out)
