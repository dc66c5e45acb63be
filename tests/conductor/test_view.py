"""The conductor's pieces without processes: the live view over constructed bookkeeping (block
ids, prefill queues, decode batches, the pool match), the policies deciding on it, the roles,
the byte tokenizer, request parsing and the metrics."""

from __future__ import annotations

import pytest

from gpu_engine.config import EngineConfig
from kvstore.conductor import SLO, Accept, PolicyContext, Reject, RejectReason, ttft
from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.front.completion import CompletionOutcome
from kvstore.conductor.front.conductor import Roles
from kvstore.conductor.front.config import ConductorConfig
from kvstore.conductor.front.http_api import parse_request
from kvstore.conductor.front.latency import FixedLatency
from kvstore.conductor.front.live_view import (
    LiveCluster,
    LiveDecode,
    LivePrefill,
    block_id,
    prompt_blocks,
)
from kvstore.conductor.front.metrics import ConductorMetrics
from kvstore.conductor.front.speed import SpeedRatio
from kvstore.conductor.front.tokenizer import REPLACEMENT, ByteTokenizer, Detokenizer
from kvstore.conductor.profile import CostProfile
from kvstore.conductor.registry import make_scheduling_policy
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.view import RunningSeq
from kvstore.errors import InvalidArgumentError
from kvstore.keys import block_keys

BLOCK = 16
# Step time 10 ms + 10 ms per sequence: one decoding sequence fits a 25 ms TBT SLO, two do not.
PROFILE = CostProfile(
    name="test: fixed coefficients",
    block_tokens=BLOCK,
    kv_bytes_per_token=512,
    prefill_overhead_s=0.001,
    prefill_s_per_token=1e-5,
    prefill_s_per_token_pair=0.0,
    decode_step_overhead_s=0.01,
    decode_s_per_seq=0.01,
    decode_s_per_context_token=0.0,
    pool_bandwidth_bytes_per_s=1e9,
    transfer_latency_s=0.001,
    decode_kv_capacity_tokens=16384,
    prefill_cache_blocks=1024,
    pool_capacity_blocks=100_000,
)
NAMESPACE = EngineConfig().namespace  # tiny, 16-token blocks: what the engines publish in
COST = CostModel(PROFILE)


def _cluster(num_prefill: int = 2, num_decode: int = 1, speed_window: int = 0) -> LiveCluster:
    """A view predicting with PROFILE as it is, unless `speed_window` measures the engines."""
    prefills = [LivePrefill(PROFILE.prefill_cache_blocks) for _ in range(num_prefill)]
    decodes = [LiveDecode(PROFILE.decode_kv_capacity_tokens) for _ in range(num_decode)]
    return LiveCluster(CostModel(PROFILE), prefills, decodes, speed_window)


def _request(prompt: list[int], request_id: int = 0, now_s: float = 0.0) -> SchedRequest:
    return SchedRequest(request_id, now_s, len(prompt), prompt_blocks(NAMESPACE, prompt).hash_ids)


def _policy(name: str, slo: SLO | None = None):
    return make_scheduling_policy(name, PolicyContext(COST, slo or SLO(30.0, 1.0)))


def test_block_ids_are_the_engines_keys_and_a_partial_block_gets_its_own():
    prompt = list(range(3 * BLOCK + 5))
    blocks = prompt_blocks(NAMESPACE, prompt)
    assert blocks.keys == block_keys(NAMESPACE, prompt)
    assert list(blocks.hash_ids[:3]) == [block_id(k) for k in blocks.keys]
    assert len(blocks.hash_ids) == 4 and blocks.num_full == 3
    other_tail = prompt_blocks(NAMESPACE, [*prompt[:-1], 499]).hash_ids
    assert other_tail[:3] == blocks.hash_ids[:3] and other_tail[3] != blocks.hash_ids[3]
    assert len(prompt_blocks(NAMESPACE, prompt[: 2 * BLOCK]).hash_ids) == 2


def test_a_prefill_queue_drains_in_real_time_and_a_finish_takes_out_its_own_work():
    cluster = _cluster()
    pre = cluster.prefills[0]
    pre.enqueue(0, 1.0, 100, [1, 2])
    pre.enqueue(1, 0.5, 40, [1, 3])
    assert (pre.queued_s(), pre.num_queued(), pre.queued_tokens()) == (1.5, 2, 140)
    cluster.snapshot(0.4)
    assert pre.queued_s() == pytest.approx(1.1)
    pre.finish(0)  # early: the 0.6 s it was predicted to take still are not ahead
    assert pre.queued_s() == pytest.approx(0.5) and pre.queued_tokens() == 40
    cluster.snapshot(1.4)
    assert pre.queued_s() == 0.0  # late: nothing is known to be left of it
    pre.finish(1)
    assert (pre.queued_s(), pre.num_queued()) == (0.0, 0)
    assert pre.cached_prefix([1, 2, 9]) == 2 and pre.cached_prefix([1, 3]) == 2
    cluster.snapshot(0.1)  # never backwards
    assert cluster.now_s == 0.4 + 1.0


def test_the_speed_factor_is_measured_over_predicted_time_over_a_window():
    speed = SpeedRatio(window=2, max_age_s=10.0)
    assert speed.factor(0.0) == 1.0  # nothing seen: the profile as it is
    speed.observe(0.0, 3.0, 1.0)
    speed.observe(1.0, 1.0, 1.0)
    assert speed.factor(1.0) == 2.0 and len(speed) == 2
    speed.observe(2.0, 0.5, 0.0)  # predicted free: tells nothing
    speed.observe(3.0, 2.0, 2.0)  # the window drops the first
    assert speed.factor(3.0) == pytest.approx(1.0)
    off = SpeedRatio(window=0)
    off.observe(0.0, 5.0, 1.0)
    assert off.factor(0.0) == 1.0 and len(off) == 0
    for bad in ({"window": -1}, {"max_age_s": 0.0}):
        with pytest.raises(ValueError):
            SpeedRatio(**bad)


def test_the_latency_is_the_median_lateness_of_recent_first_tokens_never_below_zero():
    late = FixedLatency(window=3, max_age_s=10.0)
    assert late.seconds(0.0) == 0.0  # nothing seen
    for at, measured in ((0.0, 0.5), (1.0, 0.13), (2.0, 0.11)):  # predicted 0.1 each
        late.observe(at, measured, 0.1)
    assert late.seconds(2.0) == pytest.approx(0.03)  # the stall at 0.0 moves it one place
    late.observe(3.0, 0.05, 0.1)  # the window drops the first
    assert late.seconds(3.0) == pytest.approx(0.01)
    late.observe(4.0, 0.0, 0.1)
    late.observe(5.0, 0.0, 0.1)
    assert late.seconds(5.0) == 0.0  # early: a speed for the factor, no negative latency
    assert late.seconds(20.0) == 0.0 and len(late) == 0  # expired
    off = FixedLatency(window=0)
    off.observe(0.0, 5.0, 1.0)
    assert off.seconds(0.0) == 0.0 and len(off) == 0


def test_the_predicted_ttft_counts_the_measured_latency():
    cluster = _cluster(speed_window=8)
    req = _request(list(range(20)))
    before = ttft.estimate(req, cluster, 0)
    for k in range(3):
        cluster.observe_first_token(float(k), before.ttft_s + 0.04, before.ttft_s)
    cluster.snapshot(3.0)
    after = ttft.estimate(req, cluster, 0)
    assert after.latency_s == pytest.approx(0.04)
    assert after.ttft_s == pytest.approx(before.ttft_s + 0.04)
    cluster.forget_speed()
    cluster.snapshot(3.0)
    assert ttft.estimate(req, cluster, 0).ttft_s == pytest.approx(before.ttft_s)


def test_a_measured_slowdown_expires_so_a_conductor_that_refuses_everything_measures_again():
    cluster = _cluster(speed_window=8)
    policy = make_scheduling_policy(
        "cache-aware-predictive", PolicyContext(cluster.cost, SLO(0.1, 1.0))
    )
    pre = cluster.prefills[0]
    pre.enqueue(0, 0.001, 10, [])
    cluster.snapshot(10.0)
    pre.finish(0, served=True)  # a stall: 10,000x the profile
    cluster.snapshot(10.0)
    assert isinstance(policy.decide(_request([1, 2, 3], 1, 10.0), cluster), Reject)
    cluster.snapshot(10.0 + cluster.prefill_speed.max_age_s + 1.0)
    assert cluster.prefill_speed.factor(cluster.now_s) == 1.0
    assert isinstance(policy.decide(_request([1, 2, 3], 2, cluster.now_s), cluster), Accept)


def test_each_first_token_measures_the_busy_time_since_the_engines_last_one():
    cluster = _cluster(speed_window=8)
    p0, p1 = cluster.prefills
    p0.enqueue(0, 1.0, 10, [])
    p0.enqueue(1, 1.0, 10, [])
    cluster.snapshot(3.0)
    p0.finish(0, served=True)  # busy 0 -> 3 s for 1 s of predicted work
    assert cluster.prefill_speed.factor(3.0) == 3.0 and p1.speed is cluster.prefill_speed
    assert p0.queued_s() == 3.0  # what is left, at the measured speed
    cluster.snapshot(4.0)
    assert p0.queued_s() == 2.0
    cluster.snapshot(5.0)
    p0.finish(1, served=True)  # 3 -> 5 s: its wait behind request 0 is not counted again
    assert cluster.prefill_speed.factor(5.0) == pytest.approx(5.0 / 2.0)
    cluster.snapshot(9.0)
    p0.enqueue(2, 1.0, 10, [])  # a new busy period: the idle time before it is nobody's
    cluster.snapshot(10.0)
    p0.finish(2)  # failed or cancelled: no measurement
    assert len(cluster.prefill_speed) == 2


def test_the_view_scales_the_policys_cost_model_by_the_measured_speed():
    prompt = list(range(20))
    cluster = _cluster(speed_window=8)
    policy = make_scheduling_policy(
        "cache-aware-predictive", PolicyContext(cluster.cost, SLO(0.1, 1.0))
    )
    base_s = COST.prefill_s(20)
    assert isinstance(policy.decide(_request(prompt), cluster), Accept)  # 1.2 ms by the profile
    pre = cluster.prefills[0]
    pre.enqueue(9, base_s, 20, [])
    cluster.snapshot(200 * base_s)
    pre.finish(9, served=True)  # the engines took 200x the profile's time
    cluster.snapshot(200 * base_s)
    assert cluster.cost.prefill_s(20) == pytest.approx(200 * base_s)
    decision = policy.decide(_request(prompt, 1, cluster.now_s), cluster)
    assert isinstance(decision, Reject) and decision.reason is RejectReason.TTFT
    assert decision.predicted == pytest.approx(200 * base_s)
    assert cluster.base_profile == PROFILE


def test_decode_gaps_measure_the_decode_step_of_the_batch_held():
    cluster = _cluster(speed_window=8)
    dec = cluster.decodes[0]
    dec.start(0, 100, 1)
    dec.start(1, 100, 1)  # 2 sequences: the profile's step is 10 + 2 x 10 ms
    cluster.observe_decode(0, 0.0, 0.06, 1)
    cluster.observe_decode(0, 0.0, 0.18, 2)  # two steps in one message
    assert cluster.decode_speed.factor(0.0) == pytest.approx(0.24 / 0.09)
    cluster.snapshot(0.0)
    assert cluster.cost.decode_step_s(2, 200) == pytest.approx(0.24 / 0.09 * 0.03)
    assert cluster.cost.prefill_s(20) == COST.prefill_s(20)  # prefill measured nothing


def test_the_speed_and_warm_up_settings_are_checked_at_start():
    assert ConductorConfig(engines="127.0.0.1:1", speed_window=0).speed_window == 0
    bad = ({"speed_window": -1}, {"speed_max_age_s": 0.0}, {"speed_max_age_s": float("nan")})
    for settings in bad:
        with pytest.raises(InvalidArgumentError, match="speed_"):
            ConductorConfig(engines="127.0.0.1:1", **settings)
    assert ConductorConfig(engines="127.0.0.1:1", warmup_rounds=0).warmup_rounds == 0
    with pytest.raises(InvalidArgumentError, match="warmup_rounds must be >= 0"):
        ConductorConfig(engines="127.0.0.1:1", warmup_rounds=-1)


def test_a_profile_scales_its_prefill_and_decode_times_and_keeps_its_sizes():
    fast = PROFILE.scaled(prefill=2.0, decode=0.5)
    cost = CostModel(fast)
    assert cost.prefill_s(100, 20) == pytest.approx(2 * COST.prefill_s(100, 20))
    assert cost.transfer_s(5) == pytest.approx(2 * COST.transfer_s(5))
    assert cost.decode_step_s(3, 300) == pytest.approx(0.5 * COST.decode_step_s(3, 300))
    assert fast.block_bytes == PROFILE.block_bytes
    assert fast.decode_kv_capacity_tokens == PROFILE.decode_kv_capacity_tokens
    assert PROFILE.scaled(1.0, 1.0) == PROFILE
    with pytest.raises(ValueError):
        PROFILE.scaled(0.0, 1.0)


def test_a_decode_instance_counts_incoming_then_running_context():
    dec = LiveDecode(1000)
    dec.expect(7, 2.5, 100)
    assert dec.incoming()[0] == (2.5, 100) and dec.context_tokens() == 0
    dec.start(7, 100, 1, is_waiting=True)  # handed over: loading its KV, holding no pages
    assert dec.running() == [RunningSeq(101, 1, True)] and dec.context_tokens() == 0
    dec.advance(7, 4)
    assert dec.incoming() == [] and dec.running() == [RunningSeq(105, 5)]
    assert dec.context_tokens() == 105
    dec.finish(7)
    assert dec.running() == [] and dec.kv_capacity_tokens == 1000


def test_the_pool_is_the_match_of_the_request_being_decided():
    cluster = _cluster()
    ids = (11, 12, 13, 14)
    cluster.set_pool_match(ids, 3)
    assert cluster.pool_prefix(ids) == 3 and cluster.pool_prefix(ids, 1) == 2
    assert cluster.pool_prefix((11, 99)) == 1
    cluster.snapshot(1.0)
    assert cluster.pool_prefix(ids) == 0


def test_cache_aware_routes_to_the_engine_caching_the_prefix_unless_its_queue_costs_more():
    prompt = list(range(40 * BLOCK))
    req = _request(prompt)
    cluster = _cluster()
    cluster.prefills[1].enqueue(0, 0.0, 0, req.hash_ids[:40])
    decision = _policy("cache-aware").decide(req, cluster)
    assert isinstance(decision, Accept) and decision.prefill == 1
    cluster.prefills[1].enqueue(1, 5.0, 640, [])  # 5 s ahead: computing anew is faster
    assert _policy("cache-aware").decide(req, cluster).prefill == 0


def test_predictive_admission_refuses_a_second_decoding_sequence_over_the_tbt_slo():
    cluster = _cluster()
    cluster.decodes[0].start(0, 40, 2)
    policy = _policy("cache-aware-predictive", SLO(30.0, 0.025))
    decision = policy.decide(_request(list(range(20))), cluster)
    assert isinstance(decision, Reject) and decision.reason is RejectReason.TBT
    # Two sequences, 10 + 2 x 10 ms a step, and the whole handoff (nothing timed: at the
    # profile's speed) spread over the 255 steps after the first of the prior's output.
    handoff_s = CostModel(PROFILE).kv_transfer_s(20)
    assert decision.predicted == pytest.approx(0.03 + handoff_s / 255)
    assert decision.limit == 0.025
    assert decision.retry_after_s is not None and decision.retry_after_s >= 0
    cluster.decodes[0].finish(0)
    assert isinstance(policy.decide(_request(list(range(20))), cluster), Accept)


def test_the_live_handoff_is_the_whole_transfer_at_its_measured_speed():
    cluster = _cluster(speed_window=8)
    transfer_s = CostModel(PROFILE).kv_transfer_s(640)
    assert cluster.handoff_s(640, compute_s=1.0) == pytest.approx(transfer_s)  # no overlap
    cluster.observe_handoff(1.0, 4 * CostModel(PROFILE).kv_transfer_s(100), 100)
    assert cluster.handoff_s(640, 1.0) == pytest.approx(4 * transfer_s)
    cluster.forget_speed()  # the warm-up's cold round
    assert cluster.handoff_s(640, 1.0) == pytest.approx(transfer_s)


def test_predictive_admission_spreads_the_handoff_over_the_output_its_client_allows():
    cluster = _cluster(speed_window=8)
    cluster.observe_handoff(0.0, 0.2, 20)  # 200 ms from first token to the decode engine's
    policy = _policy("cache-aware-predictive", SLO(30.0, 0.04))
    short = _request(list(range(20)))._replace(max_output=3)
    refused = policy.decide(short, cluster)  # a 20 ms step and 200 ms over 2 gaps
    assert isinstance(refused, Reject) and refused.reason is RejectReason.TBT
    assert refused.predicted == pytest.approx(0.02 + 0.2 / 2)
    long = _request(list(range(20)), 1)._replace(max_output=64)
    admitted = policy.decide(long, cluster)  # 200 ms over 63 gaps
    assert isinstance(admitted, Accept)
    assert admitted.predicted_tbt_s == pytest.approx(0.02 + 0.2 / 63)


def test_round_robin_takes_prefill_engines_in_turn():
    cluster, policy = _cluster(), _policy("round-robin")
    picks = [policy.decide(_request([1, 2, 3], i), cluster).prefill for i in range(4)]
    assert picks == [0, 1, 0, 1]


def test_roles_come_from_the_engines_and_a_mix_is_refused():
    assert Roles.of(["prefill", "decode", "prefill"]) == Roles((0, 2), (1,), False)
    assert Roles.of(["both", "both"]) == Roles((0, 1), (0, 1), True)
    for bad in (["prefill"], ["both", "decode"], ["decode"], []):
        with pytest.raises(InvalidArgumentError):
            Roles.of(bad)


def test_the_tokenizer_maps_utf8_bytes_and_replaces_what_has_no_text():
    tok = ByteTokenizer()
    text = "héllo ✓"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 300, 105]) == f"h{REPLACEMENT}i"
    detok = Detokenizer()
    pieces = [detok.feed([b]) for b in "✓".encode()]
    assert pieces == ["", "", "✓"]
    assert Detokenizer().feed([0xE2], final=True) == REPLACEMENT


def test_requests_parse_from_openai_bodies_and_slo_headers():
    tok, slo = ByteTokenizer(), SLO(30.0, 0.1)
    r = parse_request({"prompt": "ab", "max_tokens": 3}, {}, slo, tok)
    assert (r.prompt_token_ids, r.max_tokens, r.temperature, r.seed) == ((97, 98), 3, 1.0, None)
    r = parse_request({"prompt": [[5, 6]], "temperature": 0, "seed": 1}, {}, slo, tok)
    assert (r.prompt_token_ids, r.temperature, r.seed, r.slo) == ((5, 6), 0.0, 1, slo)
    headers = {"x-slo-ttft-ms": "250", "x-slo-tbt-ms": "20"}
    assert parse_request({"prompt": "a"}, headers, slo, tok).slo == SLO(0.25, 0.02)
    bad = [
        {"prompt": ""}, {"prompt": "a", "n": 2}, {"prompt": [1, -2]},
        {"prompt": "a", "max_tokens": 0}, {"prompt": "a", "temperature": -1},
        {"prompt": ["a", "b"]}, [],
    ]  # fmt: skip
    for body in bad:
        with pytest.raises(InvalidArgumentError):
            parse_request(body, {}, slo, tok)
    with pytest.raises(InvalidArgumentError):
        parse_request({"prompt": "a"}, {"x-slo-ttft-ms": "-1"}, slo, tok)


def test_metrics_count_routed_rejected_and_the_ttft_error():
    metrics = ConductorMetrics(["e0", "e1"])
    metrics.observe(CompletionOutcome(0, Reject(RejectReason.TTFT, 2.0, 1.0, None), 10, 0.0))
    served = CompletionOutcome(
        1, None, 10, 0.0, prefill=0, decode=1, predicted_ttft_s=0.2, ttft_s=0.25, tbt_s=0.01,
        output_token_ids=(1, 2, 3), finish_reason="length",
    )  # fmt: skip
    metrics.observe(served)
    reg = metrics.registry
    assert (
        reg.get_sample_value("kvstore_conductor_rejected_requests_total", {"reason": "ttft"}) == 1
    )
    routed = {"prefill": "e0", "decode": "e1"}
    assert reg.get_sample_value("kvstore_conductor_routed_requests_total", routed) == 1
    error = "kvstore_conductor_ttft_error_seconds_bucket"  # -0.05 s: predicted too low
    assert reg.get_sample_value(error, {"le": "-0.1"}) == 0
    assert reg.get_sample_value(error, {"le": "-0.025"}) == 1
    cluster = _cluster(1, 1, speed_window=8)
    cluster.prefills[0].enqueue(5, 2.0, 10, [])
    metrics.watch(cluster, [0], [1])
    assert reg.get_sample_value("kvstore_conductor_engine_queued_seconds", {"engine": "e0"}) == 2.0
    speed = "kvstore_conductor_speed_factor"
    assert reg.get_sample_value(speed, {"phase": "prefill"}) == 1.0
    cluster.snapshot(3.0)
    cluster.prefills[0].finish(5, served=True)
    assert reg.get_sample_value(speed, {"phase": "prefill"}) == 1.5
    assert reg.get_sample_value(speed, {"phase": "decode"}) == 1.0
