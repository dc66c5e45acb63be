"""The robustness matrix: its speedup rule, its summary ratios and its verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.bench import scheduler_matrix as matrix
from kvstore.bench.__main__ import main
from kvstore.bench.scheduler_targets import OVERLOAD_ATTAINMENT
from tests.conductor.test_scheduler_cost_model import UNIT
from tests.conductor.test_scheduler_simulator import _trace, write_trace


def _cell(speedup: float, policy: str, goodput: float, wasted: int = 0, std: float = 0.1) -> dict:
    return {
        "trace": "t",
        "shape": "8P+1D",
        "speedup": speedup,
        "policy": policy,
        "goodput_rps": goodput,
        "wasted_prefill_tokens": wasted,
        "accepted_slo_attainment": 0.97 if policy == matrix.OURS else 0.5,
        "decode_load_std": std,
        "rejected_late": wasted // 5,
        "wasted_prefill_gpu_s": wasted / 10,
        "decisions_changed": 3 if policy == matrix.OURS else None,
        "placed_elsewhere": 1 if policy == matrix.OURS else None,
        "decode_load_mean": 0.9,
        "prefill_load_mean": 0.5,
    }


ROWS = [
    _cell(2.0, matrix.OURS, 10.0, wasted=5, std=0.05),
    _cell(2.0, matrix.CURRENT, 8.0, wasted=20, std=0.1),
    _cell(2.0, "prefix-rr", 4.0, wasted=100),
    _cell(4.0, matrix.OURS, 12.0, wasted=0, std=0.08),
    _cell(4.0, matrix.CURRENT, 9.0, wasted=20, std=0.1),
    _cell(4.0, "prefix-rr", 15.0, wasted=100),
]


def test_summary_puts_ours_over_the_best_rival_at_the_worst_speedup() -> None:
    (row,) = matrix.summarize(ROWS)
    assert row["speedups"] == "2 4"
    assert row["goodput_vs_best_other"] == pytest.approx(12.0 / 15.0)
    assert (row["at_speedup"], row["best_other"]) == (4.0, "prefix-rr")
    assert row["waste_vs_reject"] == pytest.approx(5 / 40)  # summed over the speedups
    assert row["std_vs_reject"] == pytest.approx(0.8)  # the worse of 0.5 and 0.8
    assert row["min_accepted_attainment"] == 0.97
    assert row["cells_lost"] == 1
    assert (row["late_rejected"], row["late_rejected_reject"]) == (1, 8)
    assert (row["decisions_changed"], row["placed_elsewhere"]) == (6, 2)


def test_a_lost_cell_fails_the_run() -> None:
    assert matrix.failures(ROWS) == ["t 8P+1D 4x: prefix-rr 15 > cache-aware-predictive 12"]
    assert matrix.exit_status(ROWS) == 1
    assert matrix.exit_status(ROWS[:3]) == 0
    assert matrix.is_matrix(ROWS) and not matrix.is_matrix([{"policy": "x"}])


def test_ratios_of_nothing_wasted() -> None:
    assert matrix._ratio(0.0, 0.0) == 1.0
    assert matrix._ratio(3.0, 0.0) is None
    assert matrix._ratio(3.0, 6.0) == 0.5


def test_where_decode_binds_prediction_must_beat_the_current_batch() -> None:
    def cells(ours_goodput: float, ours_waste: int, ours_std: float) -> list[dict]:
        rows = [
            _cell(2.0, matrix.OURS, ours_goodput, wasted=ours_waste, std=ours_std),
            _cell(2.0, matrix.CURRENT, 8.0, wasted=20, std=0.1),
        ]
        # The same cell where prefill binds (as measured, whatever its shape): a tie is fine.
        return rows + [{**r, "shape": "8P+8D", "prefill_load_mean": 1.0} for r in rows]

    assert matrix.failures(cells(9.0, 5, 0.05)) == []
    assert matrix.failures(cells(8.0, 5, 0.05)) == [  # a tie is not a win here...
        "t 8P+1D 2x: goodput 8 not above cache-aware-reject's 8 where decode binds"
    ]
    assert matrix.failures(cells(9.0, 20, 0.2)) == [  # ...nor equal waste, nor more swing
        "t 8P+1D 2x: wasted prefill 2 GPU-s not under cache-aware-reject's 2 where decode binds",
        "t 8P+1D 2x: decode-load std 0.2 not under cache-aware-reject's 0.1 where decode binds",
    ]


@pytest.fixture
def small(tmp_path: Path) -> tuple[dict[str, object], list[matrix.TraceSpec]]:
    trace = write_trace(tmp_path / "t.jsonl", _trace(120))
    profile = tmp_path / "unit.json"
    UNIT.save(profile)
    settings = {"trace": trace, "ttft_slo_s": 2.0, "tbt_slo_ms": 50.0, "profile": str(profile)}
    settings["seed"] = 0
    return settings, [matrix.TraceSpec("small", str(trace))]


def test_speedups_start_where_prefix_rr_falls_under_90_percent(small) -> None:
    settings, traces = small
    rows = matrix.run_matrix(settings, quick=False, workers=1, traces=traces, shapes=[(2, 1)])
    speedups = sorted({float(r["speedup"]) for r in rows})  # type: ignore[arg-type]
    onset = speedups[0]
    assert speedups == [onset, 2 * onset, 4 * onset] and onset in matrix.LADDER
    assert len(rows) == 3 * len(matrix.POLICIES)
    cell = matrix.Cell(traces[0], 2, 1, onset, "prefix-rr")
    assert matrix.simulate_cell(cell, settings).summary.slo_attainment < OVERLOAD_ATTAINMENT
    if onset > matrix.LADDER[0]:
        below = cell._replace(speedup=onset / 2)
        attainment = matrix.simulate_cell(below, settings).summary.slo_attainment
        assert attainment >= OVERLOAD_ATTAINMENT


def test_processes_give_the_same_rows(small) -> None:
    settings, traces = small
    one = matrix.run_matrix(settings, quick=True, workers=1, traces=traces, shapes=[(2, 1)])
    two = matrix.run_matrix(settings, quick=True, workers=2, traces=traces, shapes=[(2, 1)])
    assert one == two and len(one) == len(matrix.QUICK_STEPS) * len(matrix.POLICIES)


def test_matrix_chooses_its_own_speedups() -> None:
    with pytest.raises(SystemExit, match="--matrix"):
        main(["scheduler", "--matrix", "--speedup", "2"])
