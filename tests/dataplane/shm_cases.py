"""What the tests of the same-host data plane share (`test_shm_clients.py`,
`test_shm_adversary.py`, `test_shm_notes.py`): the region limit, a module's `node` serving
the shm plane (shared memory over a Unix socket) with `socket_planes.NS` registered, and
`crewed`: whether a call's copies are shared with their crew's helper threads."""

from __future__ import annotations

import pytest

from kvstore.client import Client
from kvstore.dataplane.shm import crew
from kvstore.dataplane.shm import server as shm_server
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store.config import StoreConfig
from tests.dataplane import socket_planes as planes
from tests.dataplane.socket_planes import NS

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
