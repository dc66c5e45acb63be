"""A Redis connection for the cluster's metadata: one Redis (`redis://`, `rediss://` for
TLS, `unix://`) or a Redis Cluster reached through a seed list
(`redis+cluster://HOST:PORT,HOST:PORT`, `rediss+cluster://...`), with the user and password
in the URL as Redis users deploy them (`redis://USER:PASSWORD@HOST:PORT/DB`).

A cache on the request path must not wait on Redis: every command has a short socket
timeout and is tried once (redis-py's defaults wait 5 s and retry 10 times). What fails
raises `redis.RedisError`; the callers turn that into misses.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvstore.errors import InvalidArgumentError

DEFAULT_TIMEOUT_S = 0.5
Redis = redis.Redis | RedisCluster


def open_redis(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Redis:
    """A client of the Redis or Redis Cluster `url` names; connects on first use."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    common: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if scheme in ("redis+cluster", "rediss+cluster"):
        seeds = [_host_port(seed) for seed in parts.netloc.rpartition("@")[2].split(",")]
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in seeds],
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            ssl=scheme == "rediss+cluster",
            require_full_coverage=False,  # the shards still up keep serving
            **common,
        )
    if scheme not in ("redis", "rediss", "unix"):
        raise InvalidArgumentError(
            f"not a Redis URL: {url!r} (redis://, rediss://, redis+cluster://)"
        )
    return redis.Redis.from_url(url, **common)


def _host_port(seed: str) -> tuple[str, int]:
    host, sep, port = seed.strip().rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgumentError(f"a Redis Cluster seed is HOST:PORT, not {seed!r}")
    return host.strip("[]"), int(port)
