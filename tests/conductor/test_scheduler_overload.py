"""Mooncake's overload experiment: its arrival rate, its anti-phase measure, its verdict."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvstore.bench import scheduler_overload as overload
from kvstore.bench.__main__ import main
from kvstore.conductor.sim.simulator import LoadSample, TraceRequest
from tests.conductor.test_scheduler_cost_model import UNIT
from tests.conductor.test_scheduler_simulator import _trace, write_trace


def test_the_speedup_gives_the_papers_arrival_rate() -> None:
    # 11 requests over 10 s: 1.1 a second; the paper's is 2 x 23,608 an hour.
    requests = [TraceRequest(1000.0 * k, 10, 2, (k,)) for k in range(11)]
    assert overload.paper_speedup(requests) == pytest.approx(2 * 23_608 / 3600 / 1.1)
    with pytest.raises(SystemExit):
        overload.paper_speedup(requests[:1])


def test_anti_phase_is_the_correlation_of_the_mean_loads() -> None:
    swing = [LoadSample(t, (t % 2, t % 2), (1 - t % 2,)) for t in range(6)]
    assert overload.anti_phase(swing) == pytest.approx(-1.0)
    together = [LoadSample(t, (t % 2,), (t % 2,)) for t in range(6)]
    assert overload.anti_phase(together) == pytest.approx(1.0)
    assert math.isnan(overload.anti_phase([LoadSample(t, (0.5,), (t,)) for t in range(3)]))


def _row(shape: str, policy: str, rejected: int, waste: float, goodput: float) -> dict:
    return {
        "shape": shape,
        "admission": "x",
        "policy": policy,
        "rejected": rejected,
        "wasted_prefill_gpu_s": waste,
        "goodput_rps": goodput,
    }


def test_prediction_must_not_do_worse_than_the_current_load() -> None:
    good = [
        _row(shape, policy, r, w, g)
        for shape in ("8P+8D", "8P+2D")
        for policy, r, w, g in ((overload.CURRENT, 10, 5.0, 1.0), (overload.OURS, 9, 5.0, 1.0))
    ]
    assert overload.failures(good) == [] and overload.exit_status(good) == 0
    worse = [*good[:3], _row("8P+2D", overload.OURS, 11, 6.0, 0.5)]
    assert len(overload.failures(worse)) == 3 and overload.exit_status(worse) == 1
    assert overload.failures(good[:2]) == [
        "unmeasured: 8P+2D lacks cache-aware-reject or cache-aware-predictive"
    ]


def test_cli_runs_the_three_admissions_at_both_shapes(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", _trace(80))
    profile = tmp_path / "unit.json"
    UNIT.save(profile)
    out, png = tmp_path / "rows.json", tmp_path / "overload.png"
    argv = ["scheduler", "--overload", "--trace", str(trace), "--profile", str(profile)]
    main([*argv, "--json", str(out), "--plot", str(png), "--no-targets"])
    rows = json.loads(out.read_text())
    assert [(r["shape"], r["policy"]) for r in rows] == [
        (f"{p}P+{d}D", policy) for p, d in overload.SHAPES for _, policy in overload.ADMISSIONS
    ]
    for r in rows:
        assert r["rejected"] == r["rejected_early"] + r["rejected_late"]
        assert r["speedup"] == pytest.approx(overload.paper_speedup(_trace(80)))
    no_early = [r for r in rows if r["policy"] == "cache-aware-ttft"]
    assert all(r["decisions_changed"] is None for r in no_early)
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="--overload"):
        main([*argv, "--speedup", "2"])
