"""The live scheduler bench's trace scaling: trace blocks become engine blocks, shared hash-id
prefixes stay shared token prefixes, lengths scale, and each run draws its own tokens."""

from __future__ import annotations

from kvstore.bench import scheduler_live as live
from kvstore.bench.scheduler_live import MAX_OUTPUT_TOKENS, OUTPUT_SCALE, scale_trace
from kvstore.conductor.sim.simulator import TraceRequest

TRACE = [
    TraceRequest(1000, 1024, 80, (1, 2)),
    TraceRequest(1500, 1300, 4000, (1, 2, 3)),  # shares two blocks with the first
    TraceRequest(3000, 100, 1, (9,)),
]


def test_shared_trace_blocks_become_shared_token_prefixes_of_scaled_lengths():
    scaled = scale_trace(TRACE, 16, 512, seed=0, speedup=2.0)
    assert [r.arrival_s for r in scaled] == [0.0, 0.25, 1.0]
    assert [len(r.prompt) for r in scaled] == [32, 41, 4]  # ceil(input_len x 16 / 512)
    assert scaled[1].prompt[:32] == scaled[0].prompt
    assert scaled[2].prompt != scaled[0].prompt[:4]
    assert [r.max_tokens for r in scaled] == [80 // OUTPUT_SCALE, MAX_OUTPUT_TOKENS, 1]
    assert all(0 <= t < 512 for r in scaled for t in r.prompt)


def test_each_run_draws_its_own_tokens_deterministically():
    first, again = scale_trace(TRACE, 16, 512, 0, 1.0), scale_trace(TRACE, 16, 512, 0, 1.0)
    other = scale_trace(TRACE, 16, 512, 1, 1.0)
    assert first == again
    assert first[0].prompt != other[0].prompt


def _live_row(policy: str, attainment: float = 0.97, error: float = 0.1) -> dict:
    return {
        "policy": policy,
        "accepted_slo_attainment": attainment,
        "ttft_pred_rel_err_p50": error,
        "live_model": "tiny",
    }


def test_live_targets_fail_when_missed_or_unmeasured():
    rows = [_live_row(p) for p in live.COMPARED]
    assert live.is_live(rows) and live.failures(rows) == [] and live.exit_status(rows) == 0
    assert live.failures(rows[1:]) == ["unmeasured: no row of round-robin"]
    missed = [*rows[:2], _live_row(live.OURS, attainment=0.9, error=0.25)]
    assert len(live.failures(missed)) == 2 and live.exit_status(missed) == 1
    unmeasured = [*rows[:2], _live_row(live.OURS, error=float("nan"))]
    assert live.failures(unmeasured) == [
        "unmeasured: cache-aware-predictive served nothing whose TTFT it predicted"
    ]


def test_requests_turned_away_before_the_policy_leave_the_run_unmeasured():
    rows = [_live_row(p) | {"unrecorded": 0} for p in live.COMPARED]
    assert live.failures(rows) == []
    rows[0]["unrecorded"] = 68  # e.g. 429 too_many_streams: no outcome, no policy decision
    assert live.failures(rows) == ["unmeasured: round-robin left 68 requests without an outcome"]
    assert live.exit_status(rows) == 1
