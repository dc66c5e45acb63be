"""The live scheduler bench's trace scaling: trace blocks become engine blocks, shared hash-id
prefixes stay shared token prefixes, lengths scale, and each run draws its own tokens."""

from __future__ import annotations

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
