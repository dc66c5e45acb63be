"""`kvstore-bench vllm`'s verdict: a missed target and an unmeasured one both fail the run."""

from __future__ import annotations

from kvstore.bench import vllm_targets, vllm_tpot
from kvstore.bench.suites import SUITES


def _doc(system: str, tokens: int, ttft_ms: float, **fields: object) -> dict:
    row = {"workload": "long-doc-qa", "doc_tokens": tokens, "system": system}
    return row | {"ttft_p50_ms": ttft_ms, "outputs_identical": True, "load_vs_get": None} | fields


def _sweep(**kvstore_fields: object) -> list[dict]:
    rows = []
    for tokens in (2048, 8192):
        rows.append(_doc("recompute", tokens, 9000.0))
        rows.append(_doc("lmcache", tokens, 1900.0))
        rows.append(_doc("kvstore", tokens, 170.0, load_vs_get=0.6) | kvstore_fields)
    multi = {"workload": "multi-round-qa", "doc_tokens": None, "system": "kvstore"}
    return [*rows, multi | {"ttft_p50_ms": 50.0, "outputs_identical": True}]


def test_a_sweep_that_holds_every_target_passes():
    assert vllm_targets.failures(_sweep()) == []
    assert SUITES["vllm"].exit_status(_sweep()) == 0


def test_a_slower_ttft_differing_outputs_or_a_slow_load_each_fail():
    slower = vllm_targets.failures(_sweep(ttft_p50_ms=2000.0))
    assert len(slower) == 2 and all("not under lmcache's" in line for line in slower)
    differ = vllm_targets.failures(_sweep(outputs_identical=False))
    assert [line.split(":")[1] for line in differ] == [" outputs differ from recompute's"] * 2
    slow_load = vllm_targets.failures(_sweep(load_vs_get=0.4))
    assert slow_load == ["long-doc-qa 8192 tokens: load_vs_get 0.4 < 0.5"]  # 2,048: no target
    assert SUITES["vllm"].exit_status(_sweep(load_vs_get=0.4)) == 1


def test_a_peer_or_a_figure_that_did_not_run_is_unmeasured_and_fails():
    without_lmcache = [r for r in _sweep() if r["system"] != "lmcache"]
    missing = vllm_targets.failures(without_lmcache)
    assert len(missing) == 2 and all("unmeasured (lmcache did not run)" in m for m in missing)
    assert vllm_targets.failures(_sweep(load_vs_get=None)) == [
        "long-doc-qa 8192 tokens: load_vs_get unmeasured (no load, or no data-plane get)"
    ]
    only_peers = [r for r in _sweep() if r["system"] != "kvstore"]
    assert all("kvstore did not run" in line for line in vllm_targets.failures(only_peers))
    assert vllm_targets.failures([]) == ["long-doc-qa: no rows, nothing measured"]


def test_tpot_rows_are_judged_against_the_null_connector():
    rounds = [{"recompute": 40.0, "null": 30.0, "kvstore": 31.0}] * 3
    row = vllm_tpot.tpot_row(2048, rounds, (96, 0, 0), True)
    assert vllm_targets.failures([row]) == []
    slow = vllm_tpot.tpot_row(2048, [{**rounds[0], "kvstore": 33.0}] * 3, (96, 0, 0), True)
    assert vllm_targets.failures([slow]) == [
        "tpot 2048 tokens: kvstore over the null connector 1.1 > 1.05"
    ]
    idle = vllm_tpot.tpot_row(2048, rounds, (0, 0, 0), True)
    assert vllm_targets.failures([idle]) == [
        "tpot 2048 tokens: kvstore published no block, nothing measured"
    ]


def test_phase_rows_have_no_targets():
    assert vllm_targets.failures([{"doc_tokens": 8192, "mode": "staged", "ttft_ms": 1.0}]) == []
