"""TTFT prediction per prefill instance (Mooncake FAST'25, Algorithm 1).

TTFT on an instance = queue time (predicted work queued there) + the time to load the
cached blocks it lacks from the pool, when that beats recomputing them + the prefill time
of the tokens still not cached + the latency every request pays on top, where the view
measures one (`ClusterView.ttft_latency_s`). The estimate is the engine's own plan
(`plan_prefill`), so the prediction and the work agree, made with the cache the request
will find when it starts (`PrefillView.queued_prefix`): a multi-turn request queued behind
its previous turn finds that turn's blocks there, though they are cached nowhere yet when
it arrives.
"""

from __future__ import annotations

from typing import NamedTuple

from kvstore.conductor.cost_model import PrefillPlan, plan_prefill
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.view import ClusterView


class TTFTEstimate(NamedTuple):
    """The predicted TTFT of one request on one prefill instance."""

    instance: int
    queue_s: float
    plan: PrefillPlan
    latency_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        """Queue, transfer, compute and latency."""
        return self.queue_s + self.plan.seconds + self.latency_s


def estimate(request: SchedRequest, view: ClusterView, instance: int) -> TTFTEstimate:
    """The TTFT `request` would see if queued on prefill `instance` now."""
    pre = view.prefill[instance]
    local = pre.queued_prefix(request.hash_ids)
    pool = view.pool_prefix(request.hash_ids, local)
    plan = plan_prefill(view.cost, request.input_len, local, pool)
    return TTFTEstimate(instance, pre.queued_s(), plan, view.ttft_latency_s)


def estimate_all(request: SchedRequest, view: ClusterView) -> list[TTFTEstimate]:
    """`estimate` on every prefill instance, by index."""
    return [estimate(request, view, i) for i in range(len(view.prefill))]


def best(estimates: list[TTFTEstimate]) -> TTFTEstimate:
    """The lowest predicted TTFT; the lowest index on ties."""
    return min(estimates, key=lambda e: (e.ttft_s, e.instance))
