"""A real `kvstore serve` process driven by the sync and async clients."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.client.async_client import AsyncClient
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import PutStatus

NS = Namespace("llama-test", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
UNKNOWN_NS = Namespace("never-registered", KVLayout("float16", 4, 2, 64, 16))


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _blocks(keys: list[bytes]) -> list[np.ndarray]:
    return [
        np.random.default_rng(int.from_bytes(k[:8], "little")).integers(
            0, 256, NS.block_bytes, dtype=np.uint8
        )
        for k in keys
    ]


@pytest.fixture
def client(store):
    with Client(store.address, timeout_s=10.0) as c:
        c.register_namespace(NS)
        yield c


def test_put_get_roundtrip_identical_bytes(client):
    keys = _chain(8)
    blocks = _blocks(keys)
    assert client.put_chain(NS.id, keys, blocks) == (8, 0, 0)
    assert client.match(NS.id, keys) == (8, ("dram",) * 8)
    got = client.get(NS.id, [*keys, *_chain(1, seed=9)])
    assert got.found == (True,) * 8 + (False,)
    assert [bytes(b) for b in got.blocks[:8]] == [b.tobytes() for b in blocks]
    assert client.put_chain(NS.id, keys, blocks) == (0, 8, 0)
    stats = client.stats()
    assert (stats.num_blocks, stats.hits, stats.misses) == (8, 8, 1)
    assert (stats.miss_tokens, stats.tiers[0].hit_tokens) == (NS.block_tokens, 8 * NS.block_tokens)


def test_two_phase_put_over_the_wire(client):
    keys = _chain(2)
    blocks = _blocks(keys)
    res = client.reserve(NS.id, keys, [None, keys[0]])
    assert res.statuses == (PutStatus.RESERVED, PutStatus.RESERVED)
    client.write(res.reservation_id, [(0, blocks[0]), (1, blocks[1])])
    assert client.match(NS.id, keys).num_matched == 0  # invisible before commit
    assert client.commit(res.reservation_id) == 2
    assert client.match(NS.id, keys).num_matched == 2


def test_abort_leaves_nothing(client):
    keys = _chain(3)
    res = client.reserve(NS.id, keys)
    client.abort(res.reservation_id)
    stats = client.stats()
    assert (stats.num_reservations, stats.tiers[0].num_blocks) == (0, 0)


def test_remove(client):
    keys = _chain(4)
    client.put_chain(NS.id, keys, _blocks(keys))
    assert client.remove(NS.id, keys[2:]) == 2
    assert client.match(NS.id, keys).num_matched == 2


def test_async_client_roundtrip(store):
    async def run():
        async with AsyncClient(store.address, timeout_s=10.0) as client:
            assert await client.health()
            await client.register_namespace(NS)
            keys = _chain(5, seed=3)
            blocks = _blocks(keys)
            put = await client.put_chain(NS.id, keys, blocks)
            match = await client.match(NS.id, keys)
            got = await client.get(NS.id, keys)
            removed = await client.remove(NS.id, keys[:1])
            with pytest.raises(errors.UnknownReservationError):
                await client.commit(987654)
            return put, match, got, blocks, removed

    put, match, got, blocks, removed = asyncio.run(run())
    assert put.num_stored == 5 and match.num_matched == 5 and removed == 1
    assert [bytes(b) for b in got.blocks] == [b.tobytes() for b in blocks]


def test_stats_command_prints_counters(store, client):
    keys = _chain(3)
    client.put_chain(NS.id, keys, _blocks(keys))
    out = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "stats", "--address", store.address],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "num_blocks=3\n" in out
    assert f"used_bytes={3 * NS.block_bytes} " in out


def test_sigterm_drains_and_exits_cleanly(store):
    assert store.stop() == 0
    log = store.log()
    assert "event=draining" in log and "event=stopped" in log


def test_unreachable_store_raises_typed_error_within_timeout():
    from tests.conftest import free_port

    client = Client(f"127.0.0.1:{free_port()}", timeout_s=1.0)
    with client, pytest.raises((errors.UnavailableError, errors.DeadlineExceededError)):
        client.stats()
