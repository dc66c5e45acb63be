"""What the tests of the TCP data plane share (`test_tcp_clients.py`, `test_tcp_adversary.py`):
a node serving the tcp plane (a stream socket per connection) with tight limits and
deadlines, on any host address, and a module's `node` of it with `socket_planes.NS`
registered."""

from __future__ import annotations

import pytest

from kvstore.client import Client
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store.config import StoreConfig
from tests.dataplane.socket_planes import NS


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
