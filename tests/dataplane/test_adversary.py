"""The UCX data plane against hostile and broken peers: malformed handshakes, forged,
replayed, truncated and oversized frames, connections that never speak, corrupted blocks.

After every case the node is alive, a well-behaved client's put/get round trip returns its
own bytes, and nothing leaks. A raw ucxx worker plays the adversary: it may do anything a
UCX peer can, but it never learns another connection's secret.
"""

from __future__ import annotations

import asyncio
import os
import re
import struct
import subprocess

import grpc
import numpy as np
import pytest

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.dataplane import frames
from kvstore.dataplane.frames import Kind, Op, Request, RequestTags, Tags
from kvstore.dataplane.ucx.runtime import UcxRuntime
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store.config import StoreConfig
from tests.conftest import require_extra, wait_until

require_extra("ucxx")

NS = Namespace("llama-adv", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks


def _chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, NS.block_bytes, dtype=np.uint8) for _ in range(n)]


@pytest.fixture
def node():
    config = ServerConfig(port=0, max_dataplane_connections_per_peer=4, transfer_timeout_s=5.0)
    with EmbeddedServer(StoreConfig(dram_bytes=64 << 20, slab_bytes=1 << 20), config) as server:
        yield server


def _stub(node) -> pb_grpc.KVStoreStub:
    return pb_grpc.KVStoreStub(grpc.insecure_channel(node.address))


def _handshake(node, address: bytes) -> pb.DataPlaneInfoResponse:
    request = pb.DataPlaneInfoRequest(transport="ucx", client_address=address)
    return _stub(node).DataPlaneInfo(request, timeout=30)


def _round_trip_works(node, seed: int) -> None:
    """A well-behaved client stores and reads back its own bytes over UCX."""
    keys, blocks = _chain(4, seed), _blocks(4, seed)
    with Client(node.address, timeout_s=10.0, transport="ucx") as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, keys, blocks)
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        assert client.get_into(NS.id, keys, out) == (True,) * 4
        assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        _wait_released(client)


def _wait_released(client: Client) -> None:
    """The node ends a get's lease once its sends complete, just after the client has the
    bytes: wait (bounded) for that; then nothing may be left open."""
    stats = wait_until(lambda: (st := client.stats()).num_leases == 0 and st, 10.0, "leases end")
    assert stats.num_reservations == 0


class Adversary:
    """A raw UCX worker with one endpoint to the node, sending whatever it likes."""

    def __init__(self, node) -> None:
        self.rt = UcxRuntime("adversary", {"NET_DEVICES": "lo"})
        reply = _handshake(node, self.rt.worker_address)
        self.own_tags = Tags(reply.connection_secret)
        self.client_id = reply.client_id
        self.ep = self.rt.call(self._connect(reply.server_address), 10.0)

    async def _connect(self, address: bytes):
        ucx_address = self.rt.ucxx.get_ucx_address_from_buffer(address)
        return await self.rt.ctx.create_endpoint_from_worker_address(
            ucx_address, endpoint_error_handling=False
        )

    def send(self, data: bytes, tag: int) -> None:
        self.rt.call(self.ep.send(np.frombuffer(data, np.uint8), tag=tag, force_tag=True), 10.0)

    def close(self) -> None:
        # Aborted on its own loop first: an endpoint left for the garbage collector would
        # block the collecting thread on a close that a stopped worker never completes.
        self.rt.loop.call_soon_threadsafe(lambda: self.ep.abort(period=10**8))
        self.rt.stop()


@pytest.fixture
def adversary(node):
    adv = Adversary(node)
    yield adv
    adv.close()


@pytest.mark.parametrize("size", [1, 8, 200, 4096])
def test_random_client_address_is_refused_and_node_keeps_serving(node, size):
    with pytest.raises(grpc.RpcError) as err:
        _handshake(node, os.urandom(size))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a UCX worker address" in err.value.details()
    _round_trip_works(node, seed=size)


def test_oversized_and_empty_client_address_are_refused(node):
    for address in (b"", b"x" * 9000):
        with pytest.raises(grpc.RpcError) as err:
            _handshake(node, address)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "client_address has" in err.value.details()


def test_mutated_real_address_never_stops_the_node(node):
    worker = UcxRuntime("victim-worker", {"NET_DEVICES": "lo"})
    try:
        original = bytearray(worker.worker_address)
        rng = np.random.default_rng(0)
        for _ in range(8):
            mutated = bytearray(original)
            mutated[int(rng.integers(len(mutated)))] ^= 1 << int(rng.integers(8))
            try:
                _handshake(node, bytes(mutated))
            except grpc.RpcError as err:
                assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE)
            node.dataplanes["ucx"].reap(now=float("inf"))  # the accepted ones never speak
            _wait_connections(node, 0)
        _round_trip_works(node, seed=11)
    finally:
        worker.stop()


def test_handshakes_that_never_connect_are_reaped(node):
    """A valid address whose worker never sends a frame holds a connection only until the
    hello deadline; per-peer limits bound how many it can hold meanwhile."""
    silent = [UcxRuntime(f"silent-{i}", {"NET_DEVICES": "lo"}) for i in range(5)]
    try:
        for rt in silent[:4]:
            _handshake(node, rt.worker_address)
        assert node.dataplanes["ucx"].num_connections == 4
        with pytest.raises(grpc.RpcError) as err:
            _handshake(node, silent[4].worker_address)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_dataplane_connections_per_peer=4" in err.value.details()
        assert node.dataplanes["ucx"].reap() == 0  # nothing is late yet
        assert node.dataplanes["ucx"].reap(now=float("inf")) == 4
        _wait_connections(node, 0)
        _round_trip_works(node, seed=12)  # room again
    finally:
        for rt in silent:
            rt.stop()


def _wait_connections(node, expected: int) -> None:
    """Drops run on the data plane's loop: wait (bounded) until they have."""
    future = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), node.dataplanes["ucx"]._rt.loop)
    future.result(timeout=10)
    assert node.dataplanes["ucx"].num_connections == expected


def test_forged_frames_never_reach_another_connection(node, adversary):
    """The adversary knows the victim's connection id and request ids (they are small
    integers) and sends GET frames under every tag the old, id-based layout would have
    used, and under a guessed secret: the victim still reads exactly its own bytes."""
    victim_keys, victim_blocks = _chain(4, 20), _blocks(4, 20)
    adv_keys, adv_blocks = _chain(4, 21), _blocks(4, 21)
    with Client(node.address, timeout_s=10.0, transport="ucx") as victim:
        victim.register_namespace(NS)
        victim.put_chain(NS.id, victim_keys, victim_blocks)
        victim.put_chain(NS.id, adv_keys, adv_blocks)
        victim_id = victim.data_plane().client_id
        forged = frames.encode_request(Request(Op.GET, 5, NS.id, tuple(adv_keys), NS.block_bytes))
        guessed = Tags(bytes(16))
        for request_id in range(1, 12):
            old_layout = (Kind.REQUEST << 60) | (victim_id << 40) | (request_id << 16)
            adversary.send(forged, old_layout)
            adversary.send(forged, guessed.request)
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in victim_keys]
        for _ in range(3):
            assert victim.get_into(NS.id, victim_keys, out) == (True,) * 4
            assert all((o == b).all() for o, b in zip(out, victim_blocks, strict=True))
    _round_trip_works(node, seed=22)


@pytest.mark.parametrize("damage", ["truncated", "extended", "bit_flip", "oversized", "garbage"])
def test_bad_frame_ends_only_its_own_connection(node, adversary, damage):
    """A frame under the adversary's own tag that is short, long, altered or larger than
    the node's buffer: that connection ends with one log line, everyone else is served."""
    good = frames.encode_request(Request(Op.GET, 1, NS.id, tuple(_chain(2, 30)), NS.block_bytes))
    bad = {
        "truncated": good[:-9],
        "extended": good + b"\1" * 32,
        "bit_flip": good[:40] + bytes([good[40] ^ 1]) + good[41:],
        "oversized": good + os.urandom(frames.request_bytes(4096) + 64),
        "garbage": os.urandom(len(good)),
    }[damage]
    before = node.dataplanes["ucx"].num_connections
    adversary.send(bad, adversary.own_tags.request)
    _wait_until_dropped(node, before - 1)
    _round_trip_works(node, seed=31)


def _wait_until_dropped(node, expected: int) -> None:
    wait_until(
        lambda: node.dataplanes["ucx"].num_connections <= expected, 10.0, "bad connection drops"
    )


def test_replayed_request_id_in_flight_ends_the_connection(node, adversary):
    """Two requests with one id in flight would share tags: the node refuses the second."""
    keys = _chain(2, 40)
    with Client(node.address, timeout_s=10.0, transport="grpc") as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, keys, _blocks(2, 40))
    frame = frames.encode_request(Request(Op.GET, 7, NS.id, tuple(keys), NS.block_bytes))
    before = node.dataplanes["ucx"].num_connections
    adversary.send(frame, adversary.own_tags.request)  # replies are never received: in flight
    adversary.send(frame, adversary.own_tags.request)
    _wait_until_dropped(node, before - 1)
    _round_trip_works(node, seed=41)


def test_reply_tags_depend_on_the_secret_not_the_ids():
    a, b = Tags(b"a" * 16), Tags(b"b" * 16)
    assert a.request != b.request
    assert RequestTags.of(a, 1).reply != RequestTags.of(b, 1).reply
    assert RequestTags.of(a, 1).block(3) == RequestTags.of(a, 1).block(0) | 3
    assert RequestTags.of(a, 1).reply != RequestTags.of(a, 2).reply


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
def test_corrupted_block_is_never_accepted_by_the_client(node, transport):
    """The node does not re-sum DRAM blocks on reads by default: the client checks each
    block against the CRC32C its reply carries, and reports a bad one as missed."""
    keys, blocks = _chain(3, 50), _blocks(3, 50)
    with Client(node.address, timeout_s=10.0, transport=transport) as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, keys, blocks)
        lease = node.store.acquire(NS.id, keys[1:2])
        lease.views[0][100] ^= 0xFF  # flip a byte behind the store's back
        lease.release()
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        assert client.get_into(NS.id, keys, out) == (True, False, True)
        assert (out[0] == blocks[0]).all() and (out[2] == blocks[2]).all()
        assert client.get(NS.id, keys).found == (True, False, True)
        if transport == "ucx":
            assert client.data_plane().checksum_failures == 1
            # Received in parts, the block's sum runs over them: still refused, once whole.
            parts = [[np.zeros(NS.block_bytes // 4, np.uint8) for _ in keys] for _ in range(4)]
            got = client.data_plane().submit_get_parts(NS.id, keys, parts, NS.block_bytes)
            assert got.result(timeout=10) == (True, False, True)
            assert client.data_plane().checksum_failures == 2


def test_frames_decode_exactly():
    req = Request(Op.PUT, 9, NS.id, tuple(_chain(3, 60)), NS.block_bytes, None, (1, 2, 3))
    data = frames.encode_request(req)
    assert frames.decode_request(memoryview(bytearray(data) + bytes(100))) == req
    too_long = data + b"\1"
    for bad in (data[:-1], data[:12], data[:4] + bytes(len(data) - 4), bytes(len(data)), too_long):
        with pytest.raises(errors.InvalidArgumentError):
            frames.decode_request(memoryview(bytearray(bad)))
    # A frame that seals a body of the wrong length for its key count.
    body = bytearray(data[4:-4])
    struct.pack_into("<I", body, 1, 4)  # claims 4 keys, carries 3
    with pytest.raises(errors.InvalidArgumentError, match="needs"):
        frames.decode_request(memoryview(bytearray(frames.seal(bytes(body)))))


def test_loopback_node_listens_on_loopback_only(node):
    """With --host 127.0.0.1 the node's UCX worker (and gRPC) listen on loopback only."""
    _round_trip_works(node, seed=70)
    listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
    mine = [line for line in listening.splitlines() if f"pid={os.getpid()}," in line]
    assert mine, "this process listens nowhere?"
    local = [re.split(r"\s+", line)[3] for line in mine]
    assert [a for a in local if not a.startswith(("127.", "[::1]", "[::ffff:127."))] == [], local
