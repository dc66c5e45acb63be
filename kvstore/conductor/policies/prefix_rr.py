"""Mooncake's open-source proxy: prefill on the largest prefix match, decode round-robin.

Its "conductor" is a prefix index: the prefill instance whose cache holds the longest
prefix of the prompt gets it (round-robin among ties, which is every instance when nothing
matches), with no regard for its queue; decode instances are taken in turn; nothing is
rejected.
"""

from __future__ import annotations

from kvstore.conductor.base import PolicyContext, SchedulingPolicy
from kvstore.conductor.decision import Accept, Decision
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.view import ClusterView


class PrefixRoundRobinPolicy(SchedulingPolicy):
    """Largest local prefix match for prefill, round-robin for decode."""

    name = "prefix-rr"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._prefill_turn = 0
        self._decode_turn = 0

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        matches = [p.cached_prefix(request.hash_ids) for p in view.prefill]
        top = max(matches)
        tied = [i for i, m in enumerate(matches) if m == top]
        prefill = tied[self._prefill_turn % len(tied)]
        self._prefill_turn += 1
        decode = self._decode_turn % len(view.decode)
        self._decode_turn += 1
        return Accept(prefill, decode)
