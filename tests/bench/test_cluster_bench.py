"""`kvstore-bench cluster` over real nodes and a real Redis, small: every field the issue's
JSON names is measured (a number, none NaN), no call errs, a lookup is one Redis round trip;
the failure run measures seconds to miss; the simulation at many nodes runs from the suite;
and a target missed or not measured fails the
suite."""

from __future__ import annotations

import math

from kvstore.bench import cluster
from kvstore.bench.options import SuiteArgs

FIELDS = {
    "nodes", "get_gbps", "put_gbps", "get_p99_ms", "plain_get_gbps", "redis_ops_per_match",
    "redis_ops_per_put", "global_hit_ratio", "local_hit_ratio", "single_node_hit_ratio", "errors",
}  # fmt: skip


def test_a_small_run_measures_every_field():
    extra = {"nodes": "1,2", "chains": 8, "chain_blocks": 4, "block_bytes": 64 << 10}
    rows = cluster.run(SuiteArgs(quick=True, extra=extra))
    assert [row["nodes"] for row in rows] == [1, 2]
    for row in rows:
        assert set(row) >= FIELDS
        assert all(isinstance(row[f], int | float) and not math.isnan(row[f]) for f in FIELDS)
        assert row["errors"] == 0
        assert row["redis_rounds_per_match"] == 1.0
    assert rows[1]["global_hit_ratio"] > rows[1]["local_hit_ratio"]


def test_the_failure_run_measures_seconds_to_miss():
    (row,) = cluster.run(SuiteArgs(extra={"kill": True}))
    assert row["errors"] == 0
    assert 0 < row["seconds_to_miss"] <= 3.0
    assert row["max_call_s"] <= row["read_deadline_s"] + 0.5


def test_the_simulation_runs_from_the_suite_and_sets_no_target():
    rows = cluster.run(SuiteArgs(extra={"simulate": "1,50"}))
    assert [row["nodes"] for row in rows] == [1, 50]
    assert all(row["redis_commands_per_s"] > 0 and row["redis_primaries"] >= 1 for row in rows)
    assert cluster.failures(rows) == []


def test_a_target_missed_or_not_measured_fails_the_suite():
    good = {
        "nodes": 1, "errors": 0, "redis_rounds_per_match": 1.0, "global_hit_ratio": 0.3,
        "local_hit_ratio": 0.3, "single_node_hit_ratio": 0.3, "get_vs_plain": 0.95,
    }  # fmt: skip
    assert cluster.exit_status([good]) == 0
    for name, bad in [
        ("errors", 1),
        ("redis_rounds_per_match", 2.0),
        ("global_hit_ratio", 0.2),
        ("get_vs_plain", 0.5),
        ("get_vs_plain", float("nan")),
    ]:
        assert cluster.exit_status([{**good, name: bad}]) == 1, name
    missing = {k: v for k, v in good.items() if k != "global_hit_ratio"}
    assert cluster.exit_status([missing]) == 1
    killed = {"nodes": 2, "errors": 0, "seconds_to_miss": 1.2, "max_call_s": 0.3}
    assert cluster.exit_status([{**killed, "read_deadline_s": 2.0}]) == 0
    assert cluster.exit_status([{**killed, "read_deadline_s": 2.0, "seconds_to_miss": 4}]) == 1
    assert cluster.exit_status([{**killed, "seconds_to_miss": float("nan")}]) == 1
