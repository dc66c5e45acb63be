"""Hot-block replication: blocks asked for on many prefill instances are copied, ahead of
need, to where they are asked, within a bandwidth budget.

A request routed to an instance that lacks part of its cached prefix would load it from the
pool when its prefill starts, on the critical path. When that prefix is hot (asked for on
at least `hot_instances` distinct prefill instances within `window_s`), the copy starts at
routing time instead, in the background, while the request waits in the queue; the budget
(a share of the pool bandwidth, as a token bucket of blocks) keeps copies from crowding out
the loads requests wait on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.conductor.base import Replication
from kvstore.conductor.view import ClusterView


@dataclass(frozen=True)
class ReplicationConfig:
    """Attributes:
    hot_instances: distinct prefill instances a block must be asked on to be hot.
    window_s: how long an ask counts.
    budget_share: share of the pool bandwidth copies may use.
    max_tracked: blocks whose asks are remembered (least recently asked forgotten first).
    """

    hot_instances: int = 2
    window_s: float = 60.0
    budget_share: float = 0.1
    max_tracked: int = 100_000

    def __post_init__(self) -> None:
        if self.hot_instances < 1 or self.window_s <= 0 or self.max_tracked < 1:
            raise ValueError("hot_instances, max_tracked >= 1 and window_s > 0 required")
        if not 0 < self.budget_share <= 1:
            raise ValueError(f"budget_share must be in (0, 1]: {self.budget_share}")


class HotBlockReplicator:
    """Tracks where blocks are asked for and plans background copies of hot ones."""

    def __init__(self, config: ReplicationConfig | None = None) -> None:
        self.config = config or ReplicationConfig()
        self._asks: OrderedDict[int, dict[int, float]] = OrderedDict()  # block -> instance -> t
        self._tokens = 0.0  # budget left, in blocks
        self._last_s: float | None = None
        self._pending: list[Replication] = []

    def record(self, hash_ids: Sequence[int], instance: int, view: ClusterView) -> None:
        """A request whose prefix is `hash_ids` was routed to prefill `instance`; plans a copy
        of the hot part of its pooled prefix that the instance lacks."""
        now = view.now_s
        self._refill(now, view)
        local = view.prefill[instance].cached_prefix(hash_ids)
        pooled = local + view.pool_prefix(hash_ids, local)
        hot_end = local
        for k in range(pooled):
            if self._ask(hash_ids[k], instance, now) and k == hot_end:
                hot_end = k + 1
        copy = hash_ids[local:hot_end]
        if copy and self._tokens >= len(copy):
            self._tokens -= len(copy)
            self._pending.append(Replication(instance, tuple(hash_ids[:hot_end])))

    def _ask(self, block: int, instance: int, now: float) -> bool:
        """Records an ask; whether the block is now hot."""
        asks = self._asks.pop(block, {})
        asks[instance] = now
        horizon = now - self.config.window_s
        asks = {i: t for i, t in asks.items() if t >= horizon}
        self._asks[block] = asks
        if len(self._asks) > self.config.max_tracked:
            self._asks.popitem(last=False)
        return len(asks) >= self.config.hot_instances

    def _refill(self, now: float, view: ClusterView) -> None:
        profile = view.cost.profile
        rate = self.config.budget_share * profile.pool_bandwidth_bytes_per_s / profile.block_bytes
        elapsed = 0.0 if self._last_s is None else max(0.0, now - self._last_s)
        self._tokens = min(rate * self.config.window_s, self._tokens + rate * elapsed)
        self._last_s = now

    def take(self) -> list[Replication]:
        """The copies planned since the last call."""
        pending, self._pending = self._pending, []
        return pending
