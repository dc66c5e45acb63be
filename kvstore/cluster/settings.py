"""The pool settings of a store node (a table `ServerConfig` holds: flags of `kvstore serve`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config import option
from kvstore.errors import InvalidArgumentError


@dataclass(frozen=True)
class PoolSettings:
    """Whether this node is one of a global pool, and how it takes part."""

    cluster: str = option(
        "",
        "Redis of the global pool: redis://[USER:PASSWORD@]HOST:PORT/DB, rediss://... (TLS), "
        "or a Redis Cluster's seeds, redis+cluster://HOST:PORT,HOST:PORT (empty: a node alone)",
    )
    node_id: str = option("", "this node's id in the pool (default: its advertised gRPC address)")
    advertise_host: str = option(
        "", "the host others reach this node at (default: --host, or this machine's name)"
    )
    cluster_ttl_s: float = option(
        2.0, "a node that renews nothing for this long is out of the pool (and fences itself)"
    )
    cluster_timeout_s: float = option(0.5, "the longest any Redis command may take")
    cluster_flush_s: float = option(0.05, "how often this node files its changes in the index")

    def __post_init__(self) -> None:
        if min(self.cluster_ttl_s, self.cluster_timeout_s, self.cluster_flush_s) <= 0:
            raise InvalidArgumentError("cluster timings must be positive")
        if self.cluster_timeout_s * 2 >= self.cluster_ttl_s:
            raise InvalidArgumentError("cluster_timeout_s must be under half cluster_ttl_s")
        if len(self.node_id.encode()) > 128 or any(c in self.node_id for c in " \n\r\t"):
            raise InvalidArgumentError("node_id: at most 128 bytes, no whitespace")
