"""What both socket planes (`shm` on the node's host, `tcp` across hosts) must do, run on
each: move the bytes the other paths read, refuse a replayed hello, close a socket that
never says hello, and end only the connection of a message past the limit. What only one
plane has (regions, notes and the crew on shm; partly present puts and other hosts on tcp)
is in `test_shm_*.py` and `test_tcp_*.py`."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.dataplane.shm.client import ShmClient
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.dataplane.tcp.client import TcpClient
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store.config import StoreConfig
from tests.dataplane import socket_planes as planes
from tests.dataplane.socket_planes import NS

CLIENTS = {"shm": ShmClient, "tcp": TcpClient}


@pytest.fixture(scope="module", params=["shm", "tcp"])
def plane(request: pytest.FixtureRequest) -> Iterator[tuple[str, EmbeddedServer]]:
    """A node serving one socket plane, and the plane's name."""
    config = ServerConfig(
        port=0,
        dataplane=request.param,
        max_dataplane_connections_per_peer=4,
        max_unproven_sockets_per_peer=4,
        max_shm_region_bytes=planes.REGION_BYTES,
        dataplane_hello_timeout_s=2.0,
        transfer_timeout_s=2.0,
    )
    store = StoreConfig(dram_bytes=64 << 20, slab_bytes=1 << 20, max_batch_keys=64)
    with EmbeddedServer(store, config) as node:
        with Client(node.address, transport="grpc") as client:
            client.register_namespace(NS)
        yield request.param, node


def test_the_plane_moves_the_bytes_the_other_paths_read(plane):
    name, node = plane
    keys, blocks = planes.chain(8, 1), planes.blocks(8, 1)
    with planes.client(node, name) as fast, planes.client(node, "grpc") as grpc_client:
        assert isinstance(fast.data_plane(), CLIENTS[name])
        assert fast.put_chain(NS.id, keys, blocks).num_stored == 8
        got = grpc_client.get(NS.id, keys).blocks
        assert [bytes(b) for b in got] == [b.tobytes() for b in blocks]
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        missed = np.full(NS.block_bytes, 7, np.uint8)
        found = fast.get_into(NS.id, [*keys, planes.chain(1, 99)[0]], [*out, missed])
        assert found == (True,) * 8 + (False,)
        assert all((o == b).all() for o, b in zip(out, blocks, strict=True))
        assert (missed == 7).all()  # a missed key's buffer is left as it was
        assert fast.put_chain(NS.id, keys, blocks).num_present == 8  # present: none stored
        # In parts: part s of every block lands in parts[s], in order.
        parts = [[np.zeros(NS.block_bytes // 4, np.uint8) for _ in keys] for _ in range(4)]
        seen: list[int] = []
        dataplane = fast.data_plane()
        assert dataplane is not None
        done = dataplane.submit_get_parts(NS.id, keys, parts, NS.block_bytes, seen.append)
        assert done.result(timeout=10) == (True,) * 8
        assert seen == [0, 1, 2, 3]
        for i, block in enumerate(blocks):
            assert (np.concatenate([p[i] for p in parts]) == block).all()
        fast.remove(NS.id, keys)
    planes.quiet(node)


def test_a_connection_cannot_be_claimed_twice(plane):
    name, node = plane
    admitted = planes.admission(node, name)
    hello = socket_messages.encode_hello(admitted.client_id, admitted.connection_secret)
    first, second = planes.raw_socket(node, name), planes.raw_socket(node, name)
    fds = planes.hello_fds(name)
    try:
        socket_messages.send(first, hello, fds)
        reply = planes.answer(first)
        assert reply is not None and reply.error is None
        socket_messages.send(second, hello, fds)  # replayed by someone who saw it
        reply = planes.answer(second)
        assert reply is not None and isinstance(reply.error, errors.PermissionDeniedError)
    finally:
        for fd in fds:
            os.close(fd)
        first.close()
        second.close()


def test_a_message_past_the_limit_ends_only_its_connection(plane):
    name, node = plane
    admitted = planes.admission(node, name)
    sock, fds = planes.raw_socket(node, name), planes.hello_fds(name)
    try:
        hello = socket_messages.encode_hello(admitted.client_id, admitted.connection_secret)
        socket_messages.send(sock, hello, fds)
        reply = planes.answer(sock)
        assert reply is not None and reply.error is None
        sock.sendall(struct.pack("<I", 1 << 30))
        assert planes.closed(sock)
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()
    planes.round_trip_works(node, seed=21, transport=name)


def test_a_socket_that_never_says_hello_is_closed(plane):
    name, node = plane
    sock = planes.raw_socket(node, name)
    try:
        assert planes.closed(sock)  # at the hello deadline (2 s here); recv's own limit is 10 s
    finally:
        sock.close()
