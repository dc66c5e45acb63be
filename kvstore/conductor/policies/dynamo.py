"""NVIDIA Dynamo's KV router with its busy thresholds.

Cost of a worker = `prefill_load_scale` x (the request's blocks not cached there) + the
blocks it already has to process (its queued prefill tokens, in blocks); the cheapest
non-busy worker wins; decode goes to the non-busy worker with the fewest active KV blocks.
A worker is busy over `active_prefill_tokens_threshold` queued tokens (prefill) or
`active_decode_blocks_threshold` of its KV (decode); when every worker is busy the request
is refused (HTTP 529/503), with no prediction of its TTFT or TBT. Dynamo leaves the token
threshold to the operator; here it is what one instance prefills within the TTFT SLO at
its linear rate, the setting an operator would derive from the same SLO.
"""

from __future__ import annotations

from kvstore.conductor.base import PolicyContext, SchedulingPolicy
from kvstore.conductor.decision import Accept, Decision, Reject, RejectReason
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.view import ClusterView

PREFILL_LOAD_SCALE = 1.0
ACTIVE_DECODE_BLOCKS_THRESHOLD = 0.85


class DynamoCostPolicy(SchedulingPolicy):
    """Dynamo's KV-router cost with busy-threshold rejection."""

    name = "dynamo-cost"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.prefill_tokens_threshold = ctx.slo.ttft_s / ctx.cost.profile.prefill_s_per_token

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        block = view.cost.profile.block_tokens
        blocks = len(request.hash_ids)
        free = [
            i
            for i, p in enumerate(view.prefill)
            if p.queued_tokens() <= self.prefill_tokens_threshold
        ]
        decode_util = [d.context_tokens() / d.kv_capacity_tokens for d in view.decode]
        free_decode = [i for i, u in enumerate(decode_util) if u <= ACTIVE_DECODE_BLOCKS_THRESHOLD]
        if not free or not free_decode:
            return Reject(RejectReason.BUSY)

        def cost(i: int) -> float:
            p = view.prefill[i]
            uncached = blocks - p.cached_prefix(request.hash_ids)
            return PREFILL_LOAD_SCALE * uncached + p.queued_tokens() / block

        prefill = min(free, key=cost)
        decode = min(free_decode, key=lambda i: view.decode[i].context_tokens())
        return Accept(prefill, decode)
