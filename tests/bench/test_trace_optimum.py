"""`kvstore-bench trace --optimum` and `--cost`: every policy as a fraction of the offline
optimum on every family, and each policy's time per operation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.bench import policy_cost, trace_ablation
from kvstore.bench.__main__ import main
from kvstore.bench.trace_file import REAL_TRACE, hit_ratio, load_trace
from kvstore.bench.trace_optimum import run_optimum
from kvstore.bench.trace_sim import simulate_belady, simulate_policy
from kvstore.store.eviction import POLICIES
from tests.bench.test_trace_ablation import _tiny_traces, tiny_trace_file


def test_every_policy_at_every_fraction_of_every_family_against_the_optimum() -> None:
    rows = run_optimum(Path("unused"), "tokens", True, 1, make_traces=_tiny_traces)
    fractions = trace_ablation.QUICK_FRACTIONS
    assert [(r["family"], r["fraction"], r["policy"]) for r in rows] == [
        (family, f, policy)
        for family in ("conversation", "agent")
        for f in fractions
        for policy in POLICIES
    ]
    for row in rows:
        assert row["traces"] == 2
        assert 0 < row["min_of_optimum"] <= row["of_optimum"] <= 1 + 1e-9
        assert 0 < row["lru_of_optimum"] <= 1 + 1e-9
        assert row["hit_ratio"] <= row["optimum_hit_ratio"]
    # The first trace's figures are the simulator's own.
    first = _tiny_traces(Path("unused"), True)[0].requests
    row = rows[len(POLICIES) - 1]  # conversation, the first fraction, the last policy
    capacity, policy = int(row["blocks"]), str(row["policy"])
    assert row["hit_ratio"] == hit_ratio(first, simulate_policy(first, capacity, policy), "tokens")
    assert row["optimum_hit_ratio"] == hit_ratio(first, simulate_belady(first, capacity), "tokens")


def test_the_real_trace_ships_with_the_bench_and_is_its_own_family() -> None:
    requests = load_trace(REAL_TRACE)
    assert len(requests) == 6015
    families = trace_ablation.traces(REAL_TRACE, quick=True)
    assert [t.family for t in families[:6]] == ["shared"] * 3 + ["real"] * 3


def test_cli_writes_the_optimum_rows(tmp_path: Path) -> None:
    trace = tiny_trace_file(tmp_path, 40, 5)
    out = tmp_path / "optimum.json"
    argv = ["trace", "--optimum", "--quick", "--workers", "1", "--trace", str(trace)]
    assert main([*argv, "--real-trace", str(trace), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["family"] for r in rows} == {"shared", "real", "conversation", "agent"}
    assert {r["policy"] for r in rows} == set(POLICIES)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_cost_rows_time_every_operation(policy: str) -> None:
    row = policy_cost.measure(policy, num_blocks=2_000)
    assert row["policy"] == policy and row["blocks"] == 2_000
    for field in ("insert_us", "touch_us_per_key", "victim_us", "evict_and_insert_us"):
        assert float(row[field]) > 0  # type: ignore[arg-type]
