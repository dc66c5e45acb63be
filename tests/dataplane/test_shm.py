"""The same-host data plane (shared memory over a Unix socket) against well-behaved clients
and hostile ones: the same bytes as the other paths, corrupted blocks refused, and every
malformed hello, region or call answered with a typed error (or the connection closed)
while the node keeps serving, holding no lease, reservation or file descriptor it should
not. The adversary is a raw socket speaking `socket_messages`; it never learns another
connection's secret.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
from typing import ClassVar

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.checksum import checksum
from kvstore.client import Client
from kvstore.client.common import raise_rpc_error
from kvstore.dataplane import frames
from kvstore.dataplane.base import Admission
from kvstore.dataplane.frames import Op, Reply, Request
from kvstore.dataplane.selection import Selection
from kvstore.dataplane.shm import crew
from kvstore.dataplane.shm import server as shm_server
from kvstore.dataplane.shm.client import ShmClient
from kvstore.dataplane.shm.regions import Region, placement
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store.config import StoreConfig
from tests.conftest import wait_until
from tests.dataplane import socket_planes as planes
from tests.dataplane.socket_planes import NS

_chain, _blocks, _quiet = planes.chain, planes.blocks, planes.quiet
_answer, _sealed_region = planes.answer, planes.sealed_region
SHM = planes.Plane("shm")
_client, _round_trip_works = SHM.client, SHM.round_trip_works
_admission, _raw_socket = SHM.admission, SHM.raw_socket


REGION_LIMIT = planes.REGION_BYTES


@pytest.fixture(scope="module")
def node():
    config = ServerConfig(
        port=0,
        dataplane="shm",
        max_dataplane_connections_per_peer=4,
        max_shm_region_bytes=REGION_LIMIT,
        dataplane_hello_timeout_s=2.0,
    )
    store = StoreConfig(dram_bytes=64 << 20, slab_bytes=1 << 20, max_batch_keys=64)
    with EmbeddedServer(store, config) as server:
        with Client(server.address, transport="grpc") as client:
            client.register_namespace(NS)
        yield server


def _holders(files: set[tuple[int, int]]) -> int:
    """How many open fds of this process (the node's too) are one of `files` (dev, inode)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, gone by now
            st = os.stat(f"/proc/self/fd/{fd}")
            held += (st.st_dev, st.st_ino) in files
    return held


def test_shared_buffers_move_without_a_copy_on_the_client_side(node, note_bytes):
    """Blocks in `Client.buffer` memory: the node copies them straight in and out; the
    bytes are the same, a corrupted one is still refused, and buffers of both kinds mix."""
    keys, blocks = _chain(4, 5), _blocks(4, 5)
    with _client(node) as client, _client(node, "grpc") as grpc_client:
        with pytest.raises(errors.InvalidArgumentError, match="max_shm_region_bytes"):
            client.buffer(REGION_LIMIT + 1)
        assert grpc_client.buffer(10).nbytes == 10  # plain memory there
        shared = client.buffer(8 * NS.block_bytes).reshape(8, NS.block_bytes)
        shared[:4] = blocks
        assert client.put_chain(NS.id, keys, list(shared[:4])).num_stored == 4
        assert [bytes(b) for b in grpc_client.get(NS.id, keys).blocks] == [
            b.tobytes() for b in blocks
        ]
        assert client.get_into(NS.id, keys, list(shared[4:])) == (True,) * 4
        assert (shared[4:] == shared[:4]).all()
        lease = node.store.acquire(NS.id, keys[2:3])
        lease.views[0][7] ^= 0xFF
        node.store.release(lease.lease_id)
        failures = client.data_plane().checksum_failures
        assert client.get_into(NS.id, keys, list(shared[4:])) == (True, True, False, True)
        assert client.data_plane().checksum_failures == failures + 1
        mixed = [shared[4], np.zeros(NS.block_bytes, np.uint8)]  # one shared, one not
        assert client.get_into(NS.id, keys[:2], mixed) == (True, True)
        assert (mixed[1] == blocks[1]).all()
        client.remove(NS.id, keys)
    _quiet(node)


def test_an_array_of_rows_moves_as_a_list_of_its_rows_does(node, note_bytes):
    """One array of a row per key (`buffers.checked_buffers`, checked once for the call):
    in shared memory the node copies straight in and out at each row's place; elsewhere
    through staging; a corrupted block is refused either way."""
    keys, blocks = _chain(4, 6), _blocks(4, 6)
    with _client(node) as client, _client(node, "grpc") as grpc_client:
        shared = client.buffer(8 * NS.block_bytes).reshape(8, NS.block_bytes)
        shared[:4] = blocks
        assert client.put_chain(NS.id, keys, shared[:4]).num_stored == 4
        assert [bytes(b) for b in grpc_client.get(NS.id, keys).blocks] == [
            b.tobytes() for b in blocks
        ]
        assert client.get_into(NS.id, keys[::-1], shared[4:]) == (True,) * 4
        assert (shared[4:] == shared[3::-1]).all()  # each row the block of its own key
        plain = np.zeros((4, NS.block_bytes), np.uint8)
        assert client.get_into(NS.id, keys, plain) == (True,) * 4
        assert (plain == shared[:4]).all()
        lease = node.store.acquire(NS.id, keys[1:2])
        lease.views[0][9] ^= 0xFF
        node.store.release(lease.lease_id)
        for rows in (shared[4:], plain):
            rows[:] = 0
            assert client.get_into(NS.id, keys, rows) == (True, False, True, True)
            assert (rows[[0, 2, 3]] == shared[[0, 2, 3]]).all()
        client.remove(NS.id, keys)
    _quiet(node)


def test_auto_picks_shared_memory_on_the_nodes_host(node):
    with _client(node, "auto") as client:
        assert isinstance(client.data_plane(), ShmClient)


def test_calls_past_the_region_limit(node, note_bytes):
    """A get of more blocks than the region holds goes in several calls; a put must fit
    (it is all or nothing) and is refused whole, with nothing stored."""
    keys, blocks = _chain(20, 2), _blocks(20, 2)
    with _client(node) as client:
        dp = client.data_plane()
        with pytest.raises(errors.BatchTooLargeError, match="max_shm_region_bytes"):
            dp.put(NS.id, keys, blocks, None, NS.block_bytes)
        assert client.match(NS.id, keys).num_matched == 0
        for start in range(0, 20, 8):
            client.put_chain(NS.id, keys[start : start + 8], blocks[start : start + 8])
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        assert dp.get_into(NS.id, keys, out, NS.block_bytes) == (True,) * 20
        assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        client.remove(NS.id, keys)
    _quiet(node)


@pytest.fixture(params=["notes rarely", "a note per block"])
def note_bytes(request, monkeypatch):
    """How often the node says which blocks of a get landed (`socket_messages.NOTE_BYTES`):
    as shipped (never, for these small gets) or after every block."""
    if request.param == "a note per block":
        monkeypatch.setattr(socket_messages, "NOTE_BYTES", NS.block_bytes)
    return socket_messages.NOTE_BYTES


@pytest.fixture(params=["alone", "with helpers"])
def crewed(request, monkeypatch, node):
    """Whether a call's copies (a put's staging, the node's copy and sum of a put, the
    node's copy of a get) are shared with their crew's helper threads: as shipped (never,
    for these small calls) or from two blocks up, a get's with a helper even on a host of
    two cores (which lends a get none: `shm_server.get_helpers`)."""
    if request.param == "with helpers":
        monkeypatch.setattr(crew, "MIN_SHARED_BYTES", 2 * NS.block_bytes)
        monkeypatch.setattr(shm_server, "GET_SHARED_BYTES", 2 * NS.block_bytes)
        monkeypatch.setattr(node.dataplanes["shm"], "get_helpers", 1)
    return request.param


def test_puts_staged_or_shared_store_every_block_whole(node, crewed):
    """A put's blocks staged (plain arrays) or in shared memory, copied alone or with the
    crew's helpers, are stored byte for byte under their own keys."""
    keys, blocks = _chain(8, 47), _blocks(8, 47)
    with _client(node) as client, _client(node, "grpc") as grpc_client:
        assert client.put_chain(NS.id, keys[:4], blocks[:4]).num_stored == 4  # staged
        shared = client.buffer(4 * NS.block_bytes).reshape(4, NS.block_bytes)
        shared[:] = blocks[4:]
        assert client.put_chain(NS.id, keys[4:], list(shared)).num_stored == 4
        stored = grpc_client.get(NS.id, keys).blocks
        assert [bytes(b) for b in stored] == [b.tobytes() for b in blocks]
        client.remove(NS.id, keys)
    _quiet(node)


def _shared_files() -> set[str]:
    """The address ranges of this process's data-plane regions (shared files) now."""
    with open("/proc/self/maps") as maps:
        return {line.split()[0] for line in maps if "memfd:kvstore-dataplane" in line}


@pytest.mark.parametrize("warmed", [False, True])
def test_warm_up_pays_a_first_large_calls_region_before_it(node, warmed):
    """A first get larger than the staging region hands the node a grown region (a new
    file) on the call's path; after `warm_up`, the same get makes none."""
    keys, blocks = _chain(20, 9), _blocks(20, 9)
    with _client(node, "grpc") as grpc_client:
        grpc_client.put_chain(NS.id, keys, blocks)
    with _client(node) as client:
        dataplane = client.data_plane()  # connected: its first region handed over
        if warmed:
            dataplane.warm_up()
        before = _shared_files()
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        assert client.get_into(NS.id, keys, out) == (True,) * 20
        assert (_shared_files() == before) is warmed
        client.remove(NS.id, keys)
    _quiet(node)


def test_corrupted_block_is_never_accepted_by_the_client(node, note_bytes, crewed):
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


def test_region_cannot_be_shrunk_under_the_node():
    region, fd = Region.create(1 << 20)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
    finally:
        os.close(fd)
        region.close()


def _idle(node) -> None:
    """Waits (bounded) until the node's threads have ended earlier tests' connections."""
    dataplane = node.dataplanes["shm"]
    wait_until(lambda: dataplane.num_connections == 0, 10.0, "earlier connections end")


def test_shm_handshakes_count_against_the_connection_limits(node):
    _idle(node)
    admitted = [_admission(node) for _ in range(4)]
    with pytest.raises(grpc.RpcError) as err:
        _admission(node)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(admitted) == node.dataplanes["shm"].num_connections
    assert node.dataplanes["shm"].reap(now=float("inf")) == 4


def test_a_client_elsewhere_falls_back_and_stops_trying_shm(node):
    """Admitted, but the node's socket is out of reach (another host): UCX or an error,
    and no second try of shm from this process."""
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(node.address))

    def elsewhere(transport: str, client_address: bytes) -> tuple[bytes, Admission]:
        try:
            answer = stub.DataPlaneInfo(pb.DataPlaneInfoRequest(transport=transport), timeout=10)
        except grpc.RpcError as err:
            raise_rpc_error(err)
        return b"\0kvstore-not-here", Admission(answer.client_id, answer.connection_secret)

    _idle(node)
    selection = Selection("auto", node.address, 5.0)
    with pytest.raises(errors.UnavailableError):  # the node has no ucx plane
        selection.open(elsewhere)
    assert not selection.shm_reachable
    assert node.dataplanes["shm"].reap(now=float("inf")) == 1


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"max_shm_region_bytes": 1000}, "at least 64KiB"),
        ({"max_shm_regions": 0}, "1 to 256"),
        ({"max_shm_regions": 257}, "1 to 256"),
        ({"dataplane": "rdma"}, "auto, ucx, shm, tcp or none"),
    ],
)
def test_the_shm_settings_are_checked_at_start(setting, message):
    with pytest.raises(errors.InvalidArgumentError, match=message):
        ServerConfig(port=0, **setting)


def test_a_note_the_socket_cannot_take_now_is_not_sent_at_all():
    """The node never waits under a lease for a client that does not read: `try_send`
    sends a whole message or nothing, so the stream stays whole either way."""
    node_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    node_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    note = socket_messages.encode_landed(1, 0, b"\1" * 100)
    sent = 0
    while socket_messages.try_send(node_end, note):
        sent += 1
        assert sent < 100_000, "the socket never filled"
    node_end.close()
    received = 0
    with contextlib.suppress(ConnectionError):
        while True:
            data, _ = socket_messages.receive(client_end, 1 << 10)
            assert socket_messages.decode_landed(data) == (1, 0, b"\1" * 100)
            received += 1
    assert received == sent > 0
    client_end.close()


def test_a_note_of_every_unit_of_a_get_is_taken_and_a_longer_message_breaks_the_stream():
    """Runs landing out of order are noted together (`shm_server._Notes`): with a helper
    held up on one, a note can name every unit of a GET in parts, many more than its
    reply's bytes (a load of 256 keys in 8 parts: 2,048 flags; its reply, 1,310 bytes). The
    client takes such a note; a message longer than any a node may send is a broken stream
    (ConnectionError: the connection is dropped), not an error of the call, which would
    leave the rest of it to be read as the next message."""
    num_keys, units = 256, 256 * 8
    assert units > frames.reply_bytes(num_keys)
    node_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with node_end, client_end:
        socket_messages.send(node_end, socket_messages.encode_landed(9, 0, b"\1" * units))
        flags = tuple([1] * num_keys)
        sums = tuple(range(num_keys))
        reply = Reply(flags, 0, NS.block_bytes, checksums=sums)
        socket_messages.send(node_end, socket_messages.encode_reply(reply))
        notes: list = []
        got = socket_messages.receive_reply(client_end, num_keys, True, lambda *n: notes.append(n))
        assert notes == [(9, 0, b"\1" * units)]
        assert (got.flags, got.checksums) == (flags, sums)
        too_long = socket_messages.encode_landed(9, 0, b"\1" * (frames.MAX_BLOCKS + 1))
        socket_messages.send(node_end, too_long)
        with pytest.raises(ConnectionError, match="out of step"):
            socket_messages.receive_reply(client_end, num_keys, True, None)


class _FirstRunLast(shm_server._Notes):
    """The node's notes of a GET whose first run lands after every other but the last, as
    when a helper holding it is off its core: one note then names nearly every unit."""

    largest: int = 0

    def landed(self, k: int) -> None:
        if k == 0:
            return  # said below, once the others are in
        super().landed(k)
        if k == len(self._runs) - 2:
            super().landed(0)
            _FirstRunLast.largest = max(_FirstRunLast.largest, self._said)


def test_a_get_whose_first_run_lands_last_is_noted_at_once_and_lands_whole(node, monkeypatch):
    """Against a real node: a GET whose first run is held back (as a helper off its core
    holds it) is noted in one note of more flags than its reply has bytes; the client takes
    it, every part lands whole and checked, and the connection's next call is in step."""
    keys, blocks = _chain(8, 33), _blocks(8, 33)
    segments = 256  # 2,048 units of 128 bytes: far more flags than the reply has bytes
    monkeypatch.setattr(socket_messages, "NOTE_BYTES", 128)  # a run per unit
    monkeypatch.setattr(shm_server, "_Notes", _FirstRunLast)
    _FirstRunLast.largest = 0
    with _client(node) as client:
        client.put_chain(NS.id, keys, blocks)
        dataplane = client.data_plane()
        size = NS.block_bytes // segments
        landed = client.buffer(len(keys) * NS.block_bytes)  # part s of key i at (s, i)
        parts = [
            [landed[(s * len(keys) + i) * size :][:size] for i in range(len(keys))]
            for s in range(segments)
        ]
        found = dataplane.submit_get_parts(NS.id, keys, parts, NS.block_bytes).result()
        assert found == (True,) * len(keys)
        for i, block in enumerate(blocks):
            assert (np.concatenate([parts[s][i] for s in range(segments)]) == block).all()
        assert _FirstRunLast.largest > frames.reply_bytes(len(keys))
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]  # the stream still in step
        assert client.get_into(NS.id, keys, out) == (True,) * len(keys)
        assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        client.remove(NS.id, keys)
    _quiet(node)


class _Copiers(shm_server._Notes):
    """The node's notes of a GET, recording which threads copied its runs."""

    threads: ClassVar[set[int]] = set()

    def landed(self, k: int) -> None:
        _Copiers.threads.add(threading.get_ident())
        super().landed(k)


@pytest.mark.parametrize("cores", [2, 3])
def test_a_get_takes_copy_helpers_only_from_cores_beyond_the_two_it_keeps_busy(
    node, monkeypatch, cores
):
    """A large get keeps the node's copy and the client's check busy: on a host of two
    cores its runs are all copied on the connection's thread, on three by it and at most
    one helper; every block lands whole either way."""
    server = node.dataplanes["shm"]
    monkeypatch.setattr(shm_server, "GET_SHARED_BYTES", 2 * NS.block_bytes)
    monkeypatch.setattr(socket_messages, "NOTE_BYTES", NS.block_bytes)  # a run per block
    monkeypatch.setattr(server, "get_helpers", shm_server.get_helpers(cores))
    monkeypatch.setattr(server._crew, "helpers", 3)
    monkeypatch.setattr(shm_server, "_Notes", _Copiers)
    _Copiers.threads = set()
    keys, blocks = _chain(8, 34), _blocks(8, 34)
    with _client(node) as client:
        client.put_chain(NS.id, keys, blocks)
        landed = client.buffer(len(keys) * NS.block_bytes)  # one call, straight in
        out = list(landed.reshape(len(keys), NS.block_bytes))
        for _ in range(20):
            landed[:] = 0
            assert client.get_into(NS.id, keys, out) == (True,) * len(keys)
            assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        client.remove(NS.id, keys)
    assert 1 <= len(_Copiers.threads) <= cores - 1
    _quiet(node)
