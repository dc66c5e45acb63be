"""Load-only baselines: random, round-robin and least-loaded (on pending tokens)."""

from __future__ import annotations

from kvstore.conductor.base import PolicyContext, SchedulingPolicy
from kvstore.conductor.decision import Accept, Decision
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.view import ClusterView


class RandomPolicy(SchedulingPolicy):
    """Prefill and decode instances drawn uniformly (seeded); never rejects."""

    name = "random"

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        return Accept(self.rng.randrange(len(view.prefill)), self.rng.randrange(len(view.decode)))


class RoundRobinPolicy(SchedulingPolicy):
    """Prefill and decode instances in turn; never rejects."""

    name = "round-robin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._count = 0

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        n = self._count
        self._count += 1
        return Accept(n % len(view.prefill), n % len(view.decode))


class LeastLoadedPolicy(SchedulingPolicy):
    """The prefill instance with the fewest prompt tokens still to compute, the decode
    instance with the fewest KV tokens (running and incoming); never rejects. Routing on
    pending tokens, not request counts: one 100k-token prompt is not one 1k-token prompt."""

    name = "least-loaded"

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        prefill = min(range(len(view.prefill)), key=lambda i: view.prefill[i].queued_tokens())
        return Accept(prefill, least_kv_decode(view))


def least_kv_decode(view: ClusterView) -> int:
    """The decode instance holding and expecting the fewest KV tokens; lowest index on ties."""

    def load(i: int) -> int:
        d = view.decode[i]
        return d.context_tokens() + sum(inc.input_len for inc in d.incoming())

    return min(range(len(view.decode)), key=load)
