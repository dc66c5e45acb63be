"""A target that could not be measured is a miss, never a pass: the suites' verdicts (the
scheduler's targets, the prefix suite's; the data plane's are in tests/dataplane) and the
shared exit status."""

from __future__ import annotations

import math

import pytest

from kvstore.bench import prefix, scheduler_targets, verdict
from kvstore.bench.scheduler_targets import ANCHOR, CURRENT, OURS


def test_the_exit_status_lists_each_failure_on_stderr(capsys: pytest.CaptureFixture) -> None:
    assert verdict.exit_status([]) == 0
    assert verdict.exit_status(["x: unmeasured", "y: 0.5 (at least 1)"]) == 1
    err = capsys.readouterr().err
    assert "target missed x: unmeasured" in err and "target missed y" in err


def _sched(policy: str, attainment: float, goodput: float) -> dict:
    return {
        "policy": policy,
        "speedup": 2.0,
        "slo_attainment": attainment,
        "goodput_rps": goodput,
        "wasted_prefill_tokens": 0,
        "decode_load_std": 1.0 if policy == CURRENT else 0.5,
        "accepted_slo_attainment": 0.99,
    }


def test_scheduler_targets_missing_rows_or_no_overload_are_unmeasured() -> None:
    met = [_sched(ANCHOR, 0.5, 1.0), _sched(OURS, 0.9, 2.0), _sched(CURRENT, 0.6, 1.5)]
    assert scheduler_targets.failures(met) == []
    assert scheduler_targets.failures(met[1:]) == [f"unmeasured: no rows of {ANCHOR}"]
    assert scheduler_targets.failures(met[:1]) == [f"unmeasured: no rows of {OURS}"]
    calm = [_sched(ANCHOR, 0.95, 1.0), *met[1:]]  # prefix-rr is not overloaded anywhere
    assert scheduler_targets.failures(calm) == [
        "unmeasured: no speedup of this run overloads prefix-rr"
    ]
    assert scheduler_targets.exit_status(calm) == 1


def _prefix(workload: str, mode: str, ttft: float, tpot: float = 1.0, floor: float = 0.0) -> dict:
    return {
        "workload": workload,
        "mode": mode,
        "ttft_p50_ms": ttft,
        "tpot_p50_ms": tpot,
        "floor_ms": floor or None,
    }


def test_prefix_targets_of_a_workload_that_ran_are_missed_where_unmeasured() -> None:
    rows = [
        _prefix("long-doc-qa", "kvstore", 5.0, floor=4.0),
        _prefix("long-doc-qa", "recompute", 100.0),
    ]
    assert prefix.failures(rows) == []  # multi-round-qa did not run: none of its targets
    assert prefix.exit_status(rows) == 0
    no_recompute = rows[:1]  # the recompute mode failed: its ratios cannot be computed
    lines = {line["target"]: line for line in prefix._target_rows(no_recompute)}
    assert math.isnan(lines["long-doc kvstore TTFT / recompute"]["ratio"])
    assert not lines["long-doc kvstore TTFT / recompute"]["met"]
    assert lines["long-doc kvstore TTFT / floor"]["met"]  # measured: 1.25 <= 2
    assert prefix.failures(no_recompute) == [
        "long-doc kvstore TTFT / recompute: unmeasured (at most 0.1)",
        "long-doc-qa kvstore TPOT / recompute: unmeasured (at most 1.1)",
    ]
    assert prefix.exit_status(no_recompute) == 1
    slow = [_prefix("long-doc-qa", "kvstore", 50.0, floor=4.0), rows[1]]
    assert prefix.failures(slow)[0].startswith("long-doc kvstore TTFT / recompute: 0.5 ")
