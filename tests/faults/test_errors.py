"""Each error of the README's list, raised by a real store: its gRPC status code and the class
name in the trailers, as they cross the wire, and the class the client raises. Bad input
changes nothing; a stopped or dead node gives DEADLINE_EXCEEDED or UNAVAILABLE in time."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.client.async_client import AsyncClient
from kvstore.keys import KVLayout, Namespace, block_keys

NS = Namespace("errors-model", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
UNKNOWN_NS = Namespace("never-registered", KVLayout("float16", 4, 2, 64, 16))
BLOCK = NS.block_bytes
DRAM_BLOCKS = 16
MAX_BATCH_KEYS = 32


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _short_write(c: Client) -> None:
    res = c.reserve(NS.id, _keys(1, seed=8))
    c.write(res.reservation_id, [(0, bytes(BLOCK // 2))])
    try:
        c.commit(res.reservation_id)
    finally:
        c.abort(res.reservation_id)


def _long_write(c: Client) -> None:
    res = c.reserve(NS.id, _keys(1, seed=9))
    try:
        c.write(res.reservation_id, [(0, bytes(BLOCK + 1))])
    finally:
        c.abort(res.reservation_id)


BAD_INPUT: dict[str, tuple[Callable[[Client], object], type[errors.KVStoreError], str]] = {
    "bad key": (lambda c: c.match(NS.id, [b"k" * 16]), errors.BadKeyError, "INVALID_ARGUMENT"),
    "duplicate key": (
        lambda c: c.get(NS.id, [_keys(1)[0]] * 2),
        errors.DuplicateKeyError,
        "INVALID_ARGUMENT",
    ),
    "no keys": (lambda c: c.match(NS.id, []), errors.EmptyRequestError, "INVALID_ARGUMENT"),
    "batch too large": (
        lambda c: c.reserve(NS.id, _keys(MAX_BATCH_KEYS + 1)),
        errors.BatchTooLargeError,
        "INVALID_ARGUMENT",
    ),
    "payload too long": (_long_write, errors.PayloadSizeError, "INVALID_ARGUMENT"),
    "payload too short": (_short_write, errors.IncompleteWriteError, "INVALID_ARGUMENT"),
    "unknown namespace": (
        lambda c: c.match(UNKNOWN_NS.id, _keys(1)),
        errors.UnknownNamespaceError,
        "NOT_FOUND",
    ),
    "unknown reservation": (
        lambda c: c.commit(987654321),
        errors.UnknownReservationError,
        "NOT_FOUND",
    ),
}


@pytest.fixture
def store(store_factory):
    return store_factory(
        "--dram-bytes", str(DRAM_BLOCKS * BLOCK), "--slab-bytes", str(4 * BLOCK),
        "--max-batch-keys", str(MAX_BATCH_KEYS), "--dataplane", "none",
    )  # fmt: skip


@pytest.fixture
def client(store):
    with Client(store.address, timeout_s=10.0, transport="grpc") as c:
        c.register_namespace(NS)
        keys = _keys(4, seed=1)
        c.put_chain(NS.id, keys, [bytes([i]) * BLOCK for i in range(4)])
        yield c


def _wire_status(exc: errors.KVStoreError) -> tuple[str, str | None]:
    """The status code and error class name the failed call carried."""
    rpc = exc.__cause__
    assert isinstance(rpc, grpc.RpcError), f"{exc!r} did not come off the wire"
    trailers = dict(rpc.trailing_metadata() or ())  # type: ignore[attr-defined]
    return rpc.code().name, trailers.get(errors.ERROR_METADATA_KEY)  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_has_its_class_and_status_and_changes_nothing(client, case):
    call, cls, code = BAD_INPUT[case]
    before = client.stats()
    with pytest.raises(cls) as raised:
        call(client)
    assert type(raised.value) is cls
    assert _wire_status(raised.value) == (code, cls.__name__)
    after = client.stats()
    assert (after.num_blocks, after.num_reservations, after.blocks_committed) == (
        before.num_blocks,
        before.num_reservations,
        before.blocks_committed,
    )
    assert after.tiers[0].used_bytes == before.tiers[0].used_bytes
    assert client.get(NS.id, _keys(4, seed=1)).num_found == 4  # still serving


def test_store_full_is_resource_exhausted(client):
    held = client.reserve(NS.id, _keys(DRAM_BLOCKS - 4, seed=2))  # every free slot
    with pytest.raises(errors.StoreFullError) as raised:
        client.reserve(NS.id, _keys(5, seed=3))
    assert _wire_status(raised.value) == ("RESOURCE_EXHAUSTED", "StoreFullError")
    client.abort(held.reservation_id)
    assert client.stats().num_reservations == 0


def test_an_oversize_message_is_resource_exhausted(client):
    res = client.reserve(NS.id, _keys(1, seed=4))
    big = Client(client.address, chunk_bytes=16 << 20, max_message_bytes=64 << 20)
    with big, pytest.raises(errors.ResourceExhaustedError) as raised:  # over the 8 MiB limit
        big.write(res.reservation_id, [(0, bytes(9 << 20))])
    assert _wire_status(raised.value)[0] == "RESOURCE_EXHAUSTED"
    client.abort(res.reservation_id)


def test_a_stopped_node_gives_deadline_exceeded_in_time(store, client):
    store.proc.send_signal(signal.SIGSTOP)
    try:
        quick = Client(store.address, timeout_s=0.5, transport="grpc")
        quick.wait_ready(timeout_s=10.0)
        with quick, pytest.raises(errors.DeadlineExceededError) as raised:
            quick.stats()
        assert _wire_status(raised.value)[0] == "DEADLINE_EXCEEDED"

        async def async_stats() -> None:
            async with AsyncClient(store.address, timeout_s=0.5, transport="grpc") as c:
                await c.stats()

        with pytest.raises(errors.DeadlineExceededError):
            asyncio.run(async_stats())
    finally:
        store.proc.send_signal(signal.SIGCONT)
    assert client.health()


def test_a_dead_node_gives_unavailable(store, client):
    store.kill()
    with pytest.raises(errors.UnavailableError) as raised:
        client.stats()
    assert _wire_status(raised.value)[0] == "UNAVAILABLE"
