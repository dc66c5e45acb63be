"""The TCP data plane (a stream socket per connection) against hostile peers: a wrong
secret refused, a GET's reply and then its found blocks part-major, puts whose bytes do not
match their sums, puts that wait for their statuses, clients that go halfway or never read
their gets, arbitrary messages answered with a typed error and the connection closed, and
silent sockets from one address shed oldest first, while the node keeps serving, holding no
lease or reservation it should not. The adversary is a raw TCP socket speaking
`socket_messages`; it never learns another connection's secret.
"""

from __future__ import annotations

import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.dataplane.frames import Op, Reply, Request
from kvstore.dataplane.sockets import messages as socket_messages
from tests.conftest import wait_until
from tests.dataplane import socket_planes as planes
from tests.dataplane import tcp_cases as cases
from tests.dataplane.socket_planes import NS

_chain, _blocks, _quiet, _closed = planes.chain, planes.blocks, planes.quiet, planes.closed
_answer = planes.answer
TCP = planes.Plane("tcp")
_client, _round_trip_works = TCP.client, TCP.round_trip_works
_admission, _raw_socket = TCP.admission, TCP.raw_socket
node = cases.node  # a fixture: this module's node


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
