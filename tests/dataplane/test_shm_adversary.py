"""The same-host data plane (shared memory over a Unix socket) against hostile peers: every
malformed hello, region or call answered with a typed error (or the connection closed)
while the node keeps serving, holding no lease, reservation or file descriptor it should
not; a GET's LANDED notes on a raw socket, calls outside the region, regions past the limits
or never handed over, and puts whose bytes do not match their sums, eager or not. The
adversary is a raw socket speaking `socket_messages`; it never learns another connection's
secret.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.dataplane import frames
from kvstore.dataplane.frames import Op, Reply, Request
from kvstore.dataplane.shm.regions import Region, placement
from kvstore.dataplane.sockets import messages as socket_messages
from tests.conftest import wait_until
from tests.dataplane import shm_cases as cases
from tests.dataplane import socket_planes as planes
from tests.dataplane.shm_cases import REGION_LIMIT
from tests.dataplane.socket_planes import NS

_chain, _blocks, _quiet = planes.chain, planes.blocks, planes.quiet
_answer, _sealed_region = planes.answer, planes.sealed_region
SHM = planes.Plane("shm")
_client, _round_trip_works = SHM.client, SHM.round_trip_works
_admission, _raw_socket = SHM.admission, SHM.raw_socket
node, crewed = cases.node, cases.crewed  # fixtures: this module's node, and how it copies


def _holders(files: set[tuple[int, int]]) -> int:
    """How many open fds of this process (the node's too) are one of `files` (dev, inode)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, gone by now
            st = os.stat(f"/proc/self/fd/{fd}")
            held += (st.st_dev, st.st_ino) in files
    return held


# -- hostile peers ------------------------------------------------------------------------


def _reply_of(data: memoryview, num_keys: int = 0, with_checksums: bool = False) -> Reply:
    assert data[0] == socket_messages.Kind.REPLY, f"a message of kind {data[0]}, not a reply"
    return frames.decode_reply(data[1:], num_keys, with_checksums)


def _hello(node, fds: list[int], secret: bytes | None = None, client_id: int | None = None):
    admitted = _admission(node)
    sock = _raw_socket(node)
    hello = socket_messages.encode_hello(
        admitted.client_id if client_id is None else client_id,
        admitted.connection_secret if secret is None else secret,
    )
    socket_messages.send(sock, hello, fds)
    return sock, _answer(sock)


def _unsealed() -> int:
    return _sealed_region(seals=0)


def _pipe() -> int:
    read, write = os.pipe()
    os.close(write)
    return read


def _too_big() -> int:
    return _sealed_region(REGION_LIMIT + 1)


def _write_sealed() -> int:
    return _sealed_region(seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)


@pytest.mark.parametrize(
    ("make_fds", "secret", "error"),
    [
        (lambda: [_sealed_region()], b"x" * 16, "PermissionDeniedError"),
        (lambda: [], None, "InvalidArgumentError"),
        (lambda: [_pipe()], None, "InvalidArgumentError"),
        (lambda: [_unsealed()], None, "InvalidArgumentError"),
        (lambda: [_too_big()], None, "InvalidArgumentError"),
        (lambda: [_write_sealed()], None, "InvalidArgumentError"),
    ],
    ids=["wrong-secret", "no-region", "pipe", "unsealed", "too-big", "write-sealed"],
)
def test_bad_hellos_are_refused_and_the_node_keeps_serving(node, make_fds, secret, error):
    fds = make_fds()
    files = {(st.st_dev, st.st_ino) for st in map(os.fstat, fds)}
    try:
        sock, reply = _hello(node, fds, secret)
    finally:
        socket_messages.close_all(fds)
    assert reply is not None and type(reply.error).__name__ == error, reply
    assert sock.recv(1) == b""  # and the node hung up
    sock.close()
    dataplane = node.dataplanes["shm"]
    if secret is None:  # the secret's holder sent a bad region: its admission ends with it
        wait_until(lambda: dataplane.num_connections == 0, 10.0, "the admission is dropped")
    else:  # a wrong secret ends nothing: the admission it named waits for its deadline
        assert dataplane.num_connections >= 1
        dataplane.reap(now=float("inf"))
    _round_trip_works(node, seed=10)
    wait_until(lambda: _holders(files) == 0, 10.0, "the node let go of the adversary's files")
    assert node.dataplanes["shm"].num_connections == 0


@pytest.fixture
def hello(node):
    """A raw socket that said a proper hello, and its region."""
    fd = _sealed_region(REGION_LIMIT)
    sock, reply = _hello(node, [fd])
    assert reply is not None and reply.error is None and reply.block_bytes == REGION_LIMIT
    region = Region(fd, REGION_LIMIT)
    os.close(fd)
    yield sock, region
    sock.close()
    region.close()


def _call(sock, req: Request, offsets, notes: list | None = None) -> Reply | None:
    """The node's reply to one call; a GET's LANDED notes before it go to `notes`."""
    socket_messages.send(sock, socket_messages.encode_call(req, offsets))
    try:
        data, _ = socket_messages.receive(sock, 1 << 20)
        while data[0] == socket_messages.Kind.LANDED and req.op is Op.GET:
            if notes is not None:
                notes.append(socket_messages.decode_landed(data))
            data, _ = socket_messages.receive(sock, 1 << 20)
    except ConnectionError:
        return None
    return _reply_of(data, len(req.keys), req.op is Op.GET)


def test_a_get_says_which_blocks_landed_while_the_node_copies(node, hello, monkeypatch, crewed):
    """After every two blocks' bytes copied, a LANDED note names the keys done since the
    last one with their found flags, and one after the last block (the reply follows it).
    With helpers copying too, notes still come in order (`_in_order`)."""
    monkeypatch.setattr(socket_messages, "NOTE_BYTES", 2 * NS.block_bytes)
    sock, region = hello
    keys, blocks = _chain(6, 25), _blocks(6, 25)
    with _client(node) as client:
        client.put_chain(NS.id, keys[:2], blocks[:2])
        client.put_chain(NS.id, keys[:5], blocks[:5])
        client.remove(NS.id, keys[2:3])  # and keys[5] was never put
    notes: list = []
    req = Request(Op.GET, 7, NS.id, tuple(keys), NS.block_bytes)
    reply = _call(sock, req, [i * NS.block_bytes for i in range(6)], notes)
    assert reply is not None and reply.flags == (1, 1, 0, 1, 1, 0)
    _in_order(notes, [(7, 0, b"\1\1"), (7, 2, b"\0\1\1"), (7, 5, b"\0")], crewed)
    for i in (0, 1, 3, 4):
        assert (region.array[i * NS.block_bytes :][: NS.block_bytes] == blocks[i]).all()
    with _client(node) as client:
        client.remove(NS.id, keys)
    _quiet(node)


def test_a_get_in_parts_lands_part_major_and_says_when_each_part_is_in(
    node, hello, monkeypatch, crewed
):
    """A GET in 4 parts of 4 keys (key 1 missing) is copied part-major: unit `4 * s + i` is
    part s of key i. A note comes after every two parts' bytes copied and at the end of
    each part (three parts' bytes: more than NOTE_BYTES), the last unit's included."""
    monkeypatch.setattr(socket_messages, "NOTE_BYTES", NS.block_bytes // 2)
    sock, region = hello
    keys, blocks = _chain(4, 26), _blocks(4, 26)
    with _client(node) as client:
        client.put_chain(NS.id, keys[:1], blocks[:1])
        client.put_chain(NS.id, keys, blocks)
        client.remove(NS.id, keys[1:2])
    size = NS.block_bytes // 4
    notes: list = []
    req = Request(Op.GET, 8, NS.id, tuple(keys), NS.block_bytes, segments=4)
    offsets = [(4 * s + i) * size for s in range(4) for i in range(4)]  # part-major here too
    reply = _call(sock, req, offsets, notes)
    assert reply is not None and reply.flags == (1, 0, 1, 1)
    parts = [(8, 4 * s, b"\1\0\1") for s in range(4)]
    ends = [(8, 4 * s + 3, b"\1") for s in range(4)]
    _in_order(notes, sorted(parts + ends, key=lambda note: note[1]), crewed)
    for s in range(4):
        for i in (0, 2, 3):
            landed = region.array[(4 * s + i) * size :][:size]
            assert (landed == blocks[i][s * size : (s + 1) * size]).all()
    with _client(node) as client:
        client.remove(NS.id, keys)
    _quiet(node)


def _in_order(notes: list, serial: list, crewed: str) -> None:
    """The notes of a get copied alone are `serial`. Copied with helpers, a run may land
    before the one ahead of it: then one note names both. Either way the notes name every
    unit in order from the first, each ends where a serial note ends, and their flags are
    the serial notes'."""
    if crewed == "alone":
        assert notes == serial
        return
    ends = {start + len(flags) for _, start, flags in serial}
    said = 0
    for request_id, start, flags in notes:
        assert request_id == serial[0][0] and start == said and start + len(flags) in ends
        said += len(flags)
    assert b"".join(f for _, _, f in notes) == b"".join(f for _, _, f in serial)


def test_calls_outside_the_region_change_nothing(node, hello):
    sock, region = hello
    keys, blocks = _chain(2, 20), _blocks(2, 20)
    for i, block in enumerate(blocks):
        region.array[i * NS.block_bytes :][: NS.block_bytes] = block
    sums = tuple(checksum(b) for b in blocks)
    put = Request(Op.PUT, 1, NS.id, tuple(keys), NS.block_bytes, None, sums)
    for offsets in ([0, REGION_LIMIT - 1], [-1 & (2**64 - 1), 0], [2**63, 0]):
        reply = _call(sock, put, offsets)
        assert isinstance(reply.error, errors.InvalidArgumentError), reply
    get = Request(Op.GET, 2, NS.id, tuple(keys), NS.block_bytes)
    assert _call(sock, get, [REGION_LIMIT, 0]).error is not None
    with _client(node, "grpc") as client:
        assert client.match(NS.id, keys).num_matched == 0
    assert _call(sock, put, [0, NS.block_bytes]).flags == (0, 0)  # RESERVED, stored
    got = _call(sock, get, [2 * NS.block_bytes, 3 * NS.block_bytes])
    assert got.flags == (1, 1) and got.checksums == sums
    assert (region.array[2 * NS.block_bytes :][: NS.block_bytes] == blocks[0]).all()
    with _client(node, "grpc") as client:
        client.remove(NS.id, keys)
    _quiet(node)


def test_regions_past_the_limits_or_never_handed_over_are_refused(node, hello):
    sock, _ = hello
    for index in (1, 15):  # the node's default max_shm_regions: 16
        fd = _sealed_region()
        socket_messages.send(sock, bytes([socket_messages.Kind.REGION, index]), [fd])
        os.close(fd)
        assert _answer(sock).error is None
    for message, error in (
        (bytes([socket_messages.Kind.REGION, 16]), "max_shm_regions"),
        (bytes([socket_messages.Kind.REGION]), "two bytes and one region"),
    ):
        fd = _sealed_region()
        socket_messages.send(sock, message, [fd])
        os.close(fd)
        assert error in str(_answer(sock).error)
    get = Request(Op.GET, 1, NS.id, tuple(_chain(1, 40)), NS.block_bytes)
    reply = _call(sock, get, [placement(7, 0)])
    assert "no region 7" in str(reply.error)
    _round_trip_works(node, seed=41)


def test_a_put_whose_bytes_do_not_match_its_sums_is_not_committed(node, hello, crewed):
    """The node sums its own copy: blocks that differ from the checksums the call carries
    (a client that changed them after summing) are refused whole, and nothing is stored."""
    sock, region = hello
    keys, blocks = _chain(2, 45), _blocks(2, 45)
    for i, block in enumerate(blocks):
        region.array[i * NS.block_bytes :][: NS.block_bytes] = block
    sums = (checksum(blocks[0]), checksum(blocks[1]) ^ 1)
    put = Request(Op.PUT, 1, NS.id, tuple(keys), NS.block_bytes, None, sums)
    reply = _call(sock, put, [0, NS.block_bytes])
    assert isinstance(reply.error, errors.ChecksumMismatchError), reply
    with _client(node, "grpc") as client:
        assert client.match(NS.id, keys).num_matched == 0
    _quiet(node)


def test_eager_puts_take_their_sums_from_the_message_behind_them(node, hello, crewed):
    """An eager put's sums follow it (the client sums while the node copies): right sums
    commit; wrong or missing ones commit nothing; a put refused before its copy still reads
    its sums, so the stream stays one reply per call."""
    sock, region = hello
    keys, blocks = _chain(2, 46), _blocks(2, 46)
    for i, block in enumerate(blocks):
        region.array[i * NS.block_bytes :][: NS.block_bytes] = block
    sums = [checksum(b) for b in blocks]
    offsets = [0, NS.block_bytes]

    def eager(request_id: int, block_bytes: int = NS.block_bytes) -> Request:
        return Request(Op.PUT, request_id, NS.id, tuple(keys), block_bytes, None, (0, 0), True)

    def send(req: Request, message: bytes) -> Reply:
        socket_messages.send(sock, socket_messages.encode_call(req, offsets))
        socket_messages.send(sock, message)
        data, _ = socket_messages.receive(sock, 1 << 20)
        return _reply_of(data, len(keys))

    reply = send(eager(1), socket_messages.encode_sums(1, [sums[0], sums[1] ^ 1]))
    assert isinstance(reply.error, errors.ChecksumMismatchError)
    reply = send(eager(2), socket_messages.encode_sums(99, sums))  # another request's sums
    assert "not 2" in str(reply.error)
    reply = send(eager(3), socket_messages.encode_call(Request(Op.PING, 4, b"", (), 0), []))
    assert "followed by its sums" in str(reply.error)
    with _client(node, "grpc") as client:
        assert client.match(NS.id, keys).num_matched == 0
    reply = send(eager(5, NS.block_bytes + 1), socket_messages.encode_sums(5, sums))
    assert isinstance(reply.error, errors.PayloadSizeError)  # refused first, sums read
    assert send(eager(6), socket_messages.encode_sums(6, sums)).flags == (0, 0)  # stored
    with _client(node, "grpc") as client:
        assert [bytes(b) for b in client.get(NS.id, keys).blocks] == [b.tobytes() for b in blocks]
        client.remove(NS.id, keys)
    _quiet(node)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=600))
def test_arbitrary_messages_get_typed_errors(node, hello, data):
    sock, _ = hello
    socket_messages.send(sock, data)
    reply_data, _ = socket_messages.receive(sock, 1 << 20)
    reply = _reply_of(reply_data)
    assert isinstance(reply.error, errors.KVStoreError)
    assert _call(
        sock, Request(Op.GET, 3, NS.id, tuple(_chain(1, 30)), NS.block_bytes), [0]
    ).flags == (0,)
