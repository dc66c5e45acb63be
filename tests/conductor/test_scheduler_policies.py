"""Each policy picks the expected instance in constructed clusters; admission never refuses
a request the model predicts to fit."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest

from kvstore.conductor import (
    SCHEDULING_POLICIES,
    SLO,
    Accept,
    CostModel,
    PolicyContext,
    Reject,
    RejectReason,
    SchedRequest,
    make_scheduling_policy,
)
from kvstore.conductor.view import ClusterView, DecodeView, IncomingSeq, PrefillView, RunningSeq
from tests.conductor.test_scheduler_cost_model import UNIT

COST = CostModel(UNIT)
SLO_ = SLO(ttft_s=5.0, tbt_s=0.1)


class _Prefill(PrefillView):
    def __init__(self, queued_s: float = 0.0, num: int = 0, tokens: int = 0, cached=()) -> None:
        self._s, self._n, self._t, self._cached = queued_s, num, tokens, set(cached)

    def queued_s(self) -> float:
        return self._s

    def num_queued(self) -> int:
        return self._n

    def queued_tokens(self) -> int:
        return self._t

    def cached_prefix(self, hash_ids: Sequence[int]) -> int:
        k = 0
        while k < len(hash_ids) and hash_ids[k] in self._cached:
            k += 1
        return k

    @property
    def cache_capacity_blocks(self) -> int:
        return UNIT.prefill_cache_blocks


class _Decode(DecodeView):
    def __init__(self, running=(), incoming=()) -> None:
        self._running, self._incoming = list(running), list(incoming)

    def running(self) -> list[RunningSeq]:
        return self._running

    def incoming(self) -> list[IncomingSeq]:
        return self._incoming

    def context_tokens(self) -> int:
        return sum(s.context_len for s in self._running)

    @property
    def kv_capacity_tokens(self) -> int:
        return UNIT.decode_kv_capacity_tokens


class _View(ClusterView):
    def __init__(self, prefill, decode, pool=(), now_s: float = 0.0) -> None:
        self._p, self._d, self._pool, self._now = prefill, decode, set(pool), now_s

    @property
    def now_s(self) -> float:
        return self._now

    @property
    def prefill(self):
        return self._p

    @property
    def decode(self):
        return self._d

    @property
    def cost(self) -> CostModel:
        return COST

    def pool_prefix(self, hash_ids: Sequence[int], start: int = 0) -> int:
        k = start
        while k < len(hash_ids) and hash_ids[k] in self._pool:
            k += 1
        return k - start


def _policy(name: str, slo: SLO = SLO_):
    return make_scheduling_policy(name, PolicyContext(COST, slo, seed=1))


REQ = SchedRequest(0, 0.0, 16, (1, 2, 3, 4))


def test_registry_names_all_eleven() -> None:
    assert list(SCHEDULING_POLICIES) == [
        "random",
        "round-robin",
        "least-loaded",
        "prefix-rr",
        "sglang-cache-aware",
        "dynamo-cost",
        "llm-d-scorers",
        "cache-aware",
        "cache-aware-ttft",
        "cache-aware-reject",
        "cache-aware-predictive",
    ]
    with pytest.raises(KeyError):
        _policy("nope")


def test_prefix_rr_largest_match_then_turns() -> None:
    view = _View(
        [_Prefill(9.0, cached=(1, 2, 3)), _Prefill(), _Prefill(cached=(1,))], [_Decode()] * 2
    )
    policy = _policy("prefix-rr")
    assert policy.decide(REQ, view) == Accept(0, 0)  # longest match, whatever its queue
    assert policy.decide(REQ, view) == Accept(0, 1)  # decode in turn
    cold = _View([_Prefill(), _Prefill()], [_Decode()])
    other = SchedRequest(1, 0.0, 8, (7, 8))
    assert [policy.decide(other, cold).prefill for _ in range(3)] == [0, 1, 0]


def test_least_loaded_counts_pending_tokens_not_requests() -> None:
    view = _View(
        [_Prefill(num=1, tokens=900), _Prefill(num=5, tokens=100)],
        [_Decode([RunningSeq(500, 3)]), _Decode([RunningSeq(100, 1)] * 2)],
    )
    assert _policy("least-loaded").decide(REQ, view) == Accept(1, 1)


def test_sglang_cache_aware_unless_imbalanced() -> None:
    decode = [_Decode()]
    balanced = _View([_Prefill(num=3), _Prefill(num=1, cached=(1, 2, 3))], decode)
    assert _policy("sglang-cache-aware").decide(REQ, balanced).prefill == 1
    low_match = _View([_Prefill(num=3), _Prefill(num=1, cached=(1,))], decode)
    assert _policy("sglang-cache-aware").decide(REQ, low_match).prefill == 1  # least loaded
    imbalanced = _View([_Prefill(num=40, cached=(1, 2, 3)), _Prefill(num=2)], decode)
    assert _policy("sglang-cache-aware").decide(REQ, imbalanced).prefill == 1


def test_dynamo_cost_and_busy_rejection() -> None:
    policy = _policy("dynamo-cost")
    threshold = policy.prefill_tokens_threshold  # type: ignore[attr-defined]
    view = _View([_Prefill(tokens=8), _Prefill(tokens=0, cached=(1, 2, 3, 4))], [_Decode()])
    assert policy.decide(REQ, view) == Accept(1, 0)
    busy = _View([_Prefill(tokens=int(threshold) + 1)], [_Decode()])
    assert policy.decide(REQ, busy) == Reject(RejectReason.BUSY)


def test_llm_d_prefers_the_cache_at_equal_queues() -> None:
    view = _View([_Prefill(num=1), _Prefill(num=1, cached=(1, 2, 3, 4))], [_Decode()])
    assert _policy("llm-d-scorers").decide(REQ, view).prefill == 1


def test_llm_d_sheds_only_past_saturation() -> None:
    idle = _View([_Prefill(num=1)], [_Decode()])
    flooded = _View([_Prefill(num=20)], [_Decode()])  # saturation 4: drop probability 1
    policy = _policy("llm-d-scorers")
    assert isinstance(policy.decide(REQ, idle), Accept)
    assert policy.decide(REQ, flooded) == Reject(RejectReason.SHED)
    assert isinstance(policy.decide(REQ._replace(priority=1), flooded), Accept)


def test_cache_aware_picks_lowest_predicted_ttft() -> None:
    # Instance 0 holds the prefix but has 2 s queued; instance 1 is idle but cold.
    view = _View([_Prefill(2.0, cached=(1, 2, 3, 4)), _Prefill()], [_Decode()])
    decision = _policy("cache-aware").decide(REQ, view)
    assert decision.prefill == 1  # type: ignore[union-attr]
    assert decision.predicted_ttft_s == pytest.approx(COST.prefill_s(16))  # type: ignore[union-attr]
    short = _View([_Prefill(0.1, cached=(1, 2, 3, 4)), _Prefill()], [_Decode()])
    assert _policy("cache-aware").decide(REQ, short).prefill == 0


def test_ttft_rejection_says_why_and_when() -> None:
    view = _View([_Prefill(6.0)], [_Decode()])
    decision = _policy("cache-aware-reject").decide(REQ, view)
    assert isinstance(decision, Reject) and decision.reason is RejectReason.TTFT
    assert decision.predicted == pytest.approx(6.0 + COST.prefill_s(16))
    assert decision.limit == 5.0
    assert decision.retry_after_s == pytest.approx(decision.predicted - 5.0)
    huge = SchedRequest(1, 0.0, 200, tuple(range(100, 150)))  # its prefill alone is 42 s
    never = _policy("cache-aware-reject").decide(huge, _View([_Prefill()], [_Decode()]))
    assert isinstance(never, Reject) and never.retry_after_s is None


def test_predictive_counts_requests_on_their_way_to_decode() -> None:
    # Now the decode instance is idle; 5 requests of 100 tokens reach it before this one.
    incoming = [IncomingSeq(0.5, 100)] * 5
    view = _View([_Prefill()], [_Decode(incoming=incoming)])
    tight = SLO(ttft_s=5.0, tbt_s=0.07)
    assert isinstance(_policy("cache-aware-reject", tight).decide(REQ, view), Accept)
    decision = _policy("cache-aware-predictive", tight).decide(REQ, view)
    assert isinstance(decision, Reject) and decision.reason is RejectReason.TBT
    assert decision.predicted >= COST.decode_step_s(6, 516) > 0.07  # type: ignore[operator]


def _random_view(rng: random.Random) -> _View:
    prefill = [
        _Prefill(rng.uniform(0, 8), cached=rng.sample(range(1, 6), rng.randint(0, 4)))
        for _ in range(rng.randint(1, 4))
    ]
    decode = [
        _Decode(
            [RunningSeq(rng.randint(10, 300), rng.randint(1, 50)) for _ in range(rng.randint(0, 6))]
        )
        for _ in range(rng.randint(1, 3))
    ]
    return _View(prefill, decode, pool=rng.sample(range(1, 6), rng.randint(0, 5)))


@pytest.mark.parametrize("name", ["cache-aware-reject", "cache-aware-predictive"])
def test_rejection_never_refuses_a_request_predicted_to_fit(name: str) -> None:
    rng = random.Random(7)
    for _ in range(300):
        view = _random_view(rng)
        req = SchedRequest(0, 0.0, rng.randint(1, 40), (1, 2, 3, 4, 5)[: rng.randint(1, 5)])
        decision = _policy(name).decide(req, view)
        admitted = _policy("cache-aware").decide(req, view)
        assert isinstance(admitted, Accept)
        if isinstance(decision, Reject):
            assert decision.predicted is not None and decision.limit is not None
            assert decision.predicted > decision.limit
        elif name == "cache-aware-reject":
            assert decision == admitted  # same prediction, same placement
        fits = admitted.predicted_ttft_s <= SLO_.ttft_s and admitted.predicted_tbt_s <= SLO_.tbt_s  # type: ignore[operator]
        if name == "cache-aware-reject" and fits:
            assert isinstance(decision, Accept)


def test_random_is_seeded() -> None:
    view = _View([_Prefill() for _ in range(5)], [_Decode() for _ in range(5)])
    picks = [_policy("random").decide(REQ, view) for _ in range(2)]
    assert picks[0] == picks[1]
    assert dataclasses.is_dataclass(PolicyContext)


class _Queued(_Prefill):
    """A prefill instance whose queue holds a request with the blocks `queued`."""

    def __init__(self, queued_s: float, queued=()) -> None:
        super().__init__(queued_s)
        self._queued = set(queued)

    def queued_prefix(self, hash_ids: Sequence[int]) -> int:
        k = 0
        while k < len(hash_ids) and hash_ids[k] in self._cached | self._queued:
            k += 1
        return k


def test_cache_aware_follows_the_previous_turn_still_queued() -> None:
    # Instance 0 queues the previous turn (blocks 1-3): the prompt will find them there, so
    # 0.1 s of queue + 4 tokens beats the idle, cold instance 1.
    view = _View([_Queued(0.1, queued=(1, 2, 3)), _Prefill()], [_Decode()])
    decision = _policy("cache-aware").decide(REQ, view)
    assert decision.prefill == 0  # type: ignore[union-attr]
    assert decision.predicted_ttft_s == pytest.approx(0.1 + COST.prefill_s(16, 12))  # type: ignore[union-attr]
