"""When a request gets KV room on a decode instance, and what the predictive conductor does
with the wait: constructed batches with hand-computed join times and decisions."""

from __future__ import annotations

import math

import pytest

from kvstore.conductor import (
    SLO,
    Accept,
    CostModel,
    PolicyContext,
    Reject,
    RejectReason,
    SchedRequest,
    make_scheduling_policy,
)
from kvstore.conductor.decode_load import Arrivals, DecodeLoad, DecodeLoadPredictor
from kvstore.conductor.output_len import OutputLenEstimator
from kvstore.conductor.view import IncomingSeq, RunningSeq
from tests.conductor.test_scheduler_cost_model import UNIT
from tests.conductor.test_scheduler_policies import _Decode, _Prefill, _View


class _Queue(_Decode):
    """A decode instance whose waiting sequences hold no KV yet."""

    def context_tokens(self) -> int:
        return sum(s.context_len for s in self.running() if not s.is_waiting)


COST = CostModel(UNIT)  # capacity 1000 KV tokens
PRED = DecodeLoadPredictor(COST, OutputLenEstimator(prior_len=256))
STEP = COST.decode_step_s(1, 900)  # 0.111 s: one sequence of 900 tokens
OLD = RunningSeq(900, 56)  # 200 tokens to go (prior 256): ends at 200 steps


def test_a_request_that_fits_joins_on_arrival() -> None:
    room = PRED.room(_Decode([RunningSeq(100, 56)]), 0.0, 1.0, 200)
    assert room.join_s == 1.0
    step = COST.decode_step_s(1, 100)
    assert room.load == DecodeLoad(2, pytest.approx(100 + 1.0 / step + 200))


def test_a_full_instance_frees_room_when_its_sequences_end() -> None:
    room = PRED.room(_Decode([OLD]), 0.0, 0.0, 200)
    assert room.join_s == pytest.approx(200 * STEP)
    assert room.load == DecodeLoad(1, 200.0)
    later = PRED.room(_Decode([OLD]), 0.0, 30.0, 200)  # OLD ends before it arrives
    assert later.join_s == 30.0 and later.load == DecodeLoad(1, 200.0)


def test_those_ahead_join_first_in_order() -> None:
    # 850 tokens arrive at 1 s, wait for OLD to end (22.2 s), then decode 255 steps; by 30 s
    # they hold 850 + 70 tokens, so 200 more fit only once they end too.
    incoming = _Decode([OLD], [IncomingSeq(1.0, 850)])
    room = PRED.room(incoming, 0.0, 30.0, 200)
    assert room.join_s == pytest.approx(200 * STEP + 255 * STEP)
    waiting = _Queue([OLD, RunningSeq(850, 1, is_waiting=True)])
    assert PRED.room(waiting, 0.0, 30.0, 200).join_s == pytest.approx(room.join_s)
    # One arriving after this request is behind it (FIFO) and is not counted.
    behind = _Decode([OLD], [IncomingSeq(31.0, 850)])
    assert PRED.room(behind, 0.0, 30.0, 200).join_s == 30.0


def test_a_prompt_over_the_capacity_never_fits() -> None:
    room = PRED.room(_Decode(), 0.0, 0.0, 2000)
    assert math.isinf(room.join_s)


def test_a_wait_spreads_over_the_output() -> None:
    room = PRED.room(_Decode([OLD]), 0.0, 0.0, 200)
    wait = 200 * STEP
    assert room.tbt_s(0.05, 0.0, 0.0, 1001) == pytest.approx(0.05 + wait / 1000)
    assert room.tbt_s(0.05, 0.0, 0.5, 1) == pytest.approx(0.05 + wait + 0.5)


def test_output_quantile() -> None:
    est = OutputLenEstimator(prior_len=7)
    assert est.quantile(0.5) == 7.0
    for n in range(1, 129):  # 128: the window is re-sorted every 32 observations
        est.observe(n)
    assert (est.quantile(0.0), est.quantile(0.05), est.quantile(0.5)) == (1.0, 7.0, 64.0)
    with pytest.raises(ValueError):
        est.quantile(1.5)


def test_outputs_cut_by_max_tokens_count_as_longer() -> None:
    # Half the outputs ended at 10 tokens; the other half were cut at 4 by their max_tokens,
    # so they say only that their outputs run past 4. Taken as ends, the median would be 4.
    est = OutputLenEstimator(refresh_every=1)
    for _ in range(32):
        est.observe(10)
        est.observe(4, ended=False)
    assert est.survival()[4] == 1.0 and est.survival()[10] == 0.0  # none ends before 10
    assert est.quantile(0.5) == 10.0
    cut_only = OutputLenEstimator(refresh_every=1)
    for _ in range(8):
        cut_only.observe(4, prompt_len=100, ended=False)
    assert cut_only.quantile(0.05) == 5.0  # longer than anything seen
    ended = OutputLenEstimator(refresh_every=1)
    for n in (1, 2, 3, 4):
        ended.observe(n)
    assert [ended.quantile(q) for q in (0, 0.25, 0.5, 0.99)] == [1.0, 2.0, 3.0, 4.0]


def _predictive(outputs: list[int]) -> object:
    policy = make_scheduling_policy(
        "cache-aware-predictive", PolicyContext(COST, SLO(ttft_s=5.0, tbt_s=0.2))
    )
    for n in outputs:
        policy.observe_output(n)
    return policy


REQ = SchedRequest(0, 0.0, 20, (1, 2, 3, 4, 5))  # prefill 1.1 s
FULL_STEP = COST.decode_step_s(1, 990)


def test_predictive_admits_a_wait_its_output_absorbs() -> None:
    # Every output is 1000 tokens: the 990-token sequence has 70 to go, then 20 more fit.
    full = _View([_Prefill()], [_Decode([RunningSeq(990, 930)])])
    decision = _predictive([1000] * 128).decide(REQ, full)  # type: ignore[attr-defined]
    assert isinstance(decision, Accept)
    wait = 70 * FULL_STEP - COST.prefill_s(20)
    assert decision.predicted_tbt_s == pytest.approx(COST.decode_step_s(1, 20) + wait / 999)


def test_predictive_refuses_a_wait_that_misses_and_says_when_it_fits() -> None:
    # 95% of outputs are 3 tokens (the output planned for), the rest 1000: the long one
    # running has 500 to go, a wait no 3-token output absorbs.
    full = _View([_Prefill()], [_Decode([RunningSeq(990, 500)])])
    decision = _predictive([3] * 122 + [1000] * 6).decide(REQ, full)  # type: ignore[attr-defined]
    assert isinstance(decision, Reject) and decision.reason is RejectReason.TBT
    assert decision.predicted > decision.limit == 0.2  # type: ignore[operator]
    # Arriving (tbt - SLO) x steps later, the wait fits in the slack of 2 steps.
    assert decision.retry_after_s == pytest.approx((decision.predicted - 0.2) * 2)  # type: ignore[operator]
    reject = make_scheduling_policy("cache-aware-reject", PolicyContext(COST, SLO(5.0, 0.2)))
    assert reject.decide(REQ, full).reason is RejectReason.DECODE_MEMORY  # type: ignore[union-attr]


def test_predictive_places_on_the_instance_with_room() -> None:
    # Instance 0 frees room in 500 steps (60 s over 999 tokens: 0.06 s a token more), 1 has
    # room now for a 0.038 s step; the lowest predicted mean TBT wins, wait included.
    full, light = _Decode([RunningSeq(990, 500)]), _Decode([RunningSeq(100, 10)])
    decision = _predictive([1000] * 128).decide(REQ, _View([_Prefill()], [full, light]))  # type: ignore[attr-defined]
    assert isinstance(decision, Accept) and decision.decode == 1
    assert decision.predicted_tbt_s == pytest.approx(
        COST.decode_step_s(2, 120 + 1.1 / COST.decode_step_s(1, 100))
    )


def test_survival_is_the_share_longer() -> None:
    est = OutputLenEstimator(prior_len=3)
    assert list(est.survival()) == [1.0, 1.0, 1.0, 0.0, 0.0]  # the prior as a certain length
    for n in (1, 2, 3, 4):
        est.observe(n)
    assert list(est.survival()) == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_survival_counts_running_sequences_as_longer() -> None:
    # Only 5-token outputs have finished; 10 sequences have generated 50 and still run.
    est = OutputLenEstimator()
    for _ in range(10):
        est.observe(5)
    assert est.survival()[5] == 0.0
    est.censor([(50, 100)] * 10)
    s = est.survival()
    assert s[4] == 1.0 and s[5] == s[50] == 0.5 and s[51] == 0.0  # Kaplan-Meier
    est.censor([])
    assert est.survival()[5] == 0.0


def test_room_frees_as_the_output_distribution_ends_sequences() -> None:
    # Half the outputs are 101 tokens, half 301: two fresh sequences of 450 tokens each are
    # expected to hold 2 x 0.5 x 550 = 550 tokens after 100 steps, when 200 more fit; the
    # mean residual output (200 steps) would have freed nothing before 200.
    pred = DecodeLoadPredictor(COST, OutputLenEstimator(refresh_every=1))
    for n in (101, 301) * 64:
        pred.outputs.observe(n)
    decode = _Decode([RunningSeq(450, 1), RunningSeq(450, 1)])
    room = pred.room(decode, 0.0, 0.0, 200)
    assert room.join_s == pytest.approx(100 * COST.decode_step_s(2, 900))
    assert room.load == DecodeLoad(2, pytest.approx(550 + 200))


def test_predictive_waits_for_a_sequence_longer_than_all_finished() -> None:
    # Every finished output is 3 tokens, but a 985-token sequence has generated 100 and a
    # 5-token one 500: the first is expected to reach the 501 tokens the second will have
    # (401 steps more), so the request waits for it, which no planned 3-token output absorbs.
    running = [RunningSeq(985, 100), RunningSeq(5, 500)]
    view = _View([_Prefill()], [_Decode(running)])
    policy = _predictive([3] * 128)
    decision = policy.decide(REQ, view)  # type: ignore[attr-defined]
    assert isinstance(decision, Reject) and decision.reason is RejectReason.TBT
    step = COST.decode_step_s(2, 990)
    wait = 401 * step - COST.prefill_s(20)
    assert decision.predicted == pytest.approx(COST.decode_step_s(1, 20) + wait / 2)


def test_room_reads_each_sequence_by_its_prompt_length() -> None:
    # Long prompts have had 11-token outputs, short ones 301: the 600-token prompt's sequence
    # ends after 10 steps, when 800 more tokens fit beside the short one. Over all prompts
    # half of each would still hold its KV until step 300.
    pred = DecodeLoadPredictor(COST, OutputLenEstimator(refresh_every=1))
    for _ in range(32):
        pred.outputs.observe(11, prompt_len=1000)
        pred.outputs.observe(301, prompt_len=10)
    decode = _Decode([RunningSeq(601, 1), RunningSeq(11, 1)])
    step = COST.decode_step_s(2, 612)
    assert pred.room(decode, 0.0, 0.0, 800).join_s == pytest.approx(10 * step)
    pooled = DecodeLoadPredictor(COST, OutputLenEstimator(refresh_every=1))
    for _ in range(32):
        pooled.outputs.observe(11)
        pooled.outputs.observe(301)
    assert pooled.room(decode, 0.0, 0.0, 800).join_s == pytest.approx(300 * step)


def test_none_joins_before_the_one_waiting_ahead() -> None:
    # 50 tokens fit beside OLD now, but 850 wait ahead (FIFO) until OLD ends at 200 steps;
    # then both fit.
    waiting = _Queue([OLD, RunningSeq(850, 1, is_waiting=True)])
    room = PRED.room(waiting, 0.0, 0.0, 50)
    assert room.join_s == pytest.approx(200 * STEP)
    assert room.load == DecodeLoad(2, pytest.approx(850 + 50))
    assert PRED.room(_Decode([OLD]), 0.0, 0.0, 50).join_s == 0.0


class _Refusing(_Decode):
    """A decode instance that refuses, on arrival, what does not fit then."""

    @property
    def refuses_when_busy(self) -> bool:
        return True


def test_the_odds_of_fitting_on_arrival() -> None:
    # Outputs all of the prior's length: OLD surely holds its 900 tokens until it ends.
    assert PRED.room(_Decode([OLD]), 0.0, 0.0, 200, tbt_s=1.0).fits_p == 0.0
    assert PRED.room(_Decode([OLD]), 0.0, 30.0, 200, tbt_s=1.0).fits_p == 1.0
    # ... and a step of 0.02 + 0.002 + 0.11 s misses a TBT of 0.1 s however it fits.
    assert PRED.room(_Decode([RunningSeq(900, 56)]), 0.0, 30.0, 1000, tbt_s=0.1).fits_p == 0.0
    # Outputs of 50 or 500 tokens, evenly: 100 steps on, each of six young sequences still
    # decodes (holding 200 tokens) on a coin toss, so 400 more fit when three or fewer do
    # (42 in 64); the normal approximation of the batch says even odds.
    outputs = OutputLenEstimator()
    for n in (50, 500) * 40:
        outputs.observe(n)
    young = [RunningSeq(100, 1)] * 6
    at_s = 100 * COST.decode_step_s(6, 600)
    room = DecodeLoadPredictor(COST, outputs).room(_Decode(young), 0.0, at_s, 400, 1.0)
    assert room.fits_p == pytest.approx(0.5, abs=0.05)


def test_a_refusing_instance_drops_what_cannot_fit_on_arrival() -> None:
    # The 850 tokens arriving at 1 s do not fit beside OLD: a queuing instance holds them
    # until OLD ends (the request then waits for them too), a refusing one turns them away.
    queuing = PRED.room(_Decode([OLD], [IncomingSeq(1.0, 850)]), 0.0, 30.0, 200, 1.0)
    refusing = PRED.room(_Refusing([OLD], [IncomingSeq(1.0, 850)]), 0.0, 30.0, 200, 1.0)
    assert queuing.join_s > 30.0 and queuing.fits_p == 0.0
    assert refusing.join_s == 30.0 and refusing.fits_p == 1.0


def test_requests_not_routed_yet_overtake_by_the_recent_rate() -> None:
    arrivals = Arrivals()
    assert arrivals.overtaking(0.0, 10.0) == (0.0, 0.0)  # nothing routed: nothing expected
    for routed_s, delay_s, tokens in ((0.0, 1.0, 100), (1.0, 5.0, 200), (2.0, 1.0, 300)):
        arrivals.record(routed_s, routed_s + delay_s, tokens)
    # 3 routings in 2 s; 4 s ahead, two of every three (delay 1 s) have 3 s to spare.
    count, tokens = arrivals.overtaking(2.0, 6.0)
    assert count == pytest.approx(1.5 * (3 + 0 + 3) / 3) and tokens == 200
    # Counted in the batch a request arriving then joins.
    room = PRED.room(_Decode(), 2.0, 6.0, 100, 1.0, arrivals)
    assert room.load.num_seqs == 1 + round(count)
