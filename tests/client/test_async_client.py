"""`AsyncClient` against real `kvstore serve` processes: its UCX path moves the same bytes
as the gRPC path, many transfers run at once, and typed errors come through."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.client.async_client import AsyncClient
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import require_extra, wait_no_leases

require_extra("ucxx")

NS = Namespace("llama-async", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks


def _chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, NS.block_bytes, dtype=np.uint8) for _ in range(n)]


def _zeros(n: int) -> list[np.ndarray]:
    return [np.zeros(NS.block_bytes, np.uint8) for _ in range(n)]


@pytest.mark.parametrize("transport", ["ucx", "tcp", "grpc"])
def test_put_and_get_into_match_the_blocking_client(store, transport):
    keys, blocks = _chain(8, seed=1), _blocks(8, seed=1)

    async def run() -> tuple[int, tuple[bool, ...], list[np.ndarray], bool]:
        async with AsyncClient(store.address, timeout_s=10.0, transport=transport) as client:
            await client.register_namespace(NS)
            stored = (await client.put_chain(NS.id, keys, blocks)).num_stored
            out = _zeros(9)
            found = await client.get_into(NS.id, [*keys, _chain(1, seed=99)[0]], out)
            dataplane = await client.data_plane()
            return stored, found, out, "grpc" if dataplane is None else dataplane.plane

    stored, found, out, plane = asyncio.run(run())
    assert (stored, found, plane) == (8, (True,) * 8 + (False,), transport)
    assert all(np.array_equal(o, b) for o, b in zip(out, blocks, strict=False))
    assert not out[8].any()  # the miss left its buffer untouched
    with Client(store.address, timeout_s=10.0, transport="grpc") as check:
        assert [bytes(b) for b in check.get(NS.id, keys).blocks] == [b.tobytes() for b in blocks]
        wait_no_leases(check)


def test_many_transfers_run_at_once_without_blocking_the_loop(store):
    chains = [(_chain(4, seed=s), _blocks(4, seed=s)) for s in range(10, 18)]

    async def run() -> tuple[list[tuple[bool, ...]], list[list[np.ndarray]], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        async with AsyncClient(store.address, timeout_s=10.0, transport="ucx") as client:
            await client.register_namespace(NS)
            tick = asyncio.create_task(ticker())
            await asyncio.gather(*(client.put_chain(NS.id, k, b) for k, b in chains))
            outs = [_zeros(4) for _ in chains]
            found = await asyncio.gather(
                *(client.get_into(NS.id, k, o) for (k, _), o in zip(chains, outs, strict=True))
            )
            tick.cancel()
            return found, outs, ticks

    found, outs, ticks = asyncio.run(run())
    assert found == [(True,) * 4] * len(chains)
    for (_, blocks), out in zip(chains, outs, strict=True):
        assert all(np.array_equal(o, b) for o, b in zip(out, blocks, strict=True))
    assert ticks > len(chains)  # the loop kept running while the transfers were in flight


def test_typed_errors_and_transport_fallback(store_factory):
    store = store_factory("--dataplane", "none")

    async def run() -> tuple[bool, int]:
        with pytest.raises(errors.InvalidArgumentError):
            AsyncClient(store.address, transport="carrier-pigeon")
        async with AsyncClient(store.address, timeout_s=5.0, transport="ucx") as client:
            await client.register_namespace(NS)
            with pytest.raises(errors.UnavailableError):
                await client.put(NS.id, _chain(1, seed=3), _blocks(1, seed=3))
        async with AsyncClient(store.address, timeout_s=5.0) as client:  # auto: gRPC
            stored = (await client.put(NS.id, _chain(1, seed=3), _blocks(1, seed=3))).num_stored
            with pytest.raises(errors.PayloadSizeError):
                await client.get_into(NS.id, _chain(1, seed=3), [np.zeros(10, np.uint8)])
            out = _zeros(1)
            found = await client.get_into(NS.id, _chain(1, seed=3), out)
            return await client.data_plane() is None, stored + sum(found)

    assert asyncio.run(run()) == (True, 2)


def test_a_cancelled_get_into_has_stopped_writing_when_it_returns(store):
    big = Namespace("llama-async-big", KVLayout("float16", 32, 8, 128, 16))  # 2 MiB blocks
    keys = block_keys(big, np.arange(16 * big.block_tokens))
    rng = np.random.default_rng(5)
    blocks = [rng.integers(0, 256, big.block_bytes, dtype=np.uint8) for _ in keys]

    async def run() -> tuple[list[bytes], list[np.ndarray]]:
        async with AsyncClient(store.address, timeout_s=10.0, transport="ucx") as client:
            await client.register_namespace(big)
            await client.put_chain(big.id, keys, blocks)
            out = [np.zeros(big.block_bytes, np.uint8) for _ in keys]
            start = time.perf_counter()
            await client.get_into(big.id, keys, out)  # connected, and timed
            full_s = time.perf_counter() - start
            for fraction in (3, 6, 12, 24, 48):  # cancel while the transfer is under way
                out = [np.zeros(big.block_bytes, np.uint8) for _ in keys]
                get = asyncio.create_task(client.get_into(big.id, keys, out))
                await asyncio.sleep(full_s / fraction)
                get.cancel()
                try:
                    await get
                except asyncio.CancelledError:
                    break
            else:
                pytest.fail("every get finished before it could be cancelled")
            seen = [o.tobytes() for o in out]
            await asyncio.sleep(0.2)  # anything still landing would show now
            return seen, out

    seen, out = asyncio.run(run())
    assert [o.tobytes() for o in out] == seen
