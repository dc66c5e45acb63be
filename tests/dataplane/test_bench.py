"""The `dataplane` suite's ratio table: per block size, kvstore against each baseline of the
same run, and the targets a size misses (from synthetic rows; the suite itself is a bench)."""

from __future__ import annotations

import os
import sys

import pytest

from kvstore.bench import dataplane
from kvstore.bench import dataplane_peers as peers
from kvstore.bench import dataplane_ratios as ratios

MIB = 1 << 20


def _rows(gbps: dict[tuple[str, str], float], size: int) -> list[dict]:
    return [
        {"system": system, "op": op, "block_bytes": size, "batch": 64, "gbps": value}
        for (system, op), value in gbps.items()
    ]


def test_block_sizes_span_64_kib_to_16_mib_at_batch_64():
    assert dataplane.BLOCK_BYTES[0] == 64 << 10 and dataplane.BLOCK_BYTES[-1] == 16 * MIB
    assert 64 in dataplane.BATCHES
    assert dataplane._reps(16 * MIB, 64, quick=True) == 3  # at least 3 batches, even of 1 GiB


def test_ratios_and_missed_targets_per_block_size():
    gbps = {
        ("kvstore-shm", "put"): 3.0,
        ("kvstore-shm", "get"): 9.0,
        ("kvstore-ucx", "put"): 2.0,
        ("memcpy", "put"): 10.0,
        ("memcpy", "get"): 10.0,
        ("mooncake-shm", "put"): 2.0,
        ("mooncake-shm", "get"): 10.0,
        ("mooncake", "put"): 2.5,
        ("mooncake", "get"): 1.0,
        ("kvstore-ucx-tcp", "get"): 1.8,
        ("kvstore-tcp", "put"): 2.0,
        ("kvstore-tcp", "get"): 1.6,
        ("tcp-socket", "get"): 2.0,
        ("tcp-socket", "put"): 2.0,
    }
    (row,) = ratios.ratios(_rows(gbps, MIB))[2:3]
    assert row["block_bytes"] == MIB
    assert row["put/memcpy"] == pytest.approx(0.3) and row["get/memcpy"] == pytest.approx(0.9)
    assert row["shm put/mooncake-shm"] == pytest.approx(1.5)
    assert row["shm get/mooncake-shm"] == pytest.approx(0.9)
    assert row["tcp put/mooncake"] == pytest.approx(0.8)  # like for like, both over TCP
    assert row["tcp get/mooncake"] == pytest.approx(1.6)
    assert row["put/mooncake best"] == pytest.approx(3.0 / 2.5)  # Mooncake's faster path
    assert row["get/mooncake best"] == pytest.approx(0.9)
    assert row["ucx-tcp get/tcp-socket"] == pytest.approx(0.9)
    assert row["tcp get/tcp-socket"] == pytest.approx(0.8)
    assert row["ucx_put_gbps"] == 2.0  # the UCX plane's figure beside the same-host one's
    assert row["ucx put/raw-ucxx"] is None  # not measured, and no target: no verdict
    assert row["missed"] == (
        "shm get/mooncake-shm<1 tcp put/mooncake<1 put/memcpy<0.6 tcp get/tcp-socket<0.9"
    )
    assert ratios.failures([row]) == [f"{MIB} B: {row['missed']}"]


def test_every_ratio_says_what_it_compares_like_for_like_first():
    legend = ratios.legend()
    kinds = [r["compares"] for r in legend]
    assert kinds[:4] == [ratios.LIKE] * 4 and set(kinds) == {
        ratios.LIKE,
        ratios.BEST,
        ratios.LIMIT,
        ratios.CEILING,
    }
    assert [r["ratio"] for r in legend] == [r.column for r in ratios.RATIOS]
    by_name = {r["ratio"]: r for r in legend}
    assert by_name["tcp put/mooncake"]["target"] == ">= 1 at every size"
    assert by_name["shm put/mooncake-shm"]["target"] == ">= 1 from 256 KiB"
    assert by_name["put/memcpy"]["target"] == ">= 0.6 from 1 MiB"
    assert by_name["put/mooncake best"]["target"] == "-"  # reported beside, never judged
    like = {r.column: (r.num, r.den) for r in ratios.RATIOS if r.kind == ratios.LIKE}
    assert like == {  # one transport on both sides of each
        "shm put/mooncake-shm": ("kvstore-shm", ("mooncake-shm",)),
        "shm get/mooncake-shm": ("kvstore-shm", ("mooncake-shm",)),
        "tcp put/mooncake": ("kvstore-tcp", ("mooncake",)),
        "tcp get/mooncake": ("kvstore-tcp", ("mooncake",)),
    }


def test_memcpy_targets_start_at_1_mib():
    gbps = {("kvstore-shm", "put"): 1.0, ("memcpy", "put"): 10.0}
    small = ratios.ratio_row(_rows(gbps, 256 << 10), 256 << 10)
    assert small["put/memcpy"] == pytest.approx(0.1) and "memcpy" not in small["missed"]


def test_a_best_path_needs_every_path_of_the_peer():
    gbps = {("kvstore-shm", "put"): 3.0, ("mooncake-shm", "put"): 2.0}  # no TCP row
    row = ratios.ratio_row(_rows(gbps, MIB), MIB)
    assert row["put/mooncake best"] is None and row["shm put/mooncake-shm"] == 1.5


def test_a_missing_mooncake_piece_is_named_with_what_to_install(monkeypatch):
    import ctypes.util
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert peers.mooncake_missing() == (
        "Mooncake Store needs its package: pip install 'kvstore[peers]'"
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    no_rdma = {"ibverbs", "rdmacm"}
    monkeypatch.setattr(ctypes.util, "find_library", lambda n: None if n in no_rdma else n)
    assert peers.mooncake_missing() == (
        "Mooncake Store needs Debian's libibverbs1 librdmacm1: "
        "apt-get install libibverbs1 librdmacm1"
    )
    monkeypatch.setattr(ctypes.util, "find_library", lambda n: n)
    there = {"mooncake_master": sys.executable}  # the real client, for same-host runs, is not
    monkeypatch.setattr(peers, "_mooncake_binary", lambda name: there.get(name, f"/no/{name}"))
    assert peers.mooncake_missing() == (
        "Mooncake Store needs mooncake_client: pip install 'kvstore[peers]'"
    )


def test_ratios_to_the_ceilings_say_what_the_checks_leave():
    gbps = {
        ("kvstore-shm", "get"): 6.0,
        ("shm-ceiling", "get"): 8.0,
        ("memcpy", "get"): 10.0,
        ("kvstore-ucx-tcp", "get"): 1.5,
        ("tcp-socket-crc32c", "get"): 1.6,
        ("tcp-socket", "get"): 2.0,
    }
    row = ratios.ratio_row(_rows(gbps, MIB), MIB)
    assert row["get/ceiling"] == pytest.approx(0.75)
    assert row["ceiling get/memcpy"] == pytest.approx(0.8)
    assert row["ucx-tcp get/tcp-crc32c"] == pytest.approx(1.5 / 1.6)
    assert row["tcp-crc32c get/tcp"] == pytest.approx(0.8)
    assert row["missed"] == (  # the targets stand; those of systems not run are unmeasured
        "shm put/mooncake-shm unmeasured shm get/mooncake-shm unmeasured "
        "tcp put/mooncake unmeasured tcp get/mooncake unmeasured put/memcpy unmeasured "
        "get/memcpy<0.8 ucx-tcp get/tcp-socket<0.9 tcp get/tcp-socket unmeasured "
        "tcp put/tcp-socket unmeasured"
    )


def test_the_shm_ceiling_times_every_cell_in_two_processes():
    cells = {("get", 64 << 10, 4): 2, ("put", 64 << 10, 4): 3, ("get", 256 << 10, 2): 2}
    times = dataplane._drive(dataplane.ceilings.drive, _ceiling_node(), cells)
    assert times.keys() == cells.keys()
    assert all(cells[c] <= len(t) <= peers.MAX_REPS for c, t in times.items())
    assert all(t > 0 for ts in times.values() for t in ts)


def test_a_cell_is_timed_over_its_reps_and_at_least_a_floor_of_time():
    """At least `reps` calls after an untimed warm-up, and more while they add up to under
    MIN_CELL_S (a call that times itself says how long it took), at most MAX_REPS."""
    calls: list[float] = []

    def took(seconds: float) -> float:
        calls.append(seconds)
        return seconds

    tenth = peers.MIN_CELL_S / 10
    assert peers._timed(lambda: took(4 * tenth), 2) == [4 * tenth] * 3  # 8 tenths: one more
    assert len(calls) == 4  # and the warm-up
    assert peers._timed(lambda: took(peers.MIN_CELL_S), 5) == [peers.MIN_CELL_S] * 5
    assert len(peers._timed(lambda: None, 3)) == peers.MAX_REPS  # each call next to nothing


def _ceiling_node() -> bytes:
    """A node of the ceiling, spawned as the suite spawns it (it ends with its driver)."""
    import multiprocessing as mp

    name_q = mp.get_context("spawn").Queue()
    dataplane._spawn(dataplane.ceilings.serve_node, name_q)
    return name_q.get(timeout=30)


def test_systems_names_a_subset_in_table_order():
    assert dataplane._systems(None) == list(dataplane.SYSTEMS)
    assert dataplane._systems("kvstore-tcp,tcp-socket") == ["tcp-socket", "kvstore-tcp"]
    with pytest.raises(SystemExit, match="unknown systems"):
        dataplane._systems("tcp-socket,nope")


def test_over_rounds_each_ratio_is_the_median_of_its_rounds_and_judged_on_it():
    def round_of(kvstore_tcp: float, socket: float) -> list[dict]:
        return _rows({("kvstore-tcp", "get"): kvstore_tcp, ("tcp-socket", "get"): socket}, MIB)

    # 0.5, 1.0, 0.95 (a round where the socket ran away is outvoted); 1 MiB is index 2
    rounds = [round_of(2.0, 4.0), round_of(2.0, 2.0), round_of(1.9, 2.0)]
    row = ratios.median_ratios(rounds)[2]
    assert row["block_bytes"] == MIB and row["rounds"] == 3
    assert row["tcp get/tcp-socket"] == pytest.approx(0.95)
    assert "tcp get/tcp-socket<" not in row["missed"]
    (one,) = ratios.median_ratios(rounds[:1])[2:3]
    assert " tcp get/tcp-socket<0.9 " in one["missed"]  # the TCP plane's, judged
    assert row["ucx-tcp get/tcp-socket"] is None  # measured in no round: no ratio, and
    assert "ucx-tcp get/tcp-socket unmeasured" in row["missed"]  # its target is missed


def test_the_suite_fails_where_a_target_is_missed_or_could_not_be_measured():
    peers_and_planes = ("kvstore-shm", "memcpy", "mooncake", "mooncake-shm", "kvstore-ucx-tcp")
    measured = {
        (system, op): 10.0 for system in (*peers_and_planes, "kvstore-tcp") for op in ("put", "get")
    } | {("tcp-socket", "get"): 10.0, ("tcp-socket", "put"): 10.0}
    rows = [row for size in dataplane.BLOCK_BYTES for row in _rows(measured, size)]
    assert dataplane.exit_status(rows) == 0  # every target met
    no_peer = [r for r in rows if r["system"] != "mooncake-shm"]  # the peer did not start
    assert dataplane.exit_status(no_peer) == 1
    assert ratios.failures(ratios.ratios(no_peer))[0] == (
        f"{256 << 10} B: shm put/mooncake-shm unmeasured shm get/mooncake-shm unmeasured"
    )


def test_a_systems_rows_pool_the_times_of_every_round_that_ran():
    cell = ("get", MIB, 64)
    runs = [{cell: [0.02, 0.04]}, "OSError: peer gone", {cell: [0.03]}]
    rows = {(r["op"], r["block_bytes"], r["batch"]): r for r in dataplane._rows_of("x", runs)}
    assert rows[cell]["p50_ms"] == pytest.approx(30.0)
    assert rows[cell]["gbps"] == pytest.approx(3 * 64 * MIB / 0.09 / 1e9)
    assert rows["put", MIB, 64]["gbps"] is None  # a cell no round timed
    failed = dataplane._rows_of("x", ["OSError: peer gone"])
    assert all(r["gbps"] is None and r["note"] == "OSError: peer gone" for r in failed)


def test_the_memcpy_limit_copies_with_as_many_threads_as_kvstore_and_says_so():
    cores = os.cpu_count() or 1
    put_threads, get_threads = 1 + min(3, cores - 1), 1 + min(3, cores - 1, max(0, cores - 2))
    assert peers.copy_threads("put", 64 * MIB) == put_threads  # the node's crew
    assert peers.copy_threads("put", 64 << 10) == 1  # under a MiB: the caller alone
    assert peers.copy_threads("get", 64 * MIB) == get_threads  # beside the client's check
    assert peers.copy_threads("get", 4 * MIB) == 1
    for system in ("memcpy", "kvstore-shm"):  # the limit and what it limits, side by side
        assert dataplane._row(system, ("put", MIB, 64), [0.01])["copy_threads"] == put_threads
    assert "copy_threads" not in dataplane._row("mooncake", ("put", MIB, 64), [0.01])
    (times,) = peers.drive_memcpy([("put", MIB, 64)], 3).values()
    assert len(times) >= 3 and all(t > 0 for t in times)


def test_the_verdict_is_on_the_medians_of_the_rounds_the_run_printed():
    measured = {
        (system, op): 10.0
        for system in ("kvstore-shm", "memcpy", "mooncake", "mooncake-shm", "kvstore-ucx-tcp")
        for op in ("put", "get")
    } | {(s, op): 10.0 for s in ("kvstore-tcp", "tcp-socket") for op in ("put", "get")}
    rows = [row for size in dataplane.BLOCK_BYTES for row in _rows(measured, size)]
    # Mooncake's shm get ran away in one round of three: the median holds, the pool may not.
    for row in rows:
        fast = row["system"] == "mooncake-shm" and row["op"] == "get"
        row["rounds_gbps"] = [10.0, 10.0, 90.0] if fast else [10.0] * 3
        row["gbps"] = 30.0 if fast else 10.0
    assert dataplane.exit_status(rows) == 0
    for row in rows:  # two rounds of three slow: the median misses
        if row["system"] == "kvstore-shm" and row["op"] == "put":
            row["rounds_gbps"] = [5.0, 5.0, 10.0]
    assert dataplane.exit_status(rows) == 1
