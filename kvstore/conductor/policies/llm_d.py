"""llm-d's inference scheduler: weighted scorers and saturation-based shedding.

Each prefill instance scores `PREFIX_WEIGHT` x (share of the prompt's blocks it caches)
+ `QUEUE_WEIGHT` x (queue depth, min-max normalised, shorter is better) + `KV_WEIGHT` x
(1 - KV utilisation); the highest score wins. Decode instances score on queue and KV
alone. Saturation: each instance's max(queue depth / 5, KV utilisation / 0.8), llm-d's
default thresholds, averaged over instances; past 1 a sheddable request (priority <=
`SHEDDABLE_MAX_PRIORITY`; a trace has no priorities, so every request is) is dropped with
probability min(excess^5 x 300, 1), where excess is the saturation over 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.conductor.base import SchedulingPolicy
from kvstore.conductor.decision import Accept, Decision, Reject, RejectReason
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.view import ClusterView

PREFIX_WEIGHT, QUEUE_WEIGHT, KV_WEIGHT = 2.0, 1.0, 1.0
QUEUE_DEPTH_THRESHOLD, KV_UTIL_THRESHOLD = 5, 0.8
SHEDDABLE_MAX_PRIORITY = 0


def queue_scores(depths: Sequence[float]) -> list[float]:
    """1 for the shortest queue, 0 for the longest, linear between; all 1 when equal."""
    hi, lo = max(depths), min(depths)
    return [1.0 if hi == lo else (hi - q) / (hi - lo) for q in depths]


class LlmDScorersPolicy(SchedulingPolicy):
    """llm-d's prefix, queue and KV-utilisation scorers, with shedding."""

    name = "llm-d-scorers"

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        util = [self._prefill_util(view, i) for i in range(len(view.prefill))]
        depth = [p.num_queued() for p in view.prefill]
        if request.priority <= SHEDDABLE_MAX_PRIORITY and self._drops(depth, util):
            return Reject(RejectReason.SHED)
        n = len(request.hash_ids)
        prefix = [p.cached_prefix(request.hash_ids) / n for p in view.prefill]
        queue = queue_scores(depth)
        scores = [
            PREFIX_WEIGHT * prefix[i] + QUEUE_WEIGHT * queue[i] + KV_WEIGHT * (1 - util[i])
            for i in range(len(util))
        ]
        prefill = max(range(len(scores)), key=lambda i: (scores[i], -i))
        return Accept(prefill, self._decode(view))

    def _drops(self, depth: Sequence[int], util: Sequence[float]) -> bool:
        per = [
            max(q / QUEUE_DEPTH_THRESHOLD, u / KV_UTIL_THRESHOLD)
            for q, u in zip(depth, util, strict=True)
        ]
        excess = max(0.0, sum(per) / len(per) - 1.0)
        return self.rng.random() < min(excess**5 * 300, 1.0)

    @staticmethod
    def _prefill_util(view: ClusterView, i: int) -> float:
        p = view.prefill[i]
        capacity = p.cache_capacity_blocks * view.cost.profile.block_tokens
        return min(1.0, p.queued_tokens() / capacity) if capacity else 1.0

    @staticmethod
    def _decode(view: ClusterView) -> int:
        depth = [len(d.running()) + len(d.incoming()) for d in view.decode]
        queue = queue_scores(depth)
        util = [d.context_tokens() / d.kv_capacity_tokens for d in view.decode]
        scores = [QUEUE_WEIGHT * q + KV_WEIGHT * (1 - u) for q, u in zip(queue, util, strict=True)]
        return max(range(len(scores)), key=lambda i: (scores[i], -i))
