"""The conductor: Mooncake's KVCache-centric scheduling (FAST'25, Algorithm 1) and its
admission control.

Prefill goes to the instance with the lowest predicted TTFT (`kvstore.scheduler.ttft`);
hot prefixes are copied ahead of need (`HotBlockReplicator`); decode goes to the instance
with the lowest predicted step time. Three admission variants share all of that:

- `cache-aware`: admits everything.
- `cache-aware-reject`: rejects when the predicted TTFT misses the SLO, or when the decode
  step time with the request added to the batch decoding *now* misses the TBT SLO.
- `cache-aware-predictive`: the same TTFT test; the TBT test is on the batch predicted at
  the time the request reaches decode (`DecodeLoadPredictor`), counting the requests
  already routed there and those that will have finished by then.

Both tests compare a prediction with the SLO itself: no threshold is tuned to a trace.
A rejection carries the predicted value, the SLO, and the wait after which the prediction
says the request fits (None when it never does: a prompt whose prefill alone on an idle
instance misses the TTFT SLO).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvstore.scheduler import ttft
from kvstore.scheduler.base import PolicyContext, Replication, SchedulingPolicy
from kvstore.scheduler.decision import Accept, Decision, Reject, RejectReason
from kvstore.scheduler.decode_load import DecodeLoad, DecodeLoadPredictor, current_load
from kvstore.scheduler.output_len import OutputLenEstimator
from kvstore.scheduler.replication import HotBlockReplicator
from kvstore.scheduler.request import SchedRequest
from kvstore.scheduler.view import ClusterView


class CacheAwarePolicy(SchedulingPolicy):
    """Algorithm 1 without rejection; the base of the two admitting variants."""

    name = "cache-aware"
    admits: ClassVar[bool] = False  # whether the SLO tests may reject
    predicts_decode: ClassVar[bool] = False  # decode load at arrival vs now

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.predictor = DecodeLoadPredictor(ctx.cost, OutputLenEstimator())
        self.replicator = HotBlockReplicator()

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        estimates = ttft.estimate_all(request, view)
        chosen = ttft.best(estimates)
        if self.admits and chosen.ttft_s > self.ctx.slo.ttft_s:
            return self._reject_ttft(chosen)
        handoff_s = view.cost.handoff_s(request.input_len, chosen.plan.compute_s)
        reach_s = view.now_s + chosen.ttft_s + handoff_s
        loads = [
            self._decode_load(view, i, reach_s).plus(request.input_len)
            for i in range(len(view.decode))
        ]
        decode = min(range(len(loads)), key=lambda i: (self.predictor.step_s(loads[i]), i))
        tbt_s = self.predictor.step_s(loads[decode])
        if self.admits:
            rejection = self._check_decode(view, decode, loads[decode], tbt_s, reach_s)
            if rejection is not None:
                return rejection
        self.replicator.record(request.hash_ids, chosen.instance, view)
        return Accept(chosen.instance, decode, chosen.ttft_s, tbt_s)

    def observe_output(self, output_len: int) -> None:
        self.predictor.outputs.observe(output_len)

    def replications(self, view: ClusterView) -> Sequence[Replication]:
        return self.replicator.take()

    def _decode_load(self, view: ClusterView, i: int, reach_s: float) -> DecodeLoad:
        if not self.predicts_decode:
            return current_load(view.decode[i])
        # Incoming requests arriving after this one are not counted: each was admitted
        # against the batch it would find, this one included.
        return self.predictor.at(view.decode[i], view.now_s, reach_s, horizon_s=0.0)

    def _reject_ttft(self, chosen: ttft.TTFTEstimate) -> Reject:
        slo = self.ctx.slo.ttft_s
        # The queue ahead drains in real time; the request's own work does not shrink.
        retry = chosen.ttft_s - slo if chosen.plan.seconds <= slo else None
        return Reject(RejectReason.TTFT, chosen.ttft_s, slo, retry)

    def _check_decode(
        self, view: ClusterView, i: int, load: DecodeLoad, tbt_s: float, reach_s: float
    ) -> Reject | None:
        capacity = view.decode[i].kv_capacity_tokens
        if load.context_tokens > capacity:
            retry = self._retry_decode(view, i, reach_s)
            return Reject(RejectReason.DECODE_MEMORY, load.context_tokens, capacity, retry)
        if tbt_s > self.ctx.slo.tbt_s:
            retry = self._retry_decode(view, i, reach_s)
            return Reject(RejectReason.TBT, tbt_s, self.ctx.slo.tbt_s, retry)
        return None

    def _retry_decode(self, view: ClusterView, i: int, reach_s: float) -> float | None:
        """Wait until enough running sequences are predicted to end for one more to fit: the
        k-th predicted end, for the smallest k that frees the step time needed."""
        ends = self.predictor.end_times(view.decode[i], view.now_s)
        now = current_load(view.decode[i])
        seqs, ctx = now.num_seqs, now.context_tokens
        limit = self.ctx.slo.tbt_s
        per_seq = ctx / seqs if seqs else 0.0
        for k, end_s in enumerate(ends, 1):
            left = DecodeLoad(seqs - k + 1, ctx - k * per_seq + per_seq)
            if self.predictor.step_s(left) <= limit:
                return max(0.0, end_s - reach_s)
        return None


class CacheAwareRejectPolicy(CacheAwarePolicy):
    """Algorithm 1 with early rejection on the current decode load."""

    name = "cache-aware-reject"
    admits = True


class CacheAwarePredictivePolicy(CacheAwarePolicy):
    """Algorithm 1 with early rejection on the decode load predicted at arrival."""

    name = "cache-aware-predictive"
    admits = True
    predicts_decode = True
