"""Storage tiers behind the store: HBM, DRAM and SSD, one `Tier` contract."""

from kvstore.store.tiers.base import Slot, Tier, TierStats
from kvstore.store.tiers.dram import DramTier

__all__ = ["DramTier", "Slot", "Tier", "TierStats"]
