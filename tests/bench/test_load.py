"""`kvstore-bench load`: a short run against a real server verifies every read with no errors;
corrupted bytes are counted and fail the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench import load
from kvstore.bench.__main__ import build_parser, main
from kvstore.bench.load_worker import LoadConfig, Worker, block_payload, prompt_keys
from kvstore.bench.suites import SUITES

JSON_KEYS = {
    "clients", "seconds", "ops_per_s", "p50_ms", "p99_ms", "p999_ms", "errors", "corrupted",
    "verified_bytes", "rss_start_bytes", "rss_end_bytes", "fds_start", "fds_end",
}  # fmt: skip
SMALL = LoadConfig(num_clients=1, seconds=1.0, dram_bytes=1 << 20, num_prompts=4)


def test_short_run_verifies_every_read_without_errors(tmp_path: Path) -> None:
    out, scrape, png = tmp_path / "load.json", tmp_path / "metrics.txt", tmp_path / "load.png"
    argv = ["load", "--quick", "--clients", "2", "--seconds", "3", "--json", str(out)]
    assert main([*argv, "--metrics", str(scrape), "--plot", str(png)]) == 0
    [row] = json.loads(out.read_text())
    assert set(row) >= JSON_KEYS
    assert (row["clients"], row["errors"], row["corrupted"]) == (2, 0, 0), row["error_classes"]
    assert row["verified_bytes"] > 0 and row["ops_per_s"] > 0
    assert row["p50_ms"] <= row["p99_ms"] <= row["p999_ms"]
    # The shape: DRAM evicts, gets ask for missing keys, puts send keys already present.
    assert row["evictions"] > 0 and row["blocks_missed"] > 0 and row["blocks_present"] > 0
    assert row["rss_start_bytes"] >= load.QUICK.dram_bytes and row["fds_start"] > 0
    assert row["server_exit_code"] == 0
    # The footprint series spans the timed loop, from the start snapshot to the end one.
    at_s, rss, fds = zip(*row["footprint"], strict=True)
    assert at_s[0] < 1.0 and at_s[-1] == pytest.approx(row["seconds"], abs=0.1)
    assert list(at_s) == sorted(at_s) and len(at_s) >= 8  # a sample every quarter second
    assert (rss[0], rss[-1], fds[0], fds[-1], max(fds)) == (
        row["rss_start_bytes"], row["rss_end_bytes"], row["fds_start"], row["fds_end"],
        row["fds_max"],
    )  # fmt: skip
    for key in ("rss_first_quarter_bytes", "rss_last_quarter_bytes"):
        assert min(rss) <= row[key] <= max(rss)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The server's own counters, scraped after the run, agree with what the clients saw.
    metrics = _samples(scrape.read_text())
    assert metrics["kvstore_hit_blocks_total"] == row["blocks_found"]
    assert metrics["kvstore_miss_blocks_total"] == row["blocks_missed"]
    assert metrics["kvstore_committed_blocks_total"] == row["blocks_stored"]
    assert metrics["kvstore_evictions_total"] == row["evictions"]
    rejected_parent = 'kvstore_rejected_requests_total{error="UnknownParentError"'
    assert metrics.get(rejected_parent, 0) == row["puts_refused_parent"]


def _samples(text: str) -> dict[str, float]:
    """Prometheus text summed by name, and by name with its first label."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            first_label = series.split(",", 1)[0]
            for key in {name, first_label}:
                sums[key] = sums.get(key, 0.0) + float(value)
    return sums


@pytest.mark.parametrize(
    ("attack", "size", "transport"),
    [("stalled-readers", "60", "auto"), ("silent-sockets", "64", "tcp")],
)
def test_a_run_beside_an_attack_ends_without_errors(tmp_path: Path, attack, size, transport):
    """Readers that never read, or sockets that never say hello (on the plane the clients
    take), beside the load: every op still succeeds and every byte read is right."""
    out = tmp_path / "load.json"
    argv = ["load", "--quick", "--clients", "2", "--seconds", "3", "--json", str(out)]
    argv += ["--attack", attack, "--attack-size", size, "--transport", transport]
    assert main(argv) == 0
    [row] = json.loads(out.read_text())
    assert row["attack"] == f"{attack}:{size}"
    assert (row["errors"], row["corrupted"]) == (0, 0), row["error_classes"]
    assert row["verified_bytes"] > 0
    assert transport == "auto" or row["transport"] == transport


def _series(rss_mib: list[float]) -> list[load.Snapshot]:
    return [load.Snapshot(float(t), int(m * 2**20), 96) for t, m in enumerate(rss_mib)]


def test_quarter_medians_tell_a_leak_from_a_level_that_wanders() -> None:
    # Climbing all along: the last quarter sits above the first by what leaked meanwhile.
    leak = load.quarter_medians(_series([200 + t for t in range(41)]))
    assert leak["rss_last_quarter_bytes"] - leak["rss_first_quarter_bytes"] == 30 * 2**20
    # A level that wanders with spikes at both ends (what single snapshots would report).
    level = [250.0, 270, 270, 271, 270, 269, 270, 271, 270, 270, 269, 270, 270, 290]
    wanders = load.quarter_medians(_series(level))
    assert wanders["rss_first_quarter_bytes"] == wanders["rss_last_quarter_bytes"] == 270 * 2**20


def test_suite_is_registered_with_its_flags() -> None:
    assert SUITES["load"].module == "kvstore.bench.load"
    args = build_parser("load").parse_args(["load", "--clients", "32", "--seconds", "60"])
    assert (args.clients, args.seconds, args.quick) == (32, 60.0, False)


def test_blocks_are_a_function_of_their_key() -> None:
    [chain, other, *_] = prompt_keys(SMALL)
    assert len(chain) == SMALL.prompt_blocks and len(set(chain) | set(other)) == 2 * len(chain)
    first = block_payload(chain[0], SMALL.block_bytes)
    assert first.size == SMALL.block_bytes
    assert np.array_equal(first, block_payload(chain[0], SMALL.block_bytes))
    assert not np.array_equal(first, block_payload(chain[1], SMALL.block_bytes))


def test_corrupted_bytes_are_counted_apart_from_misses() -> None:
    worker = Worker(SMALL, 0, None, None)  # type: ignore[arg-type]  # _check needs no client
    key = worker.keys[0][0]
    good = block_payload(key, SMALL.block_bytes).copy()
    altered = good.copy()
    altered[[0, 7, 100]] ^= 0xFF
    worker._check(key, good)
    worker._check(key, altered)
    worker._check(key, good[:-10])  # short: the missing bytes count too
    worker._check(key, None)
    result = worker.tally.result(0)
    assert (result.blocks_found, result.blocks_missed) == (3, 1)
    assert result.corrupted == 3 + 10
    assert result.verified_bytes == 3 * SMALL.block_bytes
    assert result.errors == {}


def test_corruption_fails_the_run() -> None:
    assert load.exit_status([{"corrupted": 0}]) == 0
    assert load.exit_status([{"corrupted": 5}]) == 1
    assert SUITES["load"].exit_status([{"corrupted": 5}]) == 1
    assert SUITES["keys"].exit_status([{"corrupted": 5}]) == 0  # no verdict of its own


def test_working_set_must_exceed_dram() -> None:
    with pytest.raises(ValueError, match="exceed DRAM"):
        LoadConfig(num_clients=1, seconds=1.0, dram_bytes=1 << 30)
