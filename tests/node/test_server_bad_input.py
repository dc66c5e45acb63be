"""Bad input against a real server: a typed error, nothing changed, still serving."""

from __future__ import annotations

import asyncio
import re

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.client.async_client import AsyncClient
from kvstore.client.common import raise_rpc_error
from kvstore.grpc_service import SERVICE
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import NO_RESERVATION, PutStatus

NS = Namespace("llama-test", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
UNKNOWN_NS = Namespace("never-registered", KVLayout("float16", 4, 2, 64, 16))
MAX_BATCH_KEYS = 64  # the `store` fixture's limit


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _block(fill: int, nbytes: int = NS.block_bytes) -> bytes:
    return bytes([fill]) * nbytes


@pytest.fixture
def client(store):
    with Client(store.address, timeout_s=10.0, max_message_bytes=64 << 20) as c:
        c.register_namespace(NS)
        keys = _chain(4, seed=99)
        c.put_chain(NS.id, keys, [_block(i) for i in range(4)])
        yield c


@pytest.fixture
def unchanged(client):
    """Asserts after the test that the store's state is as before and it still serves."""
    before = client.stats()
    yield
    after = client.stats()
    assert after.num_blocks == before.num_blocks
    assert after.num_reservations == before.num_reservations
    assert after.tiers == before.tiers
    assert after.blocks_committed == before.blocks_committed
    assert client.health()
    keys = _chain(2, seed=7)
    assert client.put_chain(NS.id, keys, [_block(7), _block(8)]).num_stored == 2
    assert [bytes(b) for b in client.get(NS.id, keys).blocks] == [_block(7), _block(8)]
    client.remove(NS.id, keys)


def test_payload_larger_than_block_size(client, unchanged):
    [key] = _chain(1)
    with pytest.raises(errors.PayloadSizeError, match="block size"):
        client.put(NS.id, [key], [_block(1, NS.block_bytes + 1)])
    assert client.match(NS.id, [key]).num_matched == 0


def test_payload_smaller_than_block_size(client, unchanged):
    [key] = _chain(1)
    with pytest.raises(errors.IncompleteWriteError, match="not fully written"):
        client.put(NS.id, [key], [_block(1, NS.block_bytes - 1)])
    assert client.match(NS.id, [key]).num_matched == 0


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_key_of_wrong_length(client, unchanged, length):
    with pytest.raises(errors.BadKeyError, match="32"):
        client.put(NS.id, [b"k" * length], [_block(1)])
    with pytest.raises(errors.BadKeyError):
        client.match(NS.id, [_chain(1)[0], b"k" * length])


@pytest.mark.parametrize("op", ["match", "get", "remove", "reserve"])
def test_empty_keys(client, unchanged, op):
    with pytest.raises(errors.EmptyRequestError):
        getattr(client, op)(NS.id, [])


def test_duplicate_keys_in_one_call(client, unchanged):
    key = _chain(1)[0]
    with pytest.raises(errors.DuplicateKeyError):
        client.put(NS.id, [key, key], [_block(1), _block(1)])
    with pytest.raises(errors.DuplicateKeyError):
        client.get(NS.id, [key, key])


def test_batch_over_configured_maximum(client, unchanged):
    keys = _chain(MAX_BATCH_KEYS + 1)
    with pytest.raises(errors.BatchTooLargeError, match=str(MAX_BATCH_KEYS)):
        client.match(NS.id, keys)
    with pytest.raises(errors.BatchTooLargeError):
        client.reserve(NS.id, keys)
    assert client.match(NS.id, keys[:MAX_BATCH_KEYS]).num_matched == 0


def test_commit_of_unknown_reservation(client, unchanged):
    with pytest.raises(errors.UnknownReservationError):
        client.commit(123456789)
    with pytest.raises(errors.UnknownReservationError):
        client.write(123456789, [(0, _block(1))])
    with pytest.raises(errors.UnknownReservationError):
        client.abort(123456789)


def test_commit_twice(client):
    keys = _chain(1, seed=5)
    res = client.reserve(NS.id, keys)
    client.write(res.reservation_id, [(0, _block(5))])
    assert client.commit(res.reservation_id) == 1
    with pytest.raises(errors.UnknownReservationError):
        client.commit(res.reservation_id)
    assert client.stats().blocks_committed == 5
    assert bytes(client.get(NS.id, keys).blocks[0]) == _block(5)


@pytest.mark.parametrize("op", ["match", "get", "remove", "reserve"])
def test_unknown_namespace(client, unchanged, op):
    with pytest.raises(errors.UnknownNamespaceError, match="register"):
        getattr(client, op)(UNKNOWN_NS.id, _chain(1))


def test_invalid_namespace_registration(client, unchanged):
    bad = Namespace("ok", KVLayout("float16", 4, 2, 64, 16))
    object.__setattr__(bad.layout, "dtype", "float13")  # bypass the client-side check
    with pytest.raises(errors.InvalidArgumentError, match="dtype"):
        client.register_namespace(bad)


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [
        ("dtype", "float16" * 5, "dtype has 35 bytes; the limit is 32 (max_dtype_bytes)"),
        ("model_id", "m" * 300, "model_id has 300 bytes; the limit is 256"),
        ("tenant_salt", b"s" * 100, "tenant_salt has 100 bytes; the limit is 64"),
        ("num_layers", 2**32 - 1, "num_layers is 4294967295; the limit is 1024"),
    ],
)
def test_namespace_field_over_its_limit(client, unchanged, field, value, what):
    bad = Namespace("ok", KVLayout("float16", 4, 2, 64, 16))
    target = bad if field in ("model_id", "tenant_salt") else bad.layout
    object.__setattr__(target, field, value)  # bypass the client-side checks
    with pytest.raises(errors.FieldTooLargeError, match=re.escape(what)):
        client.register_namespace(bad)
    assert client.stats().num_namespaces == 1


def test_oversize_message(store, client, unchanged):
    keys = _chain(1, seed=11)
    res = client.reserve(NS.id, keys)
    assert res.statuses == (PutStatus.RESERVED,)
    big = Client(store.address, chunk_bytes=16 << 20, max_message_bytes=64 << 20)
    with big, pytest.raises(errors.ResourceExhaustedError, match="larger than"):
        big.write(res.reservation_id, [(0, _block(1, 9 << 20))])
    client.abort(res.reservation_id)


def test_puts_of_present_keys_leave_no_open_reservation(client, unchanged):
    keys = _chain(4, seed=99)  # the fixture's chain
    for _ in range(200):
        res = client.reserve(NS.id, keys, [None, *keys[:-1]])
        assert res == (NO_RESERVATION, (PutStatus.PRESENT,) * 4)
        assert client.put_chain(NS.id, keys, [_block(i) for i in range(4)]).num_present == 4
    assert client.stats().num_reservations == 0


def test_commit_and_abort_of_no_reservation_send_nothing():
    with Client("127.0.0.1:1", timeout_s=0.5) as nowhere:  # no server: any call would fail
        assert nowhere.commit(NO_RESERVATION) == 0
        nowhere.abort(NO_RESERVATION)

    async def run() -> None:
        async with AsyncClient("127.0.0.1:1", timeout_s=0.5) as nowhere:
            assert await nowhere.commit(NO_RESERVATION) == 0
            await nowhere.abort(NO_RESERVATION)

    asyncio.run(run())


MALFORMED = b"\x0a\x05ab"  # field 1 says 5 bytes follow; 2 do: no message parses this


def _call_malformed(channel: grpc.Channel, method) -> grpc.RpcError:
    path = f"/{SERVICE.full_name}/{method.name}"
    with pytest.raises(grpc.RpcError) as info:
        if method.client_streaming:
            channel.stream_unary(path)(iter([MALFORMED]), timeout=10)
        elif method.server_streaming:
            list(channel.unary_stream(path)(MALFORMED, timeout=10))
        else:
            channel.unary_unary(path)(MALFORMED, timeout=10)
    return info.value


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_malformed_request_is_invalid_argument_with_one_log_line(store, unchanged, method):
    num_lines = len(store.log().splitlines())
    with grpc.insecure_channel(store.address) as channel:
        err = _call_malformed(channel, method)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"not a valid {method.input_type.name}" in err.details()
    with pytest.raises(errors.InvalidArgumentError):
        raise_rpc_error(err)
    new_lines = store.log().splitlines()[num_lines:]
    assert len(new_lines) == 1, new_lines
    assert f"event=malformed_request method={method.name}" in new_lines[0]


def test_a_malformed_health_watch_is_invalid_argument_and_health_still_answers(store):
    """The health service's stream is served through the same checks and stream slots."""
    with grpc.insecure_channel(store.address) as channel:
        path = "/grpc.health.v1.Health/Watch"
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream(path)(MALFORMED, timeout=10))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_a_malformed_chunk_ends_a_write_stream_and_undoes_its_half_block(store, client):
    keys = _chain(1, seed=21)
    with grpc.insecure_channel(store.address) as channel:  # one client: the owner throughout
        stub = pb_grpc.KVStoreStub(channel)
        rid = stub.Reserve(pb.ReserveRequest(namespace_id=NS.id, keys=keys)).reservation_id
        half = pb.WriteChunk(reservation_id=rid, index=0, offset=0, data=_block(3)[:1000])
        num_lines = len(store.log().splitlines())
        write = channel.stream_unary(f"/{SERVICE.full_name}/Write")
        with pytest.raises(grpc.RpcError) as info:
            write(iter([half.SerializeToString(), MALFORMED]), timeout=10)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert len(store.log().splitlines()) == num_lines + 1
        whole = pb.WriteChunk(reservation_id=rid, index=0, offset=0, data=_block(3))
        stub.Write(iter([whole]))  # from offset 0 again: the half block was undone
        assert stub.Commit(pb.CommitRequest(reservation_id=rid)).num_committed == 1
    assert bytes(client.get(NS.id, keys).blocks[0]) == _block(3)


def test_a_reservation_is_its_owners_alone(store, client):
    """Reservation ids are small integers: another client that names one gets NOT_FOUND for
    write, commit and abort alike, and the owner's put lands exactly its own bytes."""
    keys = _chain(2, seed=42)
    reserved = client.reserve(NS.id, keys)
    with Client(store.address, timeout_s=10.0) as other:
        for call in (
            lambda: other.write(reserved.reservation_id, [(0, _block(7)), (1, _block(7))]),
            lambda: other.commit(reserved.reservation_id),
            lambda: other.abort(reserved.reservation_id),
        ):
            with pytest.raises(errors.UnknownReservationError):
                call()
    client.write(reserved.reservation_id, [(0, _block(1)), (1, _block(2))])
    assert client.commit(reserved.reservation_id) == 2
    assert [bytes(b) for b in client.get(NS.id, keys).blocks] == [_block(1), _block(2)]
    assert client.stats().num_reservations == 0
