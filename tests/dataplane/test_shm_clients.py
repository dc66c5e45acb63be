"""The same-host data plane (shared memory over a Unix socket) against well-behaved
clients: blocks in `Client.buffer` memory and arrays of rows moved without a copy on the
client's side, the same bytes as the other paths, corrupted blocks refused, calls past the
region limit, puts staged or shared and copied alone or with the crew's helpers, `warm_up`;
"auto" picking shared memory on the node's host and a client elsewhere falling back; the
handshakes counted against the connection limits, regions that cannot be shrunk, and the shm
settings checked at start.
"""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.common import raise_rpc_error
from kvstore.dataplane.base import Admission
from kvstore.dataplane.selection import Selection
from kvstore.dataplane.shm.client import ShmClient
from kvstore.dataplane.shm.regions import Region
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.node.server import ServerConfig
from tests.conftest import wait_until
from tests.dataplane import shm_cases as cases
from tests.dataplane import socket_planes as planes
from tests.dataplane.shm_cases import REGION_LIMIT
from tests.dataplane.socket_planes import NS

_chain, _blocks, _quiet = planes.chain, planes.blocks, planes.quiet
SHM = planes.Plane("shm")
_client, _admission = SHM.client, SHM.admission
node, crewed = cases.node, cases.crewed  # fixtures: this module's node, and how it copies


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
        lease.release()
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
        lease.release()
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
    planes.corrupted_block_is_refused(node, _client(node))


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
