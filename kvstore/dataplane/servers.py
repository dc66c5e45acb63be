"""The data-plane servers a node can start, by transport name (the node's side: a client
picks its own plane in `selection`). The UCX server imports `ucxx` only when constructed,
so this module imports without the `ucx` extra."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from kvstore.dataplane.base import DataPlaneServer
from kvstore.dataplane.shm.server import ShmServer
from kvstore.dataplane.tcp.server import TcpServer
from kvstore.dataplane.ucx.server import UcxServer

SERVERS: Mapping[str, Callable[..., DataPlaneServer]] = MappingProxyType(
    {"shm": ShmServer, "ucx": UcxServer, "tcp": TcpServer}
)
