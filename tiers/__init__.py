"""Storage tiers behind the store: HBM, DRAM and SSD, one `Tier` contract."""

from tiers.base import Slot, Tier, TierStats
from tiers.dram import DramTier

__all__ = ["DramTier", "Slot", "Tier", "TierStats"]
