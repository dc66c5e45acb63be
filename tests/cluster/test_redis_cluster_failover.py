"""A Redis Cluster primary killed under the index: chains whose groups live on the other
shards are located throughout, and the killed shard's chains are located again once its
replica has taken over (the seconds measured), with no call raising out of the pool."""

from __future__ import annotations

import time

from kvstore.bench.redis_servers import redis_cluster
from kvstore.cluster.global_index import GlobalIndex
from kvstore.cluster.membership import Member, new_generation
from kvstore.cluster.redis_link import open_redis
from tests.cluster.test_global_index import NS_ID, _holdings
from tests.store.store_cases import chain

CHAINS = 12


def _locate_or_none(index: GlobalIndex, keys: list[bytes], live: dict) -> int | None:
    try:
        return len(index.locate(NS_ID, keys, live))
    except Exception:  # a shard mid-failover: the pool turns this into a miss
        return None


def test_a_killed_primarys_replica_takes_over_and_other_shards_keep_serving():
    with redis_cluster(primaries=3, replicas=1) as cluster:
        redis = open_redis(cluster.url, timeout_s=0.5)
        index = GlobalIndex(redis)
        me = Member("a", new_generation())
        chains = [chain(8, seed=s) for s in range(CHAINS)]
        for keys in chains:
            index.publish(me, _holdings(keys))
        shards = [redis.get_node_from_key(index.block_key(NS_ID, k[0], k[0])).port for k in chains]
        victim = next(s for s in cluster.servers if s.port == shards[0])
        on_victim = [k for k, port in zip(chains, shards, strict=True) if port == victim.port]
        elsewhere = [k for k, port in zip(chains, shards, strict=True) if port != victim.port]
        assert elsewhere, "every chain on one shard: the tags do not spread"
        cluster.wait_replicated()  # else the replica may take over without the last writes
        victim.stop()
        killed = time.monotonic()
        live = {"a": me}
        for keys in elsewhere:  # the other shards serve meanwhile
            assert _locate_or_none(index, keys, live) == 8
        deadline = killed + 15.0
        while (located := _locate_or_none(index, on_victim[0], live)) != 8:
            if time.monotonic() > deadline:  # what the survivors say, to tell why
                survivor = next(s for s in cluster.servers if s is not victim)
                nodes = survivor.cli("cluster", "nodes")
                raise AssertionError(f"the replica never took over ({located=}):\n{nodes}")
            time.sleep(0.1)
        print(f"failover: located again {time.monotonic() - killed:.2f} s after the kill")
        assert all(_locate_or_none(index, keys, live) == 8 for keys in on_victim)
        redis.close()
