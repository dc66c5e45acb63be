"""The cost model and its profile: hand-computed cases, JSON round trip, validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstore.conductor import DATACENTER, CostModel, CostProfile, plan_prefill, resolve_profile

UNIT = CostProfile(
    name="unit",
    block_tokens=4,
    kv_bytes_per_token=10,
    prefill_overhead_s=0.5,
    prefill_s_per_token=0.01,
    prefill_s_per_token_pair=0.001,
    decode_step_overhead_s=0.02,
    decode_s_per_seq=0.001,
    decode_s_per_context_token=0.0001,
    pool_bandwidth_bytes_per_s=400.0,
    transfer_latency_s=0.05,
    decode_kv_capacity_tokens=1000,
    prefill_cache_blocks=8,
    pool_capacity_blocks=64,
)


def test_prefill_time_by_hand() -> None:
    cost = CostModel(UNIT)
    # 10 tokens, none cached: 0.5 + 0.01 * 10 + 0.001 * 100
    assert cost.prefill_s(10) == pytest.approx(0.7)
    # 10 tokens, 4 cached: 0.5 + 0.01 * 6 + 0.001 * (100 - 16)
    assert cost.prefill_s(10, 4) == pytest.approx(0.644)
    assert cost.prefill_s(10, 10) == 0.0
    with pytest.raises(ValueError):
        cost.prefill_s(10, 11)


def test_decode_step_and_transfer_by_hand() -> None:
    cost = CostModel(UNIT)
    assert cost.decode_step_s(0, 0) == 0.0
    assert cost.decode_step_s(3, 200) == pytest.approx(0.02 + 0.003 + 0.02)
    # 2 blocks of 4 tokens of 10 bytes = 80 bytes at 400 B/s, plus 0.05 s latency
    assert cost.transfer_s(2) == pytest.approx(0.05 + 0.2)
    assert cost.transfer_s(0) == 0.0
    assert cost.kv_transfer_s(5) == cost.transfer_s(2)
    # room for 0.1 s: (0.1 - 0.02 - 0.002) / 0.0001 = 780 tokens, under the 1000 capacity
    assert cost.max_context_tokens(2, 0.1) == pytest.approx(780)
    assert cost.max_context_tokens(2, 1.0) == 1000


def test_plan_loads_from_pool_only_when_it_beats_recompute() -> None:
    cost = CostModel(UNIT)
    plan = plan_prefill(cost, 40, local_blocks=2, pool_blocks=6)
    # Loading 6 blocks (0.05 + 0.6 s) saves 0.01*24 + 0.001*(64^2... ) -> worth it
    assert plan.fetched_blocks == 6 and plan.cached_len == 32
    assert plan.seconds == pytest.approx(cost.transfer_s(6) + cost.prefill_s(40, 32))
    cheap = dataclasses.replace(UNIT, prefill_s_per_token=1e-6, prefill_s_per_token_pair=0.0)
    assert plan_prefill(CostModel(cheap), 40, 2, 6).fetched_blocks == 0
    # A fully cached prompt still computes its last token.
    assert plan_prefill(cost, 8, 2, 0).cached_len == 7


def test_datacenter_profile_is_of_realistic_scale() -> None:
    cost = CostModel(DATACENTER)
    assert 1.0 < cost.prefill_s(16_000) < 4.0  # a 16k prompt on 8 A800s: seconds
    assert 0.01 < cost.decode_step_s(32, 32 * 16_000) < 0.1  # a step: tens of ms
    assert DATACENTER.kv_bytes_per_token == 327_680


def test_profile_json_round_trip_and_validation(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    UNIT.save(path)
    assert CostProfile.load(path) == UNIT
    assert resolve_profile(str(path)) == UNIT
    assert resolve_profile("datacenter") is DATACENTER
    with pytest.raises(ValueError):
        dataclasses.replace(UNIT, prefill_s_per_token=-1.0)
    with pytest.raises(ValueError):
        CostProfile.from_json('{"name": "x"}')
    with pytest.raises(ValueError):
        resolve_profile("no-such-profile")
