"""Clients that die, hang or read slowly, against a real store: what they held is reclaimed
at the right time, and nobody else is hurt.

A dying client is a child process SIGKILLed at a point it reports on stdout (after its
reserve returned; while it holds a lease on an unread Get stream). A slow one is a Get
stream this process opens and does not read. The store runs LRU, so which blocks eviction
takes is known.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import PutStatus
from tests.conftest import StoreProcess, cli_stats, open_get_stream, wait_until

NS = Namespace("client-faults", KVLayout("float16", 8, 8, 128, 16))  # 512 KiB blocks
BLOCK = NS.block_bytes
DRAM_BLOCKS = 48
LEASED = 24  # 12 MiB: more than gRPC's flow-control window, so an unread stream stalls
TIMEOUT_S = 2.0  # of reservations and leases, where a test waits for one to expire
REPO_ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import sys
from kvstore.client import Client
from tests.conftest import open_get_stream
from tests.faults.test_clients import NS, _chain, _payload
address, mode = sys.argv[1:]
keys = _chain(8 if mode == "put" else 24, seed=1)
client = Client(address, timeout_s=30.0, transport="grpc")
client.register_namespace(NS)
if mode == "put":
    res = client.reserve(NS.id, keys, [None, *keys[:-1]])
    client.write(res.reservation_id, [(0, _payload(keys[0]))])  # one block of eight
    print("reserved", flush=True)
else:
    held = open_get_stream(address, NS.id, keys)  # the server holds the lease and waits
    print("leased", flush=True)
sys.stdin.read()  # until killed (or this test dies: then stdin closes)
"""


def _chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(list(key)).integers(0, 256, BLOCK, dtype=np.uint8)


def _is_exact(key: bytes, block: bytearray | None) -> bool:
    """A miss, or exactly the bytes put under `key`."""
    return block is None or bytes(block) == _payload(key).tobytes()


def _put(client: Client, keys: list[bytes]) -> None:
    assert client.put_chain(NS.id, keys, [_payload(k) for k in keys]).num_stored == len(keys)


def _assert_exact(client: Client, keys: list[bytes]) -> None:
    got = client.get(NS.id, keys).blocks
    assert [bytes(b) if b is not None else None for b in got] == [
        _payload(k).tobytes() for k in keys
    ]


def _start(store_factory, timeout_s: float) -> StoreProcess:
    return store_factory(
        "--dram-bytes", str(DRAM_BLOCKS * BLOCK), "--slab-bytes", str(8 * BLOCK),
        "--policy", "lru", "--dataplane", "none", "--expire-interval-s", "0.1",
        "--reservation-timeout-s", str(timeout_s), "--lease-timeout-s", str(timeout_s),
    )  # fmt: skip


@pytest.fixture
def child() -> Iterator[list[subprocess.Popen]]:
    """Client processes a test starts; killed at teardown if still running."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def _spawn(started: list[subprocess.Popen], address: str, mode: str) -> subprocess.Popen:
    """A client process in `mode` (put, get); returns once it reports it got there."""
    cmd = [sys.executable, "-c", _CHILD, address, mode]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    started.append(proc)
    assert proc.stdout is not None
    line = b""
    deadline = time.monotonic() + 60.0
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        assert remaining > 0 and proc.poll() is None, f"the {mode} client never got there"
        if select.select([proc.stdout], [], [], remaining)[0]:
            line += os.read(proc.stdout.fileno(), 256)
    assert line.strip() in (b"reserved", b"leased"), line
    return proc


def _counters(store: StoreProcess) -> dict[str, int]:
    return {k: int(v) for k, v in cli_stats(store.address).items() if v.isdigit()}


def _assert_no_leak(client: Client) -> None:
    stats = client.stats()
    dram = next(t for t in stats.tiers if t.name == "dram")
    assert (stats.num_leases, stats.num_reservations) == (0, 0)
    assert dram.num_blocks == stats.num_blocks, "DRAM slots of no block"


def test_a_client_killed_between_reserve_and_commit(store_factory, child):
    store = _start(store_factory, TIMEOUT_S)
    keys = _chain(8, seed=1)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        start = time.monotonic()  # before the reservation is made
        proc = _spawn(child, store.address, "put")
        assert client.match(NS.id, keys).num_matched == 0  # nothing visible before commit
        other = client.reserve(NS.id, keys)  # a second writer of the same blocks waits
        assert other.statuses == (PutStatus.IN_FLIGHT,) * 8
        client.abort(other.reservation_id)
        proc.kill()
        proc.wait(timeout=30)
        counters = wait_until(
            lambda: (c := _counters(store))["num_reservations"] == 0 and c,
            TIMEOUT_S + 30.0,
            "the dead client's reservation expired",
        )
        assert time.monotonic() - start >= TIMEOUT_S, "freed before its timeout"
        assert counters["expired_reservations"] == 1
        assert (counters["num_blocks"], counters["blocks_committed"]) == (0, 0)
        _assert_no_leak(client)
        _put(client, keys)  # the keys are free again
        _assert_exact(client, keys)


def test_a_client_killed_mid_get_leaves_its_blocks_evictable(store_factory, child):
    store = _start(store_factory, 30.0)  # a dead connection ends the lease, not its timeout
    leased = _chain(LEASED, seed=1)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        _put(client, leased)
        proc = _spawn(child, store.address, "get")
        assert client.stats().num_leases == 1
        proc.kill()
        proc.wait(timeout=30)
        counters = wait_until(
            lambda: (c := _counters(store))["num_leases"] == 0 and c,
            20.0,  # under its 30 s timeout: the dead connection ended it
            "the dead reader's lease ended",
        )
        assert counters["expired_leases"] == 0
        _assert_no_leak(client)
        for seed in range(2, 2 + DRAM_BLOCKS // 8):  # a DRAM's worth: LRU takes `leased`
            _put(client, _chain(8, seed))
        assert client.match(NS.id, leased).num_matched == 0
        _assert_exact(client, _chain(8, seed=2 + DRAM_BLOCKS // 8 - 1))
        _assert_no_leak(client)


def test_a_slow_reader_keeps_its_blocks_and_others_keep_working(store_factory):
    store = _start(store_factory, 60.0)
    leased = _chain(LEASED, seed=1)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        _put(client, leased)
        stream, _ = open_get_stream(store.address, NS.id, leased)
        for seed in range(2, 8):  # 48 blocks through the 24 slots nobody leases
            _put(client, _chain(8, seed))
            _assert_exact(client, _chain(8, seed))
        assert client.match(NS.id, leased).tiers == ("dram",) * LEASED  # never evicted
        assert client.stats().evictions == 24
        with pytest.raises(errors.StoreFullError, match="leased"):  # RESOURCE_EXHAUSTED
            client.put_chain(NS.id, _chain(25, seed=9), [_payload(k) for k in _chain(25, 9)])
        assert client.stats().num_reservations == 0  # the refused put reserved nothing
        stream.cancel()  # the reader goes away: its lease ends at once
        wait_until(lambda: client.stats().num_leases == 0, 30.0, "the cancelled lease ended")
        assert client.stats().expired_leases == 0
        _assert_no_leak(client)


def test_a_slow_readers_lease_expires_and_frees_its_blocks(store_factory):
    store = _start(store_factory, TIMEOUT_S)
    leased = _chain(LEASED, seed=1)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        _put(client, leased)
        start = time.monotonic()  # before the lease is taken
        stream, _ = open_get_stream(store.address, NS.id, leased)
        counters = wait_until(
            lambda: (c := _counters(store))["num_leases"] == 0 and c,
            TIMEOUT_S + 30.0,
            "the slow reader's lease expired",
        )
        assert time.monotonic() - start >= TIMEOUT_S, "expired before its timeout"
        assert counters["expired_leases"] == 1
        for seed in range(2, 2 + DRAM_BLOCKS // 8):  # LRU now takes the unleased blocks
            _put(client, _chain(8, seed))
        assert client.match(NS.id, leased).num_matched == 0
        _assert_no_leak(client)
        stream.cancel()


def test_a_stream_that_outlives_its_lease_never_returns_other_bytes(store_factory):
    store = _start(store_factory, TIMEOUT_S)
    leased = _chain(LEASED, seed=1)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        _put(client, leased)
        stream, assembler = open_get_stream(store.address, NS.id, leased)
        wait_until(lambda: client.stats().expired_leases == 1, TIMEOUT_S + 30.0, "expiry")
        for seed in range(2, 2 + DRAM_BLOCKS // 8):  # evicts `leased`, reuses its slots
            _put(client, _chain(8, seed))
    try:
        for msg in stream:
            assembler.feed(msg)
    except grpc.RpcError as err:  # failing the stream is the answer: its lease has ended
        assert err.code() is grpc.StatusCode.ABORTED, err
        assert "LeaseExpiredError" in dict(err.trailing_metadata()).values()
        return
    got = assembler.result().blocks
    wrong = [i for i, (k, b) in enumerate(zip(leased, got, strict=True)) if not _is_exact(k, b)]
    assert wrong == [], "blocks served with another block's bytes"


def test_a_put_of_present_blocks_leaves_no_reservation_open(store_factory):
    store = _start(store_factory, 60.0)
    keys = _chain(4, seed=1)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        _put(client, keys)
        assert client.put_chain(NS.id, keys, [_payload(k) for k in keys]).num_present == 4
        assert client.stats().num_reservations == 0
