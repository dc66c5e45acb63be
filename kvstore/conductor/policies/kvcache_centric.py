"""The conductor: Mooncake's KVCache-centric scheduling (FAST'25, Algorithm 1) and its
admission control.

Prefill goes to the instance with the lowest predicted TTFT (`kvstore.conductor.ttft`);
hot prefixes are copied ahead of need (`HotBlockReplicator`); decode goes to the instance
with the lowest predicted step time. Four admission variants share all of that:

- `cache-aware`: admits everything.
- `cache-aware-ttft`: rejects when the predicted TTFT misses the SLO, and leaves decode to
  the decode instance, which refuses after the prefill what it cannot take (Mooncake's
  baseline without early rejection: that prefill is thrown away).
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

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvstore.conductor import ttft
from kvstore.conductor.base import PolicyContext, Replication, SchedulingPolicy
from kvstore.conductor.decision import Accept, Decision, Reject, RejectReason
from kvstore.conductor.decode_load import (
    Arrivals,
    DecodeLoad,
    DecodeLoadPredictor,
    DecodeRoom,
    current_load,
)
from kvstore.conductor.output_len import OutputLenEstimator
from kvstore.conductor.replication import HotBlockReplicator
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.view import ClusterView, DecodeView


class CacheAwarePolicy(SchedulingPolicy):
    """Algorithm 1 without rejection; the base of the three admitting variants."""

    name = "cache-aware"
    admits: ClassVar[bool] = False  # whether the TTFT test may reject
    tests_decode: ClassVar[bool] = True  # whether the decode test may too (when admitting)

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.predictor = DecodeLoadPredictor(ctx.cost, OutputLenEstimator())
        self.replicator = HotBlockReplicator()
        self.arrivals: dict[int, Arrivals] = {}  # by decode instance: recent routings

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        estimates = ttft.estimate_all(request, view)
        chosen = ttft.best(estimates)
        if self.admits and chosen.ttft_s > self.ctx.slo.ttft_s:
            return self._reject_ttft(chosen)
        handoff_s = view.handoff_s(request.input_len, chosen.plan.compute_s)
        reach_s = view.now_s + chosen.ttft_s + handoff_s
        decode, tbt_s, rejection = self._place_decode(request, view, reach_s, handoff_s)
        if self.admits and self.tests_decode and rejection is not None:
            return rejection
        self.replicator.record(request.hash_ids, chosen.instance, view)
        arrivals = self.arrivals.setdefault(decode, Arrivals())
        arrivals.record(view.now_s, reach_s, request.input_len)
        return Accept(chosen.instance, decode, chosen.ttft_s, tbt_s)

    def observe_output(
        self, output_len: int, input_len: int | None = None, ended: bool = True
    ) -> None:
        self.predictor.outputs.observe(output_len, input_len, ended)

    def replications(self, view: ClusterView) -> Sequence[Replication]:
        return self.replicator.take()

    def _place_decode(
        self, request: SchedRequest, view: ClusterView, reach_s: float, handoff_s: float
    ) -> tuple[int, float, Reject | None]:
        """The decode instance for `request` (reaching decode at `reach_s`, `handoff_s` after
        its first token), its predicted TBT, and the rejection its check predicts; the
        current-load test predicts the step alone."""
        loads = [current_load(d).plus(request.input_len) for d in view.decode]
        decode = min(range(len(loads)), key=lambda i: (self.predictor.step_s(loads[i]), i))
        tbt_s = self.predictor.step_s(loads[decode])
        return decode, tbt_s, self._check_decode(view, decode, loads[decode], tbt_s, reach_s)

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


class CacheAwareTTFTPolicy(CacheAwarePolicy):
    """Algorithm 1 with rejection on the predicted TTFT only: no early rejection on decode."""

    name = "cache-aware-ttft"
    admits = True
    tests_decode = False


class CacheAwareRejectPolicy(CacheAwarePolicy):
    """Algorithm 1 with early rejection on the current decode load."""

    name = "cache-aware-reject"
    admits = True


class CacheAwarePredictivePolicy(CacheAwarePolicy):
    """Algorithm 1 with early rejection on the decode load predicted at arrival.

    Each decode instance's batch is predicted at the time the request reaches it, with the
    wait for KV room there (`DecodeLoadPredictor.room`): a request that waits for room does
    not miss its TBT unless the wait, spread over its output, pushes the mean time between
    tokens over the SLO. The output to plan for is the `planned_output_quantile` of the
    observed output lengths; the request goes to the instance with the lowest predicted TBT
    and is refused only when that misses the SLO. The output-length distribution counts the
    sequences decoding now as longer than they are (`OutputLenEstimator.censor`): while the
    first outputs of a run finish, those are the short ones.
    """

    name = "cache-aware-predictive"
    admits = True
    # The wait a request can absorb grows with its output, unknown up front: plan for an
    # output that all but this share of the observed ones reach, so that a request admitted
    # to wait meets its TBT with the probability the conductor promises its accepted ones.
    planned_output_quantile: ClassVar[float] = 0.05

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        # Decode tests made, those whose verdict differs from the current-batch test's, and
        # those admitted by both but placed on another decode instance.
        self._counts = dict.fromkeys(
            ("decode_tests", "admitted_over_current", "refused_over_current", "placed_elsewhere"),
            0,
        )

    def counts(self) -> Mapping[str, int]:
        return dict(self._counts)

    def _place_decode(
        self, request: SchedRequest, view: ClusterView, reach_s: float, handoff_s: float
    ) -> tuple[int, float, Reject | None]:
        placed = self._place_predicted(request, view, reach_s, handoff_s)
        current, _, current_reject = super()._place_decode(request, view, reach_s, handoff_s)
        self._counts["decode_tests"] += 1
        if (placed[2] is None) != (current_reject is None):
            key = "admitted_over_current" if current_reject else "refused_over_current"
            self._counts[key] += 1
        elif placed[2] is None and placed[0] != current:
            self._counts["placed_elsewhere"] += 1
        return placed

    def _place_predicted(
        self, request: SchedRequest, view: ClusterView, reach_s: float, handoff_s: float
    ) -> tuple[int, float, Reject | None]:
        output_len = self.predictor.outputs.quantile(self.planned_output_quantile)
        if request.max_output is not None:  # it cannot run longer than its client asked
            output_len = min(output_len, request.max_output)
        self.predictor.outputs.censor(
            (s.generated, s.context_len - s.generated)
            for d in view.decode
            for s in d.running()
            if not s.is_waiting
        )
        slo = self.ctx.slo
        rooms = [
            self.predictor.room(
                d, view.now_s, reach_s, request.input_len, slo.tbt_s, self.arrivals.get(i)
            )
            for i, d in enumerate(view.decode)
        ]
        if all(d.refuses_when_busy for d in view.decode):
            return self._place_refusing(view, reach_s, rooms)
        tbts = [
            self._predicted_tbt(d, r, reach_s, handoff_s, output_len)
            for d, r in zip(view.decode, rooms, strict=True)
        ]
        decode = min(range(len(rooms)), key=lambda i: (tbts[i], i))
        room, tbt_s = rooms[decode], tbts[decode]
        if math.isinf(tbt_s):
            capacity = view.decode[decode].kv_capacity_tokens
            # Refused where it would wait: retry when the predicted room opens.
            retry = None if math.isinf(room.join_s) else room.join_s - reach_s
            reject = Reject(RejectReason.DECODE_MEMORY, request.input_len, capacity, retry)
            return decode, tbt_s, reject
        if tbt_s <= self.ctx.slo.tbt_s:
            return decode, tbt_s, None
        steps = max(1.0, output_len - 1)
        return decode, tbt_s, self._reject_tbt(view, decode, room, tbt_s, steps, reach_s)

    def _place_refusing(
        self, view: ClusterView, reach_s: float, rooms: Sequence[DecodeRoom]
    ) -> tuple[int, float, Reject | None]:
        """On decode instances that refuse what does not fit at once, throwing its prefill
        away, the request goes where it most likely fits (`DecodeRoom.fits_p`), and is
        admitted when it is more likely than not to fit there on arrival.

        Even odds, not a threshold fitted to a trace: a decode instance that binds takes
        one request for each that ends, so a request admitted against the odds mostly
        displaces another at decode while its prefill is most likely thrown away; one
        refused against them mostly leaves its place to another. (Admitting every chance
        when prefill is idle, since a wasted prefill then delays no one, was measured: it
        doubles the prefill thrown away for no goodput, see the scheduler benchmarks.)
        """
        steps = [self.predictor.step_s(r.load) for r in rooms]
        # The likeliest fit; among equally likely ones (to 0.1%), the fastest step.
        decode = min(range(len(rooms)), key=lambda i: (-round(rooms[i].fits_p, 3), steps[i], i))
        room, step_s = rooms[decode], steps[decode]
        if room.fits_p >= 0.5:
            return decode, step_s, None
        retry = None if math.isinf(room.join_s) else max(0.0, room.join_s - reach_s)
        if step_s > self.ctx.slo.tbt_s:
            return decode, step_s, Reject(RejectReason.TBT, step_s, self.ctx.slo.tbt_s, retry)
        capacity = view.decode[decode].kv_capacity_tokens
        return (
            decode,
            step_s,
            Reject(RejectReason.DECODE_MEMORY, room.load.context_tokens, capacity, retry),
        )

    def _predicted_tbt(
        self,
        decode: DecodeView,
        room: DecodeRoom,
        reach_s: float,
        handoff_s: float,
        output_len: float,
    ) -> float:
        """The mean time between tokens predicted on `decode`: infinite where the request
        never fits, or would wait for room on an instance that refuses instead of queuing.
        The handoff counts as the wait does: the first gap after the first token is the
        handoff's, and a short output spreads it over few steps."""
        if math.isinf(room.join_s) or (decode.refuses_when_busy and room.join_s > reach_s):
            return math.inf
        step_s = self.predictor.step_s(room.load)
        return room.tbt_s(step_s, reach_s, handoff_s, output_len)

    def _reject_tbt(
        self,
        view: ClusterView,
        i: int,
        room: DecodeRoom,
        tbt_s: float,
        steps: float,
        reach_s: float,
    ) -> Reject:
        """A predicted TBT miss. When the step itself fits, the wait for room is what misses:
        retry once it shrinks into the slack, (tbt - SLO) x steps later. Otherwise retry when
        enough of the batch has ended for the step to fit."""
        limit = self.ctx.slo.tbt_s
        if self.predictor.step_s(room.load) > limit:
            return Reject(RejectReason.TBT, tbt_s, limit, self._retry_decode(view, i, reach_s))
        return Reject(RejectReason.TBT, tbt_s, limit, (tbt_s - limit) * steps)
