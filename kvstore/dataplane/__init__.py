"""Data plane: bulk block bytes beside the gRPC control plane, over shared memory with
clients on the node's host and over UCX or a TCP stream with the others.

One subpackage a transport (`shm`, `tcp`, `ucx`), each with its `client` and `server`;
`sockets` holds what the two socket planes share. A node starts its planes from
`servers.SERVERS`; a client picks its plane in `selection`. This package itself holds only
the contract, so a client never loads a server (nor the store behind it).
"""

from kvstore.dataplane.base import ChecksumMismatchError, DataPlaneClient, DataPlaneServer

__all__ = ["ChecksumMismatchError", "DataPlaneClient", "DataPlaneServer"]
