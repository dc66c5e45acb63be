"""The prefix suite's registration, flags, rows, floor and target ratios (no processes: the
end-to-end path is covered by tests/engine/test_engine_service.py and by running the suite)."""

from __future__ import annotations

import pytest

from gpu_engine.engine import Usage
from gpu_engine.engine_client import GenerateResult
from kvstore.bench import prefix
from kvstore.bench.__main__ import build_parser
from kvstore.bench.prefix_workloads import WORKLOADS, WorkloadRun
from kvstore.bench.suites import SUITES

JSON_KEYS = {
    "workload", "mode", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "cached_tokens",
    "bytes_loaded", "floor_ms", "outputs_identical",
}  # fmt: skip


def _result(
    ttft_s: float, tokens: tuple[int, ...], store_cached: int = 0, start_s: float = 0.0
) -> GenerateResult:
    usage = Usage(1000, len(tokens), store_cached, 0, store_cached)
    end_s = start_s + ttft_s + 0.01 * (len(tokens) - 1)
    return GenerateResult(
        0, tokens, "length", usage, ttft_s, 0.01, ttft_s, 0.01, None, start_s, end_s
    )


def test_suite_is_registered_with_its_workload_flag():
    assert SUITES["prefix"].module == "kvstore.bench.prefix"
    args = build_parser("prefix").parse_args(["prefix", "--workload", "long-doc-qa", "--quick"])
    assert args.workload == "long-doc-qa" and args.quick
    with pytest.raises(SystemExit):
        build_parser("prefix").parse_args(["prefix", "--workload", "nope"])
    assert set(WORKLOADS) == {"system-prompt", "multi-round-qa", "long-doc-qa"}


def test_quick_keeps_the_shape_and_long_doc_is_8k():
    for workload in WORKLOADS.values():
        assert workload.quick.num_users <= workload.full.num_users
        assert workload.quick.context_len <= workload.full.context_len
    assert WORKLOADS["long-doc-qa"].full.context_len >= 8192


def test_rows_floor_and_targets(capsys):
    doc = WORKLOADS["long-doc-qa"]
    block_bytes = prefix._block_bytes()
    recompute = WorkloadRun([_result(5.0, (1, 2)), _result(5.2, (3, 4))], [])
    kvstore = WorkloadRun(
        [_result(0.30, (1, 2), 8192), _result(0.34, (3, 4), 8192)],
        [_result(0.10, (5, 6)), _result(0.12, (7, 8))],
    )
    baseline = [(1, 2), (3, 4)]
    gbps = 10.0
    rows = [
        prefix._row(doc, "recompute", recompute, 0, baseline, gbps),
        prefix._row(doc, "kvstore", kvstore, 2 * 256 * block_bytes, baseline, gbps),
    ]
    assert set(rows[0]) >= JSON_KEYS and set(rows[1]) >= JSON_KEYS
    assert rows[0]["floor_ms"] is None and rows[0]["outputs_identical"]
    assert rows[1]["cached_tokens"] == 2 * 8192
    expected_floor = (8192 // prefix.BLOCK_TOKENS * block_bytes / (gbps * 1e9) + 0.10) * 1000
    assert rows[1]["floor_ms"] == pytest.approx(expected_floor)
    assert rows[1]["ttft_p50_ms"] == pytest.approx(320.0)

    prefix._print_targets(rows)
    out = capsys.readouterr().out
    assert "long-doc kvstore TTFT / recompute" in out and "long-doc kvstore TTFT / floor" in out


def test_different_outputs_are_reported():
    doc = WORKLOADS["long-doc-qa"]
    run = WorkloadRun([_result(0.3, (1, 9))], [])
    row = prefix._row(doc, "local", run, 0, [(1, 2)], 10.0)
    assert row["outputs_identical"] is False


def test_throughput_counts_overlapping_requests_once():
    rnd = WORKLOADS["multi-round-qa"]
    together = [_result(1.0, (1, 2, 3), start_s=10.0), _result(1.5, (4, 5, 6), start_s=10.0)]
    apart = [_result(1.0, (1, 2, 3), start_s=10.0), _result(1.5, (4, 5, 6), start_s=20.0)]
    rows = [
        prefix._row(rnd, "kvstore", WorkloadRun(run, []), 0, [(1, 2, 3), (4, 5, 6)], 10.0)
        for run in (together, apart)
    ]
    assert rows[0]["throughput_tok_s"] == pytest.approx(6 / 1.52)  # the longer one's span
    assert rows[1]["throughput_tok_s"] == pytest.approx(6 / (1.02 + 1.52))
