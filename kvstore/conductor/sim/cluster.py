"""The simulated cluster as policies see it (`ClusterView`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.sim.block_cache import LRUBlockCache
from kvstore.conductor.sim.decode_instance import SimDecode
from kvstore.conductor.sim.prefill_instance import SimPrefill
from kvstore.conductor.view import ClusterView


class SimCluster(ClusterView):
    """N prefill instances, M decode instances and the global pool, at `now_s`."""

    def __init__(
        self,
        cost: CostModel,
        num_prefill: int,
        num_decode: int,
        pool_blocks: int,
        refuse_over_tbt_s: float | None = None,
    ) -> None:
        profile = cost.profile
        self._cost = cost
        self.pool = LRUBlockCache(pool_blocks)
        self.prefills = [
            SimPrefill(cost, profile.prefill_cache_blocks, self.pool) for _ in range(num_prefill)
        ]
        self.decodes = [
            SimDecode(cost, profile.decode_kv_capacity_tokens, refuse_over_tbt_s)
            for _ in range(num_decode)
        ]
        self._now_s = 0.0

    def set_time(self, now_s: float) -> None:
        """Moves every instance's clock to `now_s` (never backwards)."""
        self._now_s = max(self._now_s, now_s)
        for p in self.prefills:
            p.now_s = self._now_s
        for d in self.decodes:
            d.advance(self._now_s)

    @property
    def now_s(self) -> float:
        return self._now_s

    @property
    def prefill(self) -> Sequence[SimPrefill]:
        return self.prefills

    @property
    def decode(self) -> Sequence[SimDecode]:
        return self.decodes

    @property
    def cost(self) -> CostModel:
        return self._cost

    def pool_prefix(self, hash_ids: Sequence[int], start: int = 0) -> int:
        return self.pool.prefix(hash_ids, start)
