"""The TCP data plane (a stream socket per connection) against well-behaved clients and
hostile ones: the same bytes as the other paths, corrupted blocks refused, refusals that
keep the stream in step, and malformed hellos and calls answered with a typed error and the
connection closed while the node keeps serving, holding no lease or reservation it should
not. The adversary is a raw TCP socket speaking `socket_messages`; it never learns another
connection's secret.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore.auth import ListenerSecurity
from kvstore.checksum import checksum
from kvstore.client import Client
from kvstore.dataplane.frames import Op, Reply, Request
from kvstore.dataplane.selection import network_planes
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.dataplane.tcp.client import TcpClient
from kvstore.dataplane.ucx.runtime import has_rdma_device
from kvstore.keys import block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.results import PutStatus
from kvstore.store.config import StoreConfig
from tests.conftest import wait_until
from tests.dataplane import socket_planes as planes
from tests.dataplane.socket_planes import NS

_chain, _blocks, _quiet, _closed = planes.chain, planes.blocks, planes.quiet, planes.closed
_answer = planes.answer
TCP = planes.Plane("tcp")
_client, _round_trip_works = TCP.client, TCP.round_trip_works
_admission, _raw_socket = TCP.admission, TCP.raw_socket


def _node(host: str = "127.0.0.1") -> EmbeddedServer:
    config = ServerConfig(
        host=host,
        port=0,
        dataplane="tcp",
        max_dataplane_connections_per_peer=4,
        max_unproven_sockets_per_peer=4,
        dataplane_hello_timeout_s=2.0,
        transfer_timeout_s=2.0,
    )
    store = StoreConfig(dram_bytes=64 << 20, slab_bytes=1 << 20, max_batch_keys=64)
    return EmbeddedServer(store, config)


@pytest.fixture(scope="module")
def node():
    with _node() as server:
        with Client(server.address, transport="grpc") as client:
            client.register_namespace(NS)
        yield server


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
    keys, blocks = _chain(3, 3), _blocks(3, 3)
    with _client(node) as client:
        client.put_chain(NS.id, keys, blocks)
        lease = node.store.acquire(NS.id, keys[1:2])
        lease.views[0][100] ^= 0xFF  # flip a byte behind the store's back
        node.store.release(lease.lease_id)
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        assert client.get_into(NS.id, keys, out) == (True, False, True)
        assert (out[0] == blocks[0]).all() and (out[2] == blocks[2]).all()
        assert client.data_plane().checksum_failures == 1
        parts = [[np.zeros(NS.block_bytes // 4, np.uint8) for _ in keys] for _ in range(4)]
        got = client.data_plane().submit_get_parts(NS.id, keys, parts, NS.block_bytes)
        assert got.result(timeout=10) == (True, False, True)
        assert client.data_plane().checksum_failures == 2
        client.remove(NS.id, keys)


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


# -- hostile peers ------------------------------------------------------------------------


def _hello(node, secret: bytes | None = None) -> tuple[socket.socket, Reply | None]:
    admitted = _admission(node)
    sock = _raw_socket(node)
    secret = admitted.connection_secret if secret is None else secret
    socket_messages.send(sock, socket_messages.encode_hello(admitted.client_id, secret))
    return sock, _answer(sock)


@pytest.fixture
def hello(node):
    """A raw socket that said a proper hello."""
    sock, reply = _hello(node)
    assert reply is not None and reply.error is None
    yield sock
    sock.close()


def _call(sock: socket.socket, req: Request) -> None:
    socket_messages.send(sock, socket_messages.encode_call(req, (), placed=False))


def test_a_wrong_secret_is_refused_and_the_node_keeps_serving(node):
    sock, reply = _hello(node, b"x" * 16)
    assert reply is not None and isinstance(reply.error, errors.PermissionDeniedError)
    assert _closed(sock)
    sock.close()
    node.dataplanes["tcp"].reap(now=float("inf"))  # the admission it named, at its deadline
    _round_trip_works(node, seed=10)
    assert node.dataplanes["tcp"].num_connections == 0


def test_a_get_replies_then_sends_the_found_blocks_part_major(node, hello):
    keys, blocks = _chain(3, 40), _blocks(3, 40)
    with _client(node) as client:
        client.put_chain(NS.id, [keys[0], keys[2]], [blocks[0], blocks[2]])
    _call(hello, Request(Op.GET, 1, NS.id, tuple(keys), NS.block_bytes, segments=2))
    reply = _answer(hello, 3, True)
    assert reply.flags == (1, 0, 1)
    assert reply.checksums == (checksum(blocks[0]), checksum(blocks[2]))
    half = NS.block_bytes // 2
    wire = bytearray(2 * NS.block_bytes)
    view = memoryview(wire)
    while view:  # the stream after the reply: the found blocks' parts, part-major
        got = hello.recv_into(view)
        assert got, "the node closed the connection"
        view = view[got:]
    expected = b"".join(bytes(b[s * half : (s + 1) * half]) for s in range(2) for b in blocks[::2])
    assert bytes(wire) == expected
    _quiet(node)
    with _client(node, "grpc") as client:
        client.remove(NS.id, keys)


def test_a_put_whose_bytes_do_not_match_its_sums_is_not_committed(node, hello):
    """The node sums its own copy: blocks that differ from the sums behind them are
    refused whole, nothing is stored, and the stream stays in step."""
    keys, blocks = _chain(2, 45), _blocks(2, 45)
    sums = [checksum(b) for b in blocks]

    def put(request_id: int, sums_message: bytes, block_bytes: int = NS.block_bytes) -> Reply:
        eager = Request(Op.PUT, request_id, NS.id, tuple(keys), block_bytes, None, (0, 0), True)
        _call(hello, eager)
        hello.sendall(b"".join(bytes(b[:block_bytes]) for b in blocks))
        socket_messages.send(hello, sums_message)
        return _answer(hello, len(keys))

    assert isinstance(
        put(1, socket_messages.encode_sums(1, [sums[0], sums[1] ^ 1])).error,
        errors.ChecksumMismatchError,
    )
    assert "not 2" in str(put(2, socket_messages.encode_sums(99, sums)).error)  # another's sums
    short = put(3, socket_messages.encode_sums(3, sums), NS.block_bytes // 2)
    assert isinstance(short.error, errors.IncompleteWriteError)  # refused first, bytes read
    with _client(node, "grpc") as client:
        assert client.match(NS.id, keys).num_matched == 0
    assert put(4, socket_messages.encode_sums(4, sums)).flags == (0, 0)  # stored
    with _client(node, "grpc") as client:
        assert [bytes(b) for b in client.get(NS.id, keys).blocks] == [b.tobytes() for b in blocks]
        client.remove(NS.id, keys)
    _quiet(node)


def test_a_put_that_waits_for_its_statuses_sends_only_the_reserved_blocks(node, hello):
    """Not eager: the call carries the sums, the statuses come back first, only the
    reserved blocks follow, and DONE says whether they were committed."""
    keys, blocks = _chain(3, 48), _blocks(3, 48)
    with _client(node, "grpc") as client:
        client.put_chain(NS.id, keys[:1], blocks[:1])
    sums = tuple(checksum(b) for b in blocks)

    def put(request_id: int, wrong: int | None = None) -> tuple[Reply, Reply | None]:
        call = Request(Op.PUT, request_id, NS.id, tuple(keys), NS.block_bytes, None, sums)
        _call(hello, call)
        statuses = _answer(hello, len(keys))
        if statuses.error is not None:
            return statuses, None
        for i, status in enumerate(statuses.flags):
            if status == 0:  # reserved
                hello.sendall(bytes(blocks[i] ^ (i == wrong)))
        return statuses, _answer(hello)

    statuses, done = put(1, wrong=2)
    assert statuses.flags == (1, 0, 0)  # present, reserved, reserved
    assert isinstance(done.error, errors.ChecksumMismatchError)
    with _client(node, "grpc") as client:
        assert client.match(NS.id, keys).num_matched == 1
    statuses, done = put(2)
    assert statuses.flags == (1, 0, 0) and done.error is None
    with _client(node, "grpc") as client:
        assert [bytes(b) for b in client.get(NS.id, keys).blocks] == [b.tobytes() for b in blocks]
        client.remove(NS.id, keys)
    _quiet(node)


def test_a_put_whose_client_goes_after_its_statuses_leaves_nothing(node, hello):
    """Not eager, the client reads the statuses and goes without sending a block: the
    reservation ends with the connection, and nothing is visible."""
    keys, blocks = _chain(2, 50), _blocks(2, 50)
    sums = tuple(checksum(b) for b in blocks)
    _call(hello, Request(Op.PUT, 1, NS.id, tuple(keys), NS.block_bytes, None, sums))
    assert _answer(hello, len(keys)).flags == (0, 0)  # both reserved
    hello.close()
    _quiet(node)
    with _client(node, "grpc") as client:
        assert client.match(NS.id, keys).num_matched == 0
    _round_trip_works(node, seed=14)


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


def test_a_put_that_stops_halfway_leaves_nothing(node, hello):
    keys, blocks = _chain(2, 46), _blocks(2, 46)
    eager = Request(Op.PUT, 1, NS.id, tuple(keys), NS.block_bytes, None, (0, 0), True)
    _call(hello, eager)
    hello.sendall(bytes(blocks[0]))  # one block of two, then the client dies
    hello.close()
    _quiet(node)
    with _client(node, "grpc") as client:
        assert client.match(NS.id, keys).num_matched == 0
    _round_trip_works(node, seed=11)


def test_a_client_that_does_not_read_its_get_loses_the_lease_at_the_deadline(node, hello):
    """Four gets of 2 MiB each, never read: more than the socket buffers hold, so the node
    waits to send under a lease, and gives up at the transfer deadline, not later."""
    keys = _chain(64, 47)
    with _client(node) as client:
        client.put_chain(NS.id, keys, _blocks(64, 47))
    for request_id in range(1, 5):
        _call(hello, Request(Op.GET, request_id, NS.id, tuple(keys), NS.block_bytes))
    with _client(node, "grpc") as client:
        wait_until(lambda: client.stats().num_leases > 0, 10.0, "a send waits under a lease")
    _quiet(node)  # at the transfer deadline (2 s here); the idle one is 300 s
    with _client(node, "grpc") as client:
        client.remove(NS.id, keys)
    _round_trip_works(node, seed=12)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=600))
def test_arbitrary_messages_get_a_typed_error_and_end_their_connection(node, data):
    """Whatever follows a message that is not a call cannot be told apart from block bytes:
    the node answers it with a typed error and hangs up, and serves everyone else."""
    sock, reply = _hello(node)
    assert reply is not None and reply.error is None
    try:
        socket_messages.send(sock, data)
        reply = _answer(sock)
        assert reply is not None and isinstance(reply.error, errors.KVStoreError)
        assert _closed(sock)
    finally:
        sock.close()
    get = Request(Op.GET, 3, NS.id, tuple(_chain(1, 30)), NS.block_bytes)
    sock, _ = _hello(node)
    try:
        _call(sock, get)
        assert _answer(sock, 1, True).flags == (0,)
    finally:
        sock.close()


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


def test_silent_sockets_from_one_address_shed_the_oldest_and_never_an_admitted_client(node):
    """Past `max_unproven_sockets_per_peer` (4 here) silent sockets from one address, each
    newcomer sheds the oldest silent one (closed at once, the rest stay open), and a client
    admitted meanwhile claims its admission on a socket of its own."""
    wait_until(lambda: len(node.dataplanes["tcp"].unproven) == 0, 10.0, "earlier sockets gone")
    first = [_raw_socket(node) for _ in range(4)]
    wait_until(lambda: len(node.dataplanes["tcp"].unproven) == 4, 10.0, "four counted")
    try:
        extra = _raw_socket(node)
        assert _closed(first[0]), "the oldest silent socket was shed"
        for sock in (*first[1:], extra):
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):  # still open
                sock.recv(1)
        assert node.dataplanes["tcp"].unproven.num_shed >= 1
        _round_trip_works(node, seed=13)
        assert len(node.dataplanes["tcp"].unproven) <= 4
    finally:
        for sock in (*first, extra):
            sock.close()
