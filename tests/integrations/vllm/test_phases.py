"""The connector's phase timers and the rows `kvstore-bench vllm` makes of them, without vLLM."""

from __future__ import annotations

import mmap

import pytest

from kvstore.bench.vllm import block_bytes, dataplane_get_gbps
from kvstore.bench.vllm_engine import minor_faults
from kvstore.bench.vllm_phases import parse_phases, phase_rows
from kvstore.bench.vllm_rows import kv_bytes_per_token, row
from kvstore.errors import InvalidArgumentError
from kvstore.integrations.load_phases import PhaseClock, PhaseTotals
from kvstore.integrations.vllm.config import ConnectorConfig


def _clock(*times: float) -> PhaseClock:
    ticks = iter(times)
    return PhaseClock(clock=lambda: next(ticks))


def test_laps_add_up_per_phase_and_skipped_time_counts_nowhere():
    clock = _clock(0.0, 0.5, 1.5, 2.0, 4.0, 4.25)
    clock.lap("connect")  # 0.5
    clock.lap("transfer")  # 1.0
    clock.skip()  # 0.5 of nothing
    clock.lap("transfer")  # 2.0
    clock.lap("scatter")  # 0.25
    phases = clock.done(num_blocks=4, num_bytes=13_000_000_000)
    assert phases.seconds == {"connect": 0.5, "transfer": 3.0, "scatter": 0.25}
    assert phases.total_s == 3.75
    assert phases.log_fields() == (
        "connect_ms=500.00 transfer_ms=3000.00 scatter_ms=250.00 total_ms=3750.00 "
        "blocks=4 bytes=13000000000 gbps=3.467"
    )


def test_totals_sum_loads():
    totals = PhaseTotals()
    totals.add(_lapped("transfer", 1.0, 2, 10))
    totals.add(_lapped("transfer", 0.5, 3, 5))
    assert (totals.num_loads, totals.num_blocks, totals.num_bytes) == (2, 5, 15)
    assert dict(totals.items()) == {"transfer": 1.5}
    assert totals.log_fields().startswith("loads=2 transfer_ms=1500.00 total_ms=1500.00 blocks=5")


def _lapped(name: str, seconds: float, num_blocks: int, num_bytes: int):
    clock = _clock(0.0, seconds)
    clock.lap(name)
    return clock.done(num_blocks, num_bytes)


def test_config_reads_load_buffers_load_by_layer_share_pages_and_log_level():
    extra = {"kvstore.load_buffers": "8", "kvstore.log_level": "debug"}
    extra |= {"kvstore.load_by_layer": "0", "kvstore.share_pages": "false"}
    config = ConnectorConfig.from_extra_config(extra)
    assert (config.load_buffers, config.log_level) == (8, "debug")
    assert (config.load_by_layer, config.share_pages) == (False, False)
    default = ConnectorConfig()
    assert (default.load_buffers, default.load_by_layer, default.share_pages) == (128, True, True)
    for bad in ({"kvstore.load_buffers": "3"}, {"kvstore.load_buffers": "0"}):
        with pytest.raises(InvalidArgumentError, match="load_buffers"):
            ConnectorConfig.from_extra_config(bad)
    with pytest.raises(InvalidArgumentError, match="log_level"):
        ConnectorConfig(log_level="chatty")


LOG = """\
INFO event=kv_caches_registered layers=8
DEBUG event=match_phases req=s0t0-1f2e keys_ms=1.50 match_ms=2.50 total_ms=4.00 \
blocks=4 bytes=0 gbps=0
DEBUG event=load_phases req=s0t0 mode=staged connect_ms=0.01 submit_ms=0.20 transfer_ms=30.00 \
scatter_ms=9.79 total_ms=40.00 blocks=4 bytes=40000000 gbps=1.000
DEBUG event=match_phases req=s1t0 keys_ms=0.50 match_ms=1.50 total_ms=2.00 blocks=4 bytes=0 gbps=0
DEBUG event=load_phases req=s1t0 mode=by_layer connect_ms=0.00 submit_ms=0.10 wait_ms=4.90 \
transfer_ms=15.00 total_ms=20.00 blocks=4 bytes=40000000 gbps=2.000
DEBUG event=match_phases req=s2t0 keys_ms=0.50 match_ms=0.00 total_ms=0.50 blocks=0 bytes=0 gbps=0
"""


def test_phase_lines_are_parsed_in_log_order():
    loads = parse_phases(LOG, "load_phases")
    assert {req: load["transfer"] for req, load in loads.items()} == {"s0t0": 30.0, "s1t0": 15.0}
    assert loads["s0t0"]["bytes"] == 40_000_000.0
    assert set(parse_phases(LOG, "match_phases")) == {"s0t0", "s1t0", "s2t0"}


def test_phase_rows_account_for_each_request_and_its_bandwidths():
    records = [
        {"session": 0, "turn": 0, "ttft_s": 0.100, "cached_tokens": 128, "minor_faults": 900},
        {"session": 1, "turn": 0, "ttft_s": 0.070, "cached_tokens": 128, "minor_faults": 30},
        {"session": 2, "turn": 0, "ttft_s": 0.050, "cached_tokens": 128},  # vLLM's own cache
    ]
    first, later, own = phase_rows(records, LOG, 160)
    assert first["transfer_ms"] == 30.0 and first["sched_match_ms"] == 2.5
    assert first["rest_ms"] == 56.0  # 100 - 40 (load) - 4 (scheduler side)
    assert first["load_gbps"] == 1.0
    assert first["effective_gbps"] == 0.8  # 40 MB over 100 - 50 ms
    assert later["effective_gbps"] == 2.0
    assert (later["wait_ms"], later["scatter_ms"]) == (4.9, 0.0)  # by layer: no scatter
    assert (own["load_mib"], own["effective_gbps"]) == (0.0, None)
    assert (first["minor_faults"], later["minor_faults"], own["minor_faults"]) == (900, 30, None)


def test_minor_faults_count_first_touches_of_fresh_memory_once():
    pages = 1024
    fresh = mmap.mmap(-1, pages * mmap.PAGESIZE)
    fresh.madvise(mmap.MADV_NOHUGEPAGE)  # a fault per 4 KiB page, not per 2 MiB
    before = minor_faults()
    for page in range(pages):
        fresh[page * mmap.PAGESIZE] = 1
    first = minor_faults() - before
    for page in range(pages):
        fresh[page * mmap.PAGESIZE] = 2
    again = minor_faults() - before - first
    assert first >= pages
    assert again < pages // 10


def test_rows_report_doc_tokens_and_the_load_bandwidth_over_vllms_own_cache():
    per_token = kv_bytes_per_token("tiny")
    assert per_token == 2 * 2 * 2 * 32 * 4  # layers, K and V, kv heads, head dim, fp32
    asks = [
        {"ttft_s": 0.30, "tpot_s": 0.01, "cached_tokens": 1000, "output": [1]},
        {"ttft_s": 0.20, "tpot_s": 0.01, "cached_tokens": 1000, "output": [2]},
    ]
    repeats = [
        {"ttft_s": 0.10, "tpot_s": 0.01, "cached_tokens": 1024, "output": [1]},
        {"ttft_s": 0.10, "tpot_s": 0.01, "cached_tokens": 1024, "output": [2]},
    ]
    got = row("long-doc-qa/1024", "kvstore", asks + repeats, asks + repeats, "tiny")
    assert (got["workload"], got["doc_tokens"], got["system"]) == ("long-doc-qa", 1024, "kvstore")
    assert (got["ttft_p50_ms"], got["first_ttft_ms"], got["own_cache_ttft_ms"]) == (
        250.0,
        300.0,
        100.0,
    )
    assert got["cached_tokens"] == 2000
    rates = sorted(1000 * per_token / s / 1e9 for s in (0.2, 0.1))
    assert got["load_gbps"] == round(sum(rates) / 2, 3)
    assert got["outputs_identical"] is True
    assert (got["dataplane_get_gbps"], got["load_vs_get"]) == (None, None)
    rounds = row("multi-round-qa", "recompute", asks, None, "tiny")
    assert (rounds["doc_tokens"], rounds["load_gbps"]) == (None, None)


def test_the_load_bandwidth_is_compared_with_the_data_planes_get_of_the_same_blocks(store):
    """The kvstore row carries the data plane's get bandwidth of store blocks of the
    model's size, measured on the node, and the effective load bandwidth over it."""
    assert block_bytes("bench") == 16 * 1024 * 32  # 16 KiB a token, 32-token blocks
    assert dataplane_get_gbps(store.address, 64 << 10) > 0
    asks = [{"ttft_s": 0.2, "tpot_s": 0.01, "cached_tokens": 1000, "output": [1]}]
    repeats = [{"ttft_s": 0.1, "tpot_s": 0.01, "cached_tokens": 1024, "output": [1]}]
    load_gbps = round(1000 * kv_bytes_per_token("tiny") / 0.1 / 1e9, 3)
    got = row("long-doc-qa/1024", "kvstore", asks + repeats, None, "tiny", 4 * load_gbps)
    assert (got["load_gbps"], got["dataplane_get_gbps"]) == (load_gbps, 4 * load_gbps)
    assert got["load_vs_get"] == 0.25
