"""Sockets that never say hello, against a real `kvstore serve`: a flood of them from the
client's own address, reopened as fast as the node closes them, never makes an admitted
client fail to get onto the data plane. Every plane that accepts sockets takes part (a plane
added later is in `SERVERS` and is picked up here); a plane that accepts none makes its
connections in the authenticated handshake only."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest

from kvstore.bench.attacks import attack
from kvstore.client import Client
from kvstore.dataplane.servers import SERVERS
from kvstore.dataplane.sockets.server import SocketServer
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import free_port

NS = Namespace("admitted", KVLayout("float16", 2, 8, 64, 16))  # 64 KiB blocks
LISTENING = sorted(name for name, server in SERVERS.items() if issubclass(server, SocketServer))  # type: ignore[arg-type]
PER_PEER, IN_ALL, FLOOD = 8, 16, 64


def test_every_plane_either_bounds_its_sockets_here_or_accepts_none():
    """A plane that is no `SocketServer` accepts no socket: its connections are made by the
    node, for an authenticated handshake (UCX endpoints)."""
    assert set(LISTENING) == {"shm", "tcp"}
    others = [server for name, server in SERVERS.items() if name not in LISTENING]
    assert all(server.unproven.fget(None) is None for server in others)  # type: ignore[attr-defined]


@pytest.fixture
def node(store_factory):
    metrics_port = free_port()
    store = store_factory(
        "--dram-bytes", "64MiB", "--slab-bytes", "4MiB", "--dataplane", "auto",
        "--max-unproven-sockets-per-peer", str(PER_PEER), "--max-unproven-sockets", str(IN_ALL),
        "--metrics-port", str(metrics_port),
    )  # fmt: skip
    store.metrics_port = metrics_port
    return store


def _target(address: str, plane: str) -> str:
    """Where the plane listens, as `kvstore.bench.attacks` names it (learned as a client does)."""
    with Client(address, transport="grpc") as client:
        server_address, _ = client._handshake(plane, b"")
    if plane == "shm":
        return "@" + server_address[1:].decode()
    return server_address.decode()


def _shed(store, plane: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics") as reply:
        text = reply.read().decode()
    found = re.search(rf'^kvstore_shed_sockets_total{{plane="{plane}"}} (\S+)$', text, re.M)
    assert found, "kvstore_shed_sockets not exported"
    return float(found.group(1))


@pytest.mark.parametrize("plane", LISTENING)
def test_a_flood_of_silent_sockets_never_fails_an_admitted_client(node, plane):
    keys = block_keys(NS, list(range(4 * NS.block_tokens)))
    blocks = [np.full(NS.block_bytes, i + 7, np.uint8) for i in range(4)]
    with attack("silent-sockets", _target(node.address, plane), FLOOD) as ready:
        assert ready == f"ready sockets={FLOOD}"
        for _ in range(20):
            with Client(node.address, transport=plane, timeout_s=10.0) as client:
                ns_id = client.register_namespace(NS).namespace_id
                client.put(ns_id, keys, blocks)
                got = client.get(ns_id, keys).blocks
                assert [bytes(b) for b in got] == [b.tobytes() for b in blocks]
                assert client.plane == plane  # admitted: never fell back to gRPC
        assert _shed(node, plane) >= FLOOD - IN_ALL
