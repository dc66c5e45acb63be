"""The client side: what an engine or a tool loads to use a node, and nothing of the node.

`Client` (blocking) and `AsyncClient` (asyncio) speak gRPC to a node and move block bytes
over the data plane `kvstore.dataplane.selection` picks; `common` is what they share;
`publishing` puts an engine's computed blocks off its step loop.
"""

from kvstore.client.async_client import AsyncClient
from kvstore.client.client import TRANSPORT_CHOICES, Client, GetResult

__all__ = ["TRANSPORT_CHOICES", "AsyncClient", "Client", "GetResult"]
