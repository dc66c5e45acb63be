"""Data plane: bulk block bytes beside the gRPC control plane, over shared memory with
clients on the node's host and over UCX or a TCP stream with the others (`selection`).

`TRANSPORTS` maps a transport name to its server and client classes; the UCX ones import
`ucxx` only when constructed, so this package imports without the `ucx` extra.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from kvstore.dataplane.base import ChecksumMismatchError, DataPlaneClient, DataPlaneServer
from kvstore.dataplane.runtime import is_available
from kvstore.dataplane.shm_client import ShmClient
from kvstore.dataplane.shm_server import ShmServer
from kvstore.dataplane.tcp_client import TcpClient
from kvstore.dataplane.tcp_server import TcpServer
from kvstore.dataplane.ucx_client import UcxClient
from kvstore.dataplane.ucx_server import UcxServer


class Transport(NamedTuple):
    server: Callable[..., DataPlaneServer]
    client: Callable[..., DataPlaneClient]


TRANSPORTS: Mapping[str, Transport] = MappingProxyType(
    {
        "shm": Transport(ShmServer, ShmClient),
        "ucx": Transport(UcxServer, UcxClient),
        "tcp": Transport(TcpServer, TcpClient),
    }
)

__all__ = [
    "TRANSPORTS",
    "ChecksumMismatchError",
    "DataPlaneClient",
    "DataPlaneServer",
    "Transport",
    "is_available",
]
