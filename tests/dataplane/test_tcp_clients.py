"""The TCP data plane (a stream socket per connection) against well-behaved clients: the
same bytes as the other paths, a partly present put that stores the rest, corrupted blocks
refused, refused calls that keep the stream in step; which plane "auto" takes (tcp where
ucxx is missing or the host has no RDMA device, ucx where the node serves no tcp), the tcp
settings checked at start, and a client on another host (a network namespace) that moves
its blocks over TCP.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvstore import errors
from kvstore.auth import ListenerSecurity
from kvstore.client import Client
from kvstore.dataplane.selection import network_planes
from kvstore.dataplane.tcp.client import TcpClient
from kvstore.dataplane.ucx.runtime import has_rdma_device
from kvstore.keys import block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.results import PutStatus
from kvstore.store.config import StoreConfig
from tests.dataplane import socket_planes as planes
from tests.dataplane import tcp_cases as cases
from tests.dataplane.socket_planes import NS

_chain, _blocks, _quiet = planes.chain, planes.blocks, planes.quiet
TCP = planes.Plane("tcp")
_client, _round_trip_works = TCP.client, TCP.round_trip_works
_node = cases._node
node = cases.node  # a fixture: this module's node


def test_a_partly_present_put_stores_the_rest_and_reads_what_it_drops(node):
    """Present blocks still travel (a put is eager) but are received into scratch: the
    stored ones are the new bytes, the present ones keep theirs, and the stream stays in
    step for the next call."""
    keys, blocks = _chain(4, 2), _blocks(4, 2)
    with _client(node) as client, _client(node, "grpc") as grpc_client:
        client.put_chain(NS.id, keys[:2], blocks[:2])
        altered = [b ^ 1 for b in blocks[:2]]  # what a re-put of present keys carries
        result = client.data_plane().put(NS.id, keys, [*altered, *blocks[2:]], None, NS.block_bytes)
        assert [s.name for s in result.statuses] == ["PRESENT", "PRESENT", "RESERVED", "RESERVED"]
        assert [bytes(b) for b in grpc_client.get(NS.id, keys).blocks] == [
            b.tobytes() for b in blocks
        ]
        _round_trip_works(node, seed=3)
        client.remove(NS.id, keys)
    _quiet(node)


def test_a_corrupted_block_is_never_accepted_by_the_client(node):
    planes.corrupted_block_is_refused(node, _client(node))


def test_refused_calls_get_typed_errors_and_the_connection_goes_on(node):
    keys, blocks = _chain(2, 4), _blocks(2, 4)
    with _client(node) as client:
        dp = client.data_plane()
        with pytest.raises(errors.UnknownNamespaceError):
            dp.put(b"\1" * 16, keys, blocks, None, NS.block_bytes)
        with pytest.raises(errors.UnknownNamespaceError):
            dp.get_into(b"\1" * 16, keys, blocks, NS.block_bytes)
        small = [b[: NS.block_bytes // 2] for b in blocks]
        with pytest.raises(errors.IncompleteWriteError):
            dp.put(NS.id, keys, small, None, NS.block_bytes // 2)
        with pytest.raises(errors.PayloadSizeError):
            dp.get_into(NS.id, keys, small, NS.block_bytes // 2)
        assert dp.is_open
        assert client.match(NS.id, keys).num_matched == 0
    _round_trip_works(node, seed=5)


def test_puts_of_mostly_present_blocks_and_of_new_ones_store_the_same_bytes(node):
    """A client whose put was mostly present waits for the statuses on its next put of
    that namespace (present blocks cost no bandwidth), then goes back to eager ones."""
    keys, blocks = _chain(8, 49), _blocks(8, 49)
    with _client(node) as client, _client(node, "grpc") as grpc_client:
        dp = client.data_plane()
        for upto, stored in ((4, 4), (5, 1), (6, 1), (8, 2), (8, 0)):
            result = dp.put(NS.id, keys[:upto], blocks[:upto], None, NS.block_bytes)
            assert result.statuses.count(PutStatus.RESERVED) == stored
        assert [bytes(b) for b in grpc_client.get(NS.id, keys).blocks] == [
            b.tobytes() for b in blocks
        ]
        client.remove(NS.id, keys)
    _quiet(node)


def test_auto_without_ucx_and_a_node_listening_everywhere(monkeypatch):
    """A client where ucxx is not installed takes the tcp plane ("auto": this node has no
    shm plane), and reaches a node listening on every interface at the host it reached
    gRPC at."""
    monkeypatch.setattr("kvstore.dataplane.selection.is_available", lambda: False)
    with _node(host="0.0.0.0") as server:
        assert server.dataplanes["tcp"].address.startswith(b"0.0.0.0:")
        port = server.address.rpartition(":")[2]
        with Client(f"127.0.0.1:{port}", transport="auto", timeout_s=10.0) as client:
            client.register_namespace(NS)
            keys, blocks = _chain(2, 6), _blocks(2, 6)
            assert client.put_chain(NS.id, keys, blocks).num_stored == 2
            assert isinstance(client.data_plane(), TcpClient)


def test_auto_tries_ucx_first_only_on_a_host_with_an_rdma_device():
    assert network_planes("auto", True, False) == ["tcp", "ucx"]
    assert network_planes("auto", True, True) == ["ucx", "tcp"]
    assert network_planes("auto", False, True) == ["tcp"]
    assert network_planes("ucx", True, False) == ["ucx"]
    assert network_planes("ucx", False, True) == []  # UnavailableError: ucxx is not here
    assert network_planes("tcp", True, True) == ["tcp"]


def test_an_rdma_device_is_one_the_kernel_lists(tmp_path):
    assert not has_rdma_device(str(tmp_path / "absent"))
    (tmp_path / "infiniband").mkdir()
    assert not has_rdma_device(str(tmp_path / "infiniband"))
    (tmp_path / "infiniband" / "mlx5_0").mkdir()
    assert has_rdma_device(str(tmp_path / "infiniband"))


def test_auto_without_rdma_still_takes_ucx_where_the_node_serves_no_tcp(monkeypatch):
    """TCP first, but a node that refuses it (no tcp plane) is reached over UCX, not
    left to gRPC."""
    monkeypatch.setattr("kvstore.dataplane.selection.has_rdma_device", lambda: False)
    config = ServerConfig(port=0, dataplane="ucx")
    store = StoreConfig(dram_bytes=64 << 20, slab_bytes=1 << 20, max_batch_keys=64)
    with (
        EmbeddedServer(store, config) as server,
        Client(server.address, transport="auto", timeout_s=10.0) as client,
    ):
        client.register_namespace(NS)
        keys, blocks = _chain(2, 8), _blocks(2, 8)
        assert client.put_chain(NS.id, keys, blocks).num_stored == 2
        assert client.plane == "ucx"


def test_the_tcp_settings_are_checked_at_start():
    with pytest.raises(errors.InvalidArgumentError, match="dataplane_tcp_port"):
        ServerConfig(dataplane_tcp_port=70000)
    with pytest.raises(errors.InvalidArgumentError, match="tcp"):
        ServerConfig(dataplane="tcpx")


# -- another host -------------------------------------------------------------------------


@pytest.fixture
def other_host():
    """A network namespace joined to this one by a veth pair: (the node's address on the
    link, the namespace). A process in it is another host to the node: it cannot reach the
    node's abstract Unix socket (shared memory), only its addresses."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a network namespace")
    tag = f"{os.getpid() % 10000}{secrets.token_hex(2)}"
    netns, near, far = f"kvs{tag}", f"kva{tag}", f"kvb{tag}"
    subnet = f"10.{os.getpid() % 200 + 20}.{secrets.randbelow(250) + 1}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    ip("netns", "add", netns)
    try:
        ip("link", "add", near, "type", "veth", "peer", "name", far)
        ip("link", "set", far, "netns", netns)
        ip("addr", "add", f"{subnet}.1/24", "dev", near)
        ip("link", "set", near, "up")
        ip("netns", "exec", netns, "ip", "addr", "add", f"{subnet}.2/24", "dev", far)
        ip("netns", "exec", netns, "ip", "link", "set", far, "up")
        ip("netns", "exec", netns, "ip", "link", "set", "lo", "up")
        yield f"{subnet}.1", netns
    finally:
        subprocess.run(["ip", "link", "del", near], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


_REMOTE_CLIENT = """
import sys
import numpy as np
from kvstore.client import Client
from kvstore.keys import block_keys
from tests.dataplane.socket_planes import NS as ns
keys = block_keys(ns, np.arange(8 * ns.block_tokens) + 77)
blocks = [np.full(ns.block_bytes, i + 1, np.uint8) for i in range(8)]
with Client(sys.argv[1], timeout_s=20.0, transport="auto") as client:
    client.register_namespace(ns)
    assert client.put_chain(ns.id, keys, blocks).num_stored == 8
    out = [np.zeros(ns.block_bytes, np.uint8) for _ in keys]
    assert client.get_into(ns.id, keys, out) == (True,) * 8
    assert all((o == b).all() for o, b in zip(out, blocks))
    print(client.plane)
"""


@pytest.mark.parametrize("dataplane", ["tcp", "auto"])
def test_a_client_on_another_host_moves_its_blocks_over_tcp(other_host, dataplane):
    """On another host "auto" is refused shared memory (the node's socket is out of reach)
    and, on a host with no RDMA device (this one), takes the TCP plane over UCX even where
    the node runs both ("auto"); the node holds exactly the bytes it sent."""
    host, netns = other_host
    config = ServerConfig(
        host=host, port=0, dataplane=dataplane, security=ListenerSecurity(insecure=True)
    )
    store = StoreConfig(dram_bytes=64 << 20, slab_bytes=1 << 20, max_batch_keys=64)
    with EmbeddedServer(store, config) as server:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        command = ["ip", "netns", "exec", netns, sys.executable, "-c", _REMOTE_CLIENT]
        done = subprocess.run(
            [*command, server.address], capture_output=True, text=True, timeout=120, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[-1] == "tcp"
        keys = block_keys(NS, np.arange(8 * NS.block_tokens) + 77)
        with Client(server.address, transport="grpc") as client:
            got = client.get(NS.id, keys).blocks
        assert [bytes(b) for b in got] == [bytes([i + 1]) * NS.block_bytes for i in range(8)]
