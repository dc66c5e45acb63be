"""The `trace` suite: trace parsing, reference simulations, store replay and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.bench import trace_sim
from kvstore.bench.__main__ import main
from kvstore.bench.trace import SWEEP_FRACTIONS, sweep_capacities
from kvstore.bench.trace_file import DEFAULT_TRACE, TraceLine, hit_ratio, load_trace
from kvstore.bench.trace_replay import ReplayConfig, replay
from kvstore.store.eviction import POLICIES
from tests.conftest import require_extra

TINY = [
    {"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 5, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 4]},
    {"timestamp": 9, "input_length": 600, "output_length": 1, "hash_ids": [1, 5]},
    {"timestamp": 12, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
]
TOTAL_TOKENS = 1300 + 1100 + 600 + 1536
needs_trace = pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="shared trace absent")


@pytest.fixture
def tiny_path(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(obj) + "\n" for obj in TINY) + "\n")
    return path


@pytest.fixture
def tiny(tiny_path: Path) -> list[TraceLine]:
    return load_trace(tiny_path)


def test_load_trace(tiny: list[TraceLine], tiny_path: Path) -> None:
    assert tiny[1] == TraceLine(5, 1100, 1, (1, 2, 4))
    assert load_trace(tiny_path, limit=2) == tiny[:2]


def test_bad_line_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match="hash_ids"):
        load_trace(path)


def test_weightings(tiny: list[TraceLine]) -> None:
    num_hit = trace_sim.simulate_unbounded(tiny)
    assert num_hit == [0, 2, 1, 3]
    assert hit_ratio(tiny, num_hit, "tokens") == (1024 + 512 + 1536) / TOTAL_TOKENS
    assert hit_ratio(tiny, num_hit, "blocks") == 6 / 11


def test_reference_lru_and_belady_exact(tiny: list[TraceLine]) -> None:
    assert trace_sim.simulate_lru(tiny, 3) == [0, 2, 1, 1]
    assert trace_sim.simulate_lru(tiny, 2) == [0, 0, 0, 1]
    assert trace_sim.simulate_belady(tiny, 3) == [0, 2, 1, 3]
    assert trace_sim.simulate_belady(tiny, 2) == [0, 2, 1, 2]  # never admits 3, 4 or 5


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("capacity", [3, 4, 5])
def test_store_replay_equals_policy_simulation(
    tiny: list[TraceLine], policy: str, capacity: int
) -> None:
    result = replay(tiny, ReplayConfig(capacity, policy=policy))
    assert result.num_hit == trace_sim.simulate_policy(tiny, capacity, policy)
    assert result.tier_hits.get("dram", 0) == sum(result.num_hit)


@needs_trace
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_store_replay_equals_simulation_on_trace_prefix(policy: str) -> None:
    requests = load_trace(DEFAULT_TRACE, limit=400)
    result = replay(requests, ReplayConfig(300, policy=policy, block_bytes=128))
    assert result.num_hit == trace_sim.simulate_policy(requests, 300, policy)


@needs_trace
def test_reference_table_of_traces_readme() -> None:
    """LRU and Belady as in traces/README.md, to 3 decimals, weighting every block 512."""
    requests = load_trace(DEFAULT_TRACE)
    expected = {2000: (0.144, 0.380), 5000: (0.279, 0.526), 10000: (0.423, 0.618)}
    expected[20000] = (0.571, 0.640)
    for capacity, (lru, belady) in expected.items():
        got_lru = hit_ratio(requests, trace_sim.simulate_lru(requests, capacity), "blocks")
        got_belady = hit_ratio(requests, trace_sim.simulate_belady(requests, capacity), "blocks")
        assert (round(got_lru, 3), round(got_belady, 3)) == (lru, belady), capacity
    unbounded = hit_ratio(requests, trace_sim.simulate_unbounded(requests), "blocks")
    assert round(unbounded, 3) == 0.640


def test_slabs_hold_exactly_the_blocks() -> None:
    assert ReplayConfig(5000).slab_blocks == 1000
    assert ReplayConfig(4999).slab_blocks == 1  # a prime: one block a slab
    with pytest.raises(ValueError, match="multiple of 64"):
        ReplayConfig(10, block_bytes=100)


def test_cli_rows(tiny_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    argv = ["trace", "--trace", str(tiny_path), "--dram-blocks", "3", "--json", str(out)]
    assert main([*argv, "--weighting", "tokens"]) == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == sorted(POLICIES, key=list(POLICIES).index)
    for row in rows:
        assert (row["requests"], row["dram_blocks"], row["ssd_blocks"]) == (4, 3, 0)
        assert row["lru_hit_ratio"] == (1024 + 512 + 512) / TOTAL_TOKENS
        assert row["belady_hit_ratio"] == (1024 + 512 + 1536) / TOTAL_TOKENS
        assert row["unbounded_hit_ratio"] == (1024 + 512 + 1536) / TOTAL_TOKENS
        assert row["ratio_to_belady"] == row["hit_ratio"] / row["belady_hit_ratio"]
        assert set(row["tier_hits"]) == {"dram"}


def test_cli_with_ssd_tier(tiny_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    argv = ["trace", "--trace", str(tiny_path), "--dram-blocks", "3", "--ssd-blocks", "8"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    # 11 blocks hold the whole trace when every DRAM victim is demoted...
    assert rows["lru"]["hit_ratio"] == rows["lru"]["unbounded_hit_ratio"]
    assert rows["prefix-lru"]["hit_ratio"] == rows["prefix-lru"]["unbounded_hit_ratio"]
    # ...and for prefix-2q, which demotes every victim too: it writes what prefix-lru does.
    assert rows["prefix-2q"]["hit_ratio"] == rows["prefix-2q"]["unbounded_hit_ratio"]
    assert [rows[p]["tier_bytes_written"]["ssd"] for p in rows] == [256, 192, 192]  # 64 B a block
    assert [rows[p]["tier_hits"] for p in rows] == [
        {"dram": 4, "ssd": 2},
        {"dram": 5, "ssd": 1},
        {"dram": 5, "ssd": 1},  # 3, back from SSD
    ]


def test_request_longer_than_dram_is_refused(tiny_path: Path) -> None:
    with pytest.raises(SystemExit, match="longest request has 3 blocks"):
        main(["trace", "--trace", str(tiny_path), "--dram-blocks", "2"])


def test_cli_plot_writes_png(tiny_path: Path, tmp_path: Path) -> None:
    require_extra("matplotlib")
    out = tmp_path / "trace.png"
    argv = ["trace", "--quick", "--trace", str(tiny_path), "--policy", "lru", "--plot", str(out)]
    assert main(argv) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_capacities_scale_with_the_trace(tiny: list[TraceLine]) -> None:
    assert sweep_capacities(tiny, SWEEP_FRACTIONS) == [3, 4]  # 5 distinct; longest is 3
    requests = [TraceLine(0, 512, 1, tuple(range(i, i + 10))) for i in range(0, 1000, 10)]
    assert sweep_capacities(requests, SWEEP_FRACTIONS) == [10, 20, 50, 100, 200, 450, 700]


def test_ids_under_another_prefix_become_distinct_blocks(tmp_path: Path) -> None:
    path = tmp_path / "odd.jsonl"
    lines = [[1, 2, 1], [3, 1, 2], [1, 2, 1], [2]]
    path.write_text("".join(json.dumps({**TINY[0], "hash_ids": ids}) + "\n" for ids in lines))
    requests = load_trace(path)
    # 1 and 2 keep their ids where first seen (a root, then after 1); elsewhere they are
    # other blocks: 1 after 2, 1 after 3, 2 after that 1, and 2 as a root.
    assert [r.hash_ids for r in requests] == [(1, 2, 4), (3, 5, 6), (1, 2, 4), (7,)]
    assert trace_sim.simulate_unbounded(requests) == [0, 0, 3, 0]
    out = tmp_path / "odd.json"
    assert main(["trace", "--trace", str(path), "--dram-blocks", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {row["hit_ratio"] for row in rows} == {row["unbounded_hit_ratio"] for row in rows}
    assert rows[0]["hit_ratio"] == 1300 / (4 * 1300)  # all of request 2's 1,300 tokens


def test_chained_ids_are_unchanged(tiny: list[TraceLine]) -> None:
    assert [list(r.hash_ids) for r in tiny] == [r["hash_ids"] for r in TINY]
    if DEFAULT_TRACE.exists():
        requests = load_trace(DEFAULT_TRACE, limit=500)
        raw = [json.loads(line)["hash_ids"] for line in DEFAULT_TRACE.open()][:500]
        assert [list(r.hash_ids) for r in requests] == raw


def test_unreadable_traces_are_refused_with_the_line(tmp_path: Path) -> None:
    bad_json, empty = tmp_path / "bad.jsonl", tmp_path / "empty.jsonl"
    bad_json.write_text(json.dumps(TINY[0]) + "\n" + "not json\n")
    empty.write_text("\n")
    cases = [(bad_json, "bad.jsonl:2: not a Mooncake trace line"), (empty, "no requests")]
    cases.append((tmp_path / "absent.jsonl", "No such file"))
    for path, message in cases:
        with pytest.raises(SystemExit, match=message):
            main(["trace", "--trace", str(path), "--dram-blocks", "4"])


def test_any_integer_ids_replay(tmp_path: Path) -> None:
    path = tmp_path / "wide.jsonl"
    ids = [[-1, 2**70], [-1, 2**70, 5]]
    path.write_text("".join(json.dumps({**TINY[0], "hash_ids": h}) + "\n" for h in ids))
    out = tmp_path / "wide.json"
    assert main(["trace", "--trace", str(path), "--dram-blocks", "3", "--json", str(out)]) == 0
    assert {row["hit_ratio"] for row in json.loads(out.read_text())} == {1024 / 2600}
