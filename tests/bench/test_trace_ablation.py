"""`kvstore-bench trace --ablation`: the keep rule, the rows, and the guarantee it protects
(prefix-2q is no worse than LRU on generated multi-turn traces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.bench import trace_ablation
from kvstore.bench.__main__ import main
from kvstore.bench.trace_ablation import Trace, is_worth_keeping, run_ablation
from kvstore.bench.trace_file import hit_ratio
from kvstore.bench.trace_gen import generate
from kvstore.bench.trace_sim import simulate_lru, simulate_policy


@pytest.mark.parametrize(
    ("by_family", "keep"),
    [
        ({"a": [1.02, 1.01], "b": [1.02], "c": [1.0]}, True),  # 1% on two families
        ({"a": [1.05, 1.05], "b": [1.0], "c": [1.0]}, False),  # on one family only
        ({"a": [1.05, 0.95], "b": [1.05], "c": [0.97]}, False),  # costs c 3%
        ({"a": [1.06, 0.97], "b": [1.05], "c": [0.98]}, True),  # 2% at most, a family's mean
        ({"a": [1.0], "b": [1.0], "c": [1.0]}, False),
        ({"real": [1.0], "b": [1.05], "c": [1.05]}, False),  # gains, but not on real traffic
        ({"real": [1.03, 1.0], "b": [1.05], "c": [0.99]}, True),
    ],
)
def test_a_mechanism_is_kept_for_gains_on_two_families_and_no_loss(
    by_family: dict[str, list[float]], keep: bool
) -> None:
    assert is_worth_keeping(by_family) is keep


def _tiny_traces(shared: Path, quick: bool) -> list[Trace]:
    return [
        Trace(kind, f"{kind} seed {seed}", generate(kind, 12, seed=seed))
        for kind in ("conversation", "agent")
        for seed in (0, 1)
    ]


def test_rows_per_mechanism_and_family() -> None:
    rows = run_ablation(Path("unused"), "tokens", True, 1, make_traces=_tiny_traces)
    variants = trace_ablation.variants()
    assert [(r["mechanism"], r["family"]) for r in rows] == [
        (v, f) for v in variants for f in ("conversation", "agent")
    ]
    for row in rows:
        assert row["runs"] == 2 * len(trace_ablation.QUICK_FRACTIONS)
        assert 0 < float(row["min_ratio"]) <= float(row["geomean_ratio"])  # type: ignore[arg-type]
        assert isinstance(row["keep"], bool) and " @ " in str(row["min_at"])
    # One verdict per mechanism, the same in each of its rows.
    assert all(len({r["keep"] for r in rows if r["mechanism"] == v}) == 1 for v in variants)


def test_ratios_do_not_depend_on_the_number_of_workers() -> None:
    one = run_ablation(Path("unused"), "tokens", True, 1, make_traces=_tiny_traces)
    two = run_ablation(Path("unused"), "tokens", True, 2, make_traces=_tiny_traces)
    assert one == two


def tiny_trace_file(tmp_path: Path, num_requests: int, num_tails: int) -> Path:
    """A trace file of `num_requests` three-block requests over `num_tails` last blocks."""
    trace = tmp_path / "tiny.jsonl"
    lines = [
        {"timestamp": i, "input_length": 1536, "output_length": 1, "hash_ids": ids}
        for i, ids in enumerate([1, 2, 3 + j % num_tails] for j in range(num_requests))
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return trace


def test_cli_writes_the_table_rows_and_draws_no_plot(tmp_path: Path) -> None:
    trace = tiny_trace_file(tmp_path, 30, 3)
    out, png = tmp_path / "ablation.json", tmp_path / "ablation.png"
    argv = ["trace", "--ablation", "--quick", "--workers", "1", "--trace", str(trace)]
    argv += ["--real-trace", str(trace)]
    with pytest.raises(SystemExit, match="--ablation"):  # the rows are written first
        main([*argv, "--json", str(out), "--plot", str(png)])
    rows = json.loads(out.read_text())
    assert {r["family"] for r in rows} == {"shared", "real", "conversation", "agent"}
    assert {r["mechanism"] for r in rows} == set(trace_ablation.variants())
    assert not png.exists()


@pytest.mark.parametrize(
    ("kind", "capacities"), [("conversation", (1500, 3000)), ("agent", (600,))]
)
def test_prefix_2q_within_the_keep_bar_of_lru_on_generated_multi_turn_traces(
    kind: str, capacities: tuple[int, ...]
) -> None:
    """Traces the ablation never saw (600 sessions): 2Q loses at most what the keep rule
    allows (1%) where LRU is already good, as on the ablation's own traces."""
    requests = generate(kind, 600, seed=0)
    for capacity in capacities:
        lru = hit_ratio(requests, simulate_lru(requests, capacity), "tokens")
        ours = hit_ratio(requests, simulate_policy(requests, capacity, "prefix-2q"), "tokens")
        assert ours >= trace_ablation.KEEP_LOSS * lru, (kind, capacity)
