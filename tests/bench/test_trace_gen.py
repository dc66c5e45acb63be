"""The `trace-gen` suite: synthetic multi-turn traces with chained content ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.bench import trace_sim
from kvstore.bench.__main__ import main
from kvstore.bench.trace_file import BLOCK_TOKENS, load_trace
from kvstore.bench.trace_gen import KINDS, _Prompt, generate, write_trace


def test_a_block_id_names_everything_up_to_the_block_end() -> None:
    ids: dict[tuple, int] = {}
    turn1 = _Prompt(ids, (-1, 1000))
    turn1.append(0, 100)  # 1,100 tokens: two full blocks and a partial one
    turn2 = _Prompt(ids, (-1, 1000))
    turn2.append(0, 100)
    turn2.append(1, 600)  # the answer and the next message complete the partial block
    other = _Prompt(ids, (-2, 1000))
    other.append(0, 100)
    first, second, third = turn1.hash_ids(), turn2.hash_ids(), other.hash_ids()
    assert len(first) == 3 and len(second) == 4  # ceil(1,100 / 512), ceil(1,700 / 512)
    assert second[:2] == first[:2] and second[2] != first[2]
    assert not set(third) & set(first)  # another shared prompt: nothing in common
    assert turn1.hash_ids() == first  # the same prompt, the same ids


@pytest.mark.parametrize("kind", list(KINDS))
def test_traces_are_seeded_and_multi_turn(kind: str) -> None:
    requests = generate(kind, 30, seed=1)
    assert generate(kind, 30, seed=1) == requests
    assert generate(kind, 30, seed=2) != requests
    for req in requests:
        assert len(req.hash_ids) == -(-req.input_len // BLOCK_TOKENS)
        assert len(set(req.hash_ids)) == len(req.hash_ids)
    # Later turns read earlier ones: an unbounded cache hits most tokens.
    num_hit = trace_sim.simulate_unbounded(requests)
    assert sum(num_hit) > 0.5 * sum(len(r.hash_ids) for r in requests)
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)


def test_written_trace_loads_back(tmp_path: Path) -> None:
    requests = generate("conversation", 10)
    write_trace(requests, tmp_path / "sub" / "t.jsonl")
    assert load_trace(tmp_path / "sub" / "t.jsonl") == requests


def test_cli_writes_a_trace_the_trace_suite_replays(tmp_path: Path) -> None:
    out, summary = tmp_path / "agent.jsonl", tmp_path / "summary.json"
    argv = ["trace-gen", "--kind", "agent", "--sessions", "12", "--seed", "3", "--out", str(out)]
    assert main([*argv, "--json", str(summary)]) == 0
    (row,) = json.loads(summary.read_text())
    requests = load_trace(out)
    assert (row["kind"], row["seed"], row["sessions"]) == ("agent", 3, 12)
    assert row["requests"] == len(requests)
    assert row["blocks"] == sum(len(r.hash_ids) for r in requests)
    longest = max(len(r.hash_ids) for r in requests)
    replayed = tmp_path / "replay.json"
    argv = ["trace", "--trace", str(out), "--dram-blocks", str(longest), "--json", str(replayed)]
    assert main([*argv, "--policy", "prefix-2q"]) == 0
    (replay_row,) = json.loads(replayed.read_text())
    assert replay_row["unbounded_hit_ratio"] == pytest.approx(row["unbounded_hit_ratio"])
    assert 0 < replay_row["hit_ratio"] <= replay_row["belady_hit_ratio"]


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="sessions must be >= 1"):
        main(["trace-gen", "--sessions", "0", "--out", str(tmp_path / "t.jsonl")])
    with pytest.raises(SystemExit):
        main(["trace-gen", "--kind", "nope", "--out", str(tmp_path / "t.jsonl")])
    assert not (tmp_path / "t.jsonl").exists()
