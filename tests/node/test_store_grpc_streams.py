"""The store's gRPC streams against faulty clients, over a real in-process server.

Write is all or nothing per block: a stream leaves no block half written, however it ends.
Get sends the committed bytes of the keys asked for, or fails: never what reused a slot.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.client.common import raise_rpc_error
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store import Reservation, StoreConfig

NS = Namespace("stream-model", KVLayout("float16", 2, 2, 16, 16))  # 4 KiB blocks
BLOCK = NS.block_bytes
HALF = BLOCK // 2


def _block(fill: int) -> bytes:
    return bytes([fill]) * BLOCK


def _chunk(rid: int, index: int, offset: int, data: bytes) -> pb.WriteChunk:
    return pb.WriteChunk(reservation_id=rid, index=index, offset=offset, data=data)


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    config = ServerConfig(port=0, dataplane="none", chunk_bytes=HALF)
    with EmbeddedServer(StoreConfig(dram_bytes=64 * BLOCK, slab_bytes=8 * BLOCK), config) as s:
        yield s


@pytest.fixture
def client(server: EmbeddedServer) -> Iterator[Client]:
    with Client(server.address, timeout_s=10.0, transport="grpc") as c:
        c.register_namespace(NS)
        yield c


def _reserve_two(client: Client) -> tuple[list[bytes], int]:
    keys = block_keys(NS, list(range(2 * NS.block_tokens)))
    return keys, client.reserve(NS.id, keys, [None, keys[0]]).reservation_id


def _finish_and_check(client: Client, keys: list[bytes], rid: int) -> None:
    """Block 0 was written whole by the failed stream; block 1 starts again at 0."""
    with pytest.raises(errors.InvalidArgumentError, match=f"expected {BLOCK}"):
        client.write(rid, [(0, _block(9))])  # it stayed written
    client.write(rid, [(1, _block(2))])
    assert client.commit(rid) == 2
    assert [bytes(b) for b in client.get(NS.id, keys).blocks] == [_block(1), _block(2)]
    assert client.stats().num_reservations == 0


def test_a_stream_that_fails_on_a_bad_chunk_undoes_its_half_written_blocks(client):
    keys, rid = _reserve_two(client)
    chunks = [
        _chunk(rid, 0, 0, _block(1)),
        _chunk(rid, 1, 0, _block(7)[:HALF]),
        _chunk(rid, 1, HALF + 1, b"x"),  # out of order
    ]
    with pytest.raises(grpc.RpcError) as info:
        client._stubs["store"].Write(iter(chunks))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    _finish_and_check(client, keys, rid)


def test_a_stream_the_client_cancels_undoes_its_half_written_blocks(client, monkeypatch):
    keys, rid = _reserve_two(client)
    landed, rewound, unblock = threading.Event(), threading.Event(), threading.Event()
    real_write, real_rewind = Reservation.write, Reservation.rewind

    def write(res, index, offset, data):  # type: ignore[no-untyped-def]
        real_write(res, index, offset, data)
        if index == 1:
            landed.set()

    def rewind(res, index, offset):  # type: ignore[no-untyped-def]
        real_rewind(res, index, offset)
        rewound.set()

    monkeypatch.setattr(Reservation, "write", write)
    monkeypatch.setattr(Reservation, "rewind", rewind)

    def chunks() -> Iterator[pb.WriteChunk]:
        yield _chunk(rid, 0, 0, _block(1))
        yield _chunk(rid, 1, 0, _block(7)[:HALF])
        unblock.wait(timeout=30)  # the client goes away with block 1 half sent

    call = client._stubs["store"].Write.future(chunks())
    assert landed.wait(timeout=30)
    call.cancel()
    unblock.set()
    assert rewound.wait(timeout=30)
    _finish_and_check(client, keys, rid)


def test_a_stream_that_ends_with_a_block_half_sent_leaves_it_as_it_was(client):
    keys, rid = _reserve_two(client)
    client._stubs["store"].Write(
        iter([_chunk(rid, 0, 0, _block(1)), _chunk(rid, 1, 0, _block(7)[:HALF])])
    )
    _finish_and_check(client, keys, rid)


BIG_NS = Namespace("stream-big", KVLayout("float16", 4, 4, 64, 16))  # 64 KiB blocks
NUM_BIG = 64  # 4 MiB in all: far more than a stalled stream's flow-control window


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _big_payloads(fill: int) -> list[bytes]:
    return [bytes([fill, i]) * (BIG_NS.block_bytes // 2) for i in range(NUM_BIG)]


def test_a_reader_stalled_past_its_lease_gets_an_error_never_another_writers_bytes():
    clock = FakeClock()
    store_config = StoreConfig(
        dram_bytes=NUM_BIG * BIG_NS.block_bytes,  # the rewrite must reuse every slot
        slab_bytes=16 * BIG_NS.block_bytes,
        lease_timeout_s=5.0,
    )
    config = ServerConfig(port=0, dataplane="none", chunk_bytes=16 << 10)
    keys = block_keys(BIG_NS, list(range(NUM_BIG * BIG_NS.block_tokens)))
    parents = [None, *keys[:-1]]
    original, foreign = _big_payloads(1), _big_payloads(2)
    with EmbeddedServer(store_config, config, clock=clock) as server:
        writer = Client(server.address, timeout_s=10.0, transport="grpc")
        writer.register_namespace(BIG_NS)
        writer.put(BIG_NS.id, keys, original, parents)
        options = [("grpc.http2.bdp_probe", 0)]  # the reader's window stays small
        with grpc.insecure_channel(server.address, options=options) as channel:
            stream = pb_grpc.KVStoreStub(channel).Get(
                pb.GetRequest(namespace_id=BIG_NS.id, keys=keys), timeout=30
            )
            assert next(stream).header.found == [True] * NUM_BIG
            next(stream)  # the reader stalls here
            clock.now += 10  # past the lease
            assert writer.remove(BIG_NS.id, keys) == NUM_BIG
            assert writer.put(BIG_NS.id, keys, foreign, parents).num_stored == NUM_BIG
            received = 0
            with pytest.raises(grpc.RpcError) as info:
                for msg in stream:
                    chunk = msg.chunk
                    want = original[chunk.index][chunk.offset : chunk.offset + len(chunk.data)]
                    assert chunk.data == want, "a reader got another writer's bytes"
                    received += 1
        assert info.value.code() is grpc.StatusCode.ABORTED
        with pytest.raises(errors.LeaseExpiredError):
            raise_rpc_error(info.value)
        assert received < NUM_BIG * 4 - 1
        assert server.store.stats().num_leases == 0
        assert [bytes(b) for b in writer.get(BIG_NS.id, keys).blocks] == foreign
        writer.close()
