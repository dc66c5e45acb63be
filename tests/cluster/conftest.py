"""Real Redis servers for the cluster tests: one Redis, and a Redis Cluster of three
primaries with a replica each, on free ports (`kvstore.bench.redis_servers`). A server that
cannot start fails the test that needs it (`make redis` installs redis-server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.bench.redis_servers import RedisCluster, RedisServer, redis_cluster, redis_server
from kvstore.cluster.redis_link import Redis, open_redis


@pytest.fixture
def redis_single() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster_servers() -> Iterator[RedisCluster]:
    with redis_cluster(primaries=3, replicas=1) as cluster:
        yield cluster


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs on one Redis and on a Redis Cluster (emptied first)."""
    if request.param == "redis":
        return request.getfixturevalue("redis_single").url
    cluster: RedisCluster = request.getfixturevalue("redis_cluster_servers")
    for server in cluster.servers[: cluster.primaries]:
        server.cli("flushall")
    return cluster.url


@pytest.fixture
def redis(redis_url: str) -> Iterator[Redis]:
    client = open_redis(redis_url, timeout_s=2.0)
    yield client
    client.close()
