"""The publisher between a real store and a real Redis: what the store commits is in the
index after one pass, what it evicts or removes leaves it; a frozen Redis fences the node
and no pass waits past Redis's timeouts; a Redis that goes away leaves the store serving
and the status degraded, and when it comes back empty the node files all it holds again
under a new generation (so nothing it filed before is answered); an inventory that
overflowed is filed whole again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvstore.bench.redis_servers import RedisServer
from kvstore.cluster.global_index import GlobalIndex
from kvstore.cluster.membership import Member, Membership, new_generation
from kvstore.cluster.publisher import Publisher
from kvstore.cluster.redis_link import open_redis
from kvstore.store import Store
from tests.store.store_cases import NS, chain, make_store, put


class Clock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def _publisher(url: str, store: Store, clock: Clock | None = None, **kw) -> Publisher:
    redis = open_redis(url, timeout_s=0.5)
    me = Member("n1", new_generation(), {"grpc": "127.0.0.1:1"}, {"dram": 1 << 20})
    membership = Membership(redis, me, clock=clock or time.monotonic)
    return Publisher(store, membership, GlobalIndex(redis), **kw)


def _located(pub: Publisher, keys: list[bytes]) -> int:
    """How many blocks of chain `keys` the index answers (the store has no tenants: its
    internal namespace id is the namespace's own)."""
    return len(pub.index.locate(NS.id, keys, pub.membership.refresh()))


@pytest.fixture
def store() -> Iterator[Store]:
    store = make_store(num_blocks=16, policy="lru")
    yield store
    store.close()


def test_commits_are_filed_and_evictions_leave(redis_url, store):
    pub = _publisher(redis_url, store)
    old, new = chain(8, seed=1), chain(12, seed=2)
    put(store, old)
    pub.run_once()
    assert _located(pub, old) == 8
    put(store, new)  # evicts the oldest of `old` (LRU): its root first
    pub.run_once()
    assert _located(pub, old) == 0
    assert _located(pub, new) == 12
    store.remove(NS.id, new[6:])
    pub.run_once()
    assert _located(pub, new) == 6
    status = pub.status()
    assert status.redis_ok and not status.fenced and len(pub.membership.live()) == 1


def test_a_frozen_redis_fences_the_node_and_no_pass_waits_past_its_timeouts(redis_single, store):
    clock = Clock()
    pub = _publisher(redis_single.url, store, clock=clock)
    keys = chain(3)
    put(store, keys)
    pub.run_once()
    redis_single.freeze()
    try:
        put(store, chain(2, seed=4))  # to publish
        started = time.monotonic()
        pub.run_once()  # renewal, read and publish time out: at most two calls' timeouts
        assert time.monotonic() - started < 3 * 0.5
        assert not pub.status().redis_ok
        clock.now += pub.membership.ttl_s
        assert pub.status().fenced
    finally:
        redis_single.thaw()
    pub.run_once()  # renewed: back in the pool under a new generation, all filed again
    assert not pub.status().fenced
    assert _located(pub, keys) == 3


def test_redis_away_then_back_empty_is_rebuilt_under_a_new_generation(redis_single, store):
    pub = _publisher(redis_single.url, store)
    keys = chain(6)
    put(store, keys)
    pub.run_once()
    first = pub.membership.me.generation
    redis_single.stop()
    put(store, chain(4, seed=5))
    pub.run_once()
    status = pub.status()
    assert not status.redis_ok and status.last_error
    assert store.read(NS.id, keys)  # the node serves what it holds meanwhile
    RedisServer.start(redis_single)  # back, empty
    pub.run_once()
    assert pub.membership.me.generation != first
    assert pub.status().redis_ok and pub.status().num_pending == 0
    assert _located(pub, keys) == 6 and _located(pub, chain(4, seed=5)) == 4
    assert pub.status().rebuild_seconds > 0


def test_an_overflowed_inventory_is_filed_whole_again(redis_url):
    store = make_store(num_blocks=64)
    pub = _publisher(redis_url, store, slice_blocks=5)
    pub.run_once()
    store.watch_inventory(max_changes=3)  # smaller than one put
    keys = chain(12)
    put(store, keys)
    passes = 0
    while passes == 0 or pub.status().num_pending:
        pub.run_once()
        passes += 1
    assert passes == 3  # 12 blocks, 5 a pass
    assert _located(pub, keys) == 12
    store.close()
