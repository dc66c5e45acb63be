"""Readers that stop reading, against a real `kvstore serve`: what they make the node hold is
bounded per stream, per client and in all; their streams are ended at the stall deadline
(leases freed); other clients are served meanwhile; and every server-streaming RPC the node
serves takes part (a streaming method added later must be listed here, or this fails)."""

from __future__ import annotations

import re
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.bench.attacks import attack
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import free_port, wait_until

MALLORY, ALICE = "m" * 24, "a" * 24
PER_CLIENT, IN_ALL, STALL_S = 4, 8, 1.0
# What one stalled Get stream may hold: a few copies of one 1 MiB chunk (the chunk, its
# message, its serialized bytes, the transport's frames), doubled; and what the allocator
# keeps of the refused calls. Unbounded, 200 such streams grew the node by about 1.5 GiB.
HELD_PER_STREAM, SLACK = 8 << 20, 16 << 20
NS = Namespace("fresh", KVLayout("float16", 2, 8, 64, 16))  # 64 KiB blocks


@pytest.fixture
def node(store_factory, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"mallory {MALLORY}\nalice {ALICE}\n")
    metrics_port = free_port()
    store = store_factory(
        "--dram-bytes", "256MiB", "--slab-bytes", "4MiB", "--auth-token-file", str(tokens),
        "--max-streams-per-client", str(PER_CLIENT), "--max-streams", str(IN_ALL),
        "--stream-stall-timeout-s", str(STALL_S), "--metrics-port", str(metrics_port),
        client={"auth_token": ALICE},
    )  # fmt: skip
    store.metrics_port = metrics_port
    return store


def _rss_bytes(store) -> int:
    with open(f"/proc/{store.proc.pid}/status") as status:
        kib = next(line for line in status if line.startswith("VmRSS:")).split()[1]
    return int(kib) << 10


def _metric(store, name: str) -> float:
    url = f"http://127.0.0.1:{store.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(rf'^{name}(?:_total)?{{service="kvstore"}} (\S+)$', text, re.M)
    assert found, f"{name} not exported"
    return float(found.group(1))


def _served(address: str) -> None:
    """Alice puts and reads back blocks over gRPC and the data plane: exact bytes."""
    keys = block_keys(NS, list(range(4 * NS.block_tokens)))
    blocks = [np.full(NS.block_bytes, i + 1, np.uint8) for i in range(4)]
    for transport in ("grpc", "auto"):
        with Client(address, transport=transport, timeout_s=10.0, auth_token=ALICE) as client:
            ns_id = client.register_namespace(NS).namespace_id
            client.put(ns_id, keys, blocks)
            got = client.get(ns_id, keys).blocks
            assert [bytes(b) for b in got] == [b.tobytes() for b in blocks]


def test_stalled_readers_hold_a_bounded_footprint_and_others_are_served(node):
    """Mallory opens 200 Get streams of 8 x 2 MiB blocks and reads none: she holds at most
    PER_CLIENT of them (her others are refused), they end at the stall deadline with their
    leases, the node grows by what PER_CLIENT streams hold (21-23 MiB measured) where
    unbounded it grows by about 1.5 GiB, and Alice is served throughout."""
    with attack("stalled-readers", node.address, 0, "--token", MALLORY):
        pass  # her blocks are in: the attack below puts nothing new
    rss_before = _rss_bytes(node)
    with attack("stalled-readers", node.address, 200, "--channels", "4", "--token", MALLORY):
        wait_until(lambda: _metric(node, "kvstore_stalled_streams") >= PER_CLIENT, 30.0, "stalls")
        assert _metric(node, "kvstore_open_streams") <= PER_CLIENT  # held until she reads
        assert _metric(node, "kvstore_refused_streams") >= 200 - PER_CLIENT
        grown = _rss_bytes(node) - rss_before
        assert grown < PER_CLIENT * HELD_PER_STREAM + SLACK, f"grew {grown >> 20} MiB"
        with Client(node.address, transport="grpc", auth_token=ALICE) as alice:
            wait_until(lambda: alice.stats().num_leases == 0, 30.0, "stalled leases freed")
        _served(node.address)
        mallory = Client(node.address, transport="grpc", auth_token=MALLORY)
        with mallory, pytest.raises(errors.TooManyStreamsError, match="max_streams_per_client"):
            mallory.get(b"\0" * 32, [b"\1" * 32])
    wait_until(lambda: _metric(node, "kvstore_open_streams") == 0, 30.0, "slots given back")


def _get_request(channel: grpc.Channel, ns_id: bytes) -> object:
    stub = pb_grpc.KVStoreStub(channel)
    keys = block_keys(NS, list(range(64 * NS.block_tokens)))
    return stub.Get(
        pb.GetRequest(namespace_id=ns_id, keys=keys),
        metadata=[("authorization", f"Bearer {ALICE}")],
    )


def _watch(channel: grpc.Channel, ns_id: bytes) -> object:
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())


# Every server-streaming method the node serves, and a call of it that streams.
STREAMING = {"kvstore.v1.KVStore.Get": _get_request, "grpc.health.v1.Health.Watch": _watch}


def _served_streaming_methods() -> set[str]:
    services = [
        pb.DESCRIPTOR.services_by_name["KVStore"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
    ]
    return {m.full_name for s in services for m in s.methods if m.server_streaming}


def test_every_server_streaming_rpc_is_listed_here():
    assert _served_streaming_methods() == set(STREAMING)


@pytest.mark.parametrize("method", sorted(STREAMING))
def test_every_server_streaming_rpc_is_bounded_per_client(node, method):
    """One client holds PER_CLIENT streams of the method open; the next is refused with
    RESOURCE_EXHAUSTED (TooManyStreamsError), and once they end it may open one again."""
    keys = block_keys(NS, list(range(64 * NS.block_tokens)))
    with Client(node.address, transport="grpc", auth_token=ALICE) as alice:
        ns_id = alice.register_namespace(NS).namespace_id
        alice.put(ns_id, keys, [np.zeros(NS.block_bytes, np.uint8)] * len(keys))
    options = [("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(node.address, options=options) as channel:
        held = [STREAMING[method](channel, ns_id) for _ in range(PER_CLIENT)]
        for call in held:
            next(call)  # open: its first message arrived
        extra = STREAMING[method](channel, ns_id)
        with pytest.raises(grpc.RpcError) as refused:
            for _ in extra:
                pass
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_client" in refused.value.details()
        for call in held:
            call.cancel()
        wait_until(lambda: _metric(node, "kvstore_open_streams") == 0, 30.0, "slots back")
        again = STREAMING[method](channel, ns_id)
        assert next(again) is not None
        again.cancel()
