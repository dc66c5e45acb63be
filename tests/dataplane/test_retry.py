"""A client on transport "auto" that a node refused the data plane moves bytes over gRPC
meanwhile and asks again when its backoff says: a node restarted with a data plane under
its clients gets them back on UCX (over real `kvstore serve` processes on one port)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.client.async_client import AsyncClient
from kvstore.dataplane.retry import HandshakeRetry
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import free_port, require_extra, start_store

require_extra("ucxx")

NS = Namespace("llama-retry", KVLayout("float16", 2, 2, 64, 16))  # 16 KiB blocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _round_trip(client: Client, seed: int) -> None:
    keys = block_keys(NS, np.arange(2 * NS.block_tokens) + seed * 1_000_000)
    blocks = [np.full(NS.block_bytes, seed + i, np.uint8) for i in range(2)]
    assert client.put(NS.id, keys, blocks).num_stored == 2
    out = [np.zeros(NS.block_bytes, np.uint8) for _ in range(2)]
    assert client.get_into(NS.id, keys, out) == (True, True)
    assert all(np.array_equal(a, b) for a, b in zip(out, blocks, strict=True))


def test_the_wait_doubles_to_its_longest_and_a_success_starts_over() -> None:
    clock = Clock()
    retry = HandshakeRetry(first_s=1.0, longest_s=5.0, clock=clock)
    assert retry.is_due
    waits = []
    for _ in range(5):
        assert retry.refused("node:1", ConnectionError("refused"))
        assert not retry.is_due
        clock.now += retry.wait_s - 0.001
        assert not retry.is_due
        clock.now += 0.001
        assert retry.is_due
        waits.append(retry.wait_s)
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    retry.succeeded()
    assert retry.is_due and retry.wait_s == 0.0
    retry.refused("node:1", ConnectionError("refused"))
    assert retry.wait_s == 1.0
    with pytest.raises(ValueError):
        HandshakeRetry(first_s=2.0, longest_s=1.0)


def test_a_node_restarted_with_a_data_plane_gets_its_clients_back_on_ucx(tmp_path: Path) -> None:
    port = str(free_port())
    clock = Clock()
    plain = start_store(tmp_path, "--port", port, "--dataplane", "none")
    address = plain.address
    with Client(address, timeout_s=10.0, dataplane_retry=HandshakeRetry(clock=clock)) as client:
        client.register_namespace(NS)
        _round_trip(client, 1)  # over gRPC: the node has no data plane
        assert client.data_plane() is None and client.transport == "auto"
        assert plain.stop() == 0
        ucx = start_store(tmp_path, "--port", port, "--dataplane", "ucx")
        try:
            assert ucx.address == address
            client.register_namespace(NS)
            _round_trip(client, 2)  # still gRPC: the retry is not due yet
            assert client.data_plane() is None
            clock.now += client.dataplane_retry.wait_s
            assert client.data_plane() is not None
            _round_trip(client, 3)  # over UCX
        finally:
            assert ucx.stop() == 0


def test_the_async_client_falls_back_and_asks_again_the_same_way(tmp_path: Path) -> None:
    port = str(free_port())
    clock = Clock()
    plain = start_store(tmp_path, "--port", port, "--dataplane", "none")

    async def run() -> None:
        client = AsyncClient(plain.address, dataplane_retry=HandshakeRetry(clock=clock))
        try:
            assert await client.data_plane() is None
            assert client.transport == "auto" and not client.dataplane_retry.is_due
            assert await asyncio.to_thread(plain.stop) == 0
            ucx = await asyncio.to_thread(start_store, tmp_path, "--port", port)
            try:
                assert await client.data_plane() is None  # not due yet
                clock.now += client.dataplane_retry.wait_s
                assert await client.data_plane() is not None
            finally:
                assert await asyncio.to_thread(ucx.stop) == 0
        finally:
            await client.close()

    asyncio.run(run())
