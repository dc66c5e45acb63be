"""What the tests of the two socket planes (`shm`, `tcp`) share: a namespace, chains and
blocks, clients, the check that a node holds nothing open, and a raw socket's admission,
hello and replies. `test_socket_planes.py` runs the tests both planes must pass."""

from __future__ import annotations

import fcntl
import os
import socket

import grpc
import numpy as np

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.dataplane import frames
from kvstore.dataplane.frames import Reply
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer
from tests.conftest import wait_until

NS = Namespace("llama-planes", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
REGION_BYTES = 8 * NS.block_bytes  # the shm plane's region limit in these tests


def chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def blocks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, NS.block_bytes, dtype=np.uint8) for _ in range(n)]


def client(node: EmbeddedServer, transport: str) -> Client:
    made = Client(node.address, timeout_s=10.0, transport=transport)
    made.register_namespace(NS)
    return made


def quiet(node: EmbeddedServer) -> None:
    """Nothing left open: no lease, no reservation (a closed client's connection ends on
    the node's own thread, so within a bound rather than at once)."""
    with client(node, "grpc") as grpc_client:
        wait_until(
            lambda: (
                (grpc_client.stats().num_leases, grpc_client.stats().num_reservations) == (0, 0)
            ),
            10.0,
            "the node ends every lease and reservation",
        )


def round_trip_works(node: EmbeddedServer, seed: int, transport: str) -> None:
    keys, data = chain(4, seed), blocks(4, seed)
    with client(node, transport) as c:
        c.put_chain(NS.id, keys, data)
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        assert c.get_into(NS.id, keys, out) == (True,) * 4
        assert all((o == b).all() for o, b in zip(out, data, strict=True))
        c.remove(NS.id, keys)
    quiet(node)


class Plane:
    """The helpers above with one plane's transport bound, for that plane's own tests."""

    def __init__(self, transport: str) -> None:
        self.transport = transport

    def client(self, node: EmbeddedServer, transport: str = "") -> Client:
        return client(node, transport or self.transport)

    def round_trip_works(self, node: EmbeddedServer, seed: int) -> None:
        round_trip_works(node, seed, self.transport)

    def admission(self, node: EmbeddedServer) -> pb.DataPlaneInfoResponse:
        return admission(node, self.transport)

    def raw_socket(self, node: EmbeddedServer) -> socket.socket:
        return raw_socket(node, self.transport)


# -- a raw socket, as an adversary speaks to a plane -----------------------------------------


def corrupted_block_is_refused(node: EmbeddedServer, c: Client) -> None:
    """A byte flipped in a committed block behind the store's back: the client's get (whole
    and in parts) checks each block against the CRC32C its reply carries, and reports it
    missed; the other blocks land. Closes `c`."""
    keys, data = chain(3, 3), blocks(3, 3)
    with c:
        c.put_chain(NS.id, keys, data)
        with node.store.acquire(NS.id, keys[1:2]) as lease:
            lease.views[0][100] ^= 0xFF
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        assert c.get_into(NS.id, keys, out) == (True, False, True)
        assert (out[0] == data[0]).all() and (out[2] == data[2]).all()
        dataplane = c.data_plane()
        assert dataplane is not None and dataplane.checksum_failures == 1
        parts = [[np.zeros(NS.block_bytes // 4, np.uint8) for _ in keys] for _ in range(4)]
        got = dataplane.submit_get_parts(NS.id, keys, parts, NS.block_bytes)
        assert got.result(timeout=10) == (True, False, True)
        assert dataplane.checksum_failures == 2
        c.remove(NS.id, keys)


def admission(node: EmbeddedServer, transport: str) -> pb.DataPlaneInfoResponse:
    with grpc.insecure_channel(node.address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        return stub.DataPlaneInfo(pb.DataPlaneInfoRequest(transport=transport), timeout=10)


def raw_socket(node: EmbeddedServer, transport: str) -> socket.socket:
    address = node.dataplanes[transport].address
    if transport == "shm":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10.0)
        sock.connect(address)
        return sock
    host, _, port = address.decode().rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10.0)


def sealed_region(size: int = 64 << 10, seals: int = fcntl.F_SEAL_SHRINK) -> int:
    """A memfd of `size` bytes with `seals`: what a same-host hello hands the node."""
    fd = os.memfd_create("adversary", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def hello_fds(transport: str) -> list[int]:
    """What a proper hello carries besides its secret: a region on shm, nothing on tcp."""
    return [sealed_region(REGION_BYTES)] if transport == "shm" else []


def answer(sock: socket.socket, num_keys: int = 0, get: bool = False) -> Reply | None:
    """The node's reply, or None if it closed the connection."""
    try:
        data, fds = socket_messages.receive(sock, 1 << 20)
    except ConnectionError:
        return None
    socket_messages.close_all(fds)
    assert data[0] == socket_messages.Kind.REPLY, f"a message of kind {data[0]}, not a reply"
    return frames.decode_reply(data[1:], num_keys, get)


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
