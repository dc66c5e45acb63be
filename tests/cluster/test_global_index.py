"""The global block index on a real Redis and a real Redis Cluster: a chain's holders are
found in one pipelined round, as the longest prefix some live node holds (from the chain's
root, or from where a lookup says its keys start); a chain group
lands in one Redis Cluster slot and long chains spread over several; a dead or restarted
node's entries are never answered, and a restarted node's old fields are removed without
ever removing a newer one; a block one node drops stays with the others."""

from __future__ import annotations

from dataclasses import replace

from redis.cluster import RedisCluster

from kvstore.cluster.global_index import GlobalIndex
from kvstore.cluster.membership import Member, new_generation
from kvstore.cluster.redis_link import open_redis
from kvstore.keys import CHAIN_GROUP_BLOCKS, ChainPosition
from kvstore.store.inventory import Holding
from tests.store.store_cases import chain

NS_ID = bytes(range(32))  # a node-internal namespace id


def _holdings(keys: list[bytes], tier: str | None = "dram") -> list[Holding]:
    groups = [keys[d - d % CHAIN_GROUP_BLOCKS] for d in range(len(keys))]
    return [Holding(NS_ID, k, g, tier) for k, g in zip(keys, groups, strict=True)]


def _member(node_id: str) -> Member:
    return Member(node_id, new_generation(), {"grpc": "127.0.0.1:1"}, {"dram": 1 << 20})


def test_a_chain_is_located_in_one_round(redis):
    index = GlobalIndex(redis)
    a, b = _member("a"), _member("b")
    keys = chain(3 * CHAIN_GROUP_BLOCKS + 5)
    index.publish(a, _holdings(keys))
    index.publish(b, _holdings(keys[:40], "ssd"))
    rounds = index.locate_rounds
    found = index.locate(NS_ID, keys, {"a": a, "b": b})
    assert index.locate_rounds == rounds + 1
    assert len(found) == len(keys)
    assert [[(h.member.node_id, h.tier) for h in holders] for holders in found[:40]] == [
        [("a", "dram"), ("b", "ssd")]
    ] * 40  # the faster tier first
    assert all([h.member.node_id for h in holders] == ["a"] for holders in found[40:])


def test_the_rest_of_a_chain_is_located_in_one_round_from_where_it_starts(redis):
    index = GlobalIndex(redis)
    a = _member("a")
    keys = chain(3 * CHAIN_GROUP_BLOCKS + 5)
    index.publish(a, _holdings(keys))
    for start in (1, 40, 2 * CHAIN_GROUP_BLOCKS):
        rounds = index.locate_rounds
        found = index.locate(NS_ID, keys[start:], {"a": a}, ChainPosition.of(keys, start))
        assert (len(found), index.locate_rounds) == (len(keys) - start, rounds + 1)


def test_located_is_the_longest_prefix_held(redis):
    index = GlobalIndex(redis)
    a = _member("a")
    keys = chain(10)
    index.publish(a, _holdings(keys[:4]) + _holdings(keys)[6:])
    assert len(index.locate(NS_ID, keys, {"a": a})) == 4
    assert index.locate(NS_ID, chain(3, seed=9), {"a": a}) == []
    assert index.locate(NS_ID, [], {"a": a}) == []


def test_a_group_is_one_slot_and_a_long_chain_spreads(redis_cluster_servers):
    redis = open_redis(redis_cluster_servers.url)
    assert isinstance(redis, RedisCluster)
    keys = chain(8 * CHAIN_GROUP_BLOCKS)
    slots = [
        redis.keyslot(GlobalIndex.block_key(NS_ID, keys[d - d % CHAIN_GROUP_BLOCKS], k))
        for d, k in enumerate(keys)
    ]
    for g in range(8):
        assert len(set(slots[g * CHAIN_GROUP_BLOCKS : (g + 1) * CHAIN_GROUP_BLOCKS])) == 1
    assert len(set(slots)) > 1
    shards = {redis.get_node_from_key(GlobalIndex.block_key(NS_ID, k, k)).name for k in keys}
    assert len(shards) > 1  # groups named by their own first key spread over the primaries


def test_entries_of_a_dead_or_restarted_node_are_never_answered(redis):
    index = GlobalIndex(redis)
    a, b = _member("a"), _member("b")
    keys = chain(4)
    index.publish(a, _holdings(keys))
    index.publish(b, _holdings(keys))
    assert len(index.locate(NS_ID, keys, {"b": b})) == 4  # a is dead: b still holds them
    restarted = Member("b", new_generation())
    assert index.locate(NS_ID, keys, {"restarted": a, "b": restarted}) == []


def test_a_restarted_nodes_old_fields_are_removed_but_never_a_newer_one(redis):
    index = GlobalIndex(redis)
    old = _member("a")
    keys = chain(2)
    index.publish(old, _holdings(keys))
    new = Member("a", new_generation())
    assert index.locate(NS_ID, keys, {"a": new}) == []  # reads old fields: noted as stale
    index.publish(new, _holdings(keys[:1]))  # the restarted node files one block again
    key0 = GlobalIndex.block_key(NS_ID, keys[0], keys[0])
    key1 = GlobalIndex.block_key(NS_ID, keys[0], keys[1])
    assert redis.hgetall(key0) == {b"a": f"{new.generation} dram".encode()}  # kept
    assert redis.hgetall(key1) == {}  # the old one removed
    assert [len(h) for h in index.locate(NS_ID, keys, {"a": new})] == [1]


def test_a_block_one_node_drops_stays_with_the_others(redis):
    index = GlobalIndex(redis)
    a, b = _member("a"), _member("b")
    keys = chain(3)
    index.publish(a, _holdings(keys))
    index.publish(b, _holdings(keys))
    index.publish(a, [replace(h, tier=None) for h in _holdings(keys)[1:2]])
    live = {"a": a, "b": b}
    assert [[h.member.node_id for h in hs] for hs in index.locate(NS_ID, keys, live)] == [
        ["a", "b"],
        ["b"],
        ["a", "b"],
    ]


def test_hostile_fields_are_no_holders(redis):
    index = GlobalIndex(redis)
    a = _member("a")
    keys = chain(1)
    key = GlobalIndex.block_key(NS_ID, keys[0], keys[0])
    redis.hset(key, mapping={b"a": b"\xff\xfe", b"\xff": b"x y", b"b": f"{a.generation} hbm"})
    assert index.locate(NS_ID, keys, {"a": a, "b": Member("b", a.generation)}) == []


def test_a_sample_counts_each_blocks_live_holders(redis):
    index = GlobalIndex(redis)
    a, b = _member("a"), _member("b")
    keys = chain(40)
    index.publish(a, _holdings(keys))
    index.publish(b, _holdings(keys[:10]))
    assert index.sample({"a": a, "b": b}, 1000) == {1: 30, 2: 10}
    assert sum(index.sample({"a": a, "b": b}, 5).values()) == 5
    assert index.sample({"a": a}, 1000) == {1: 40}  # b is not live: its copies count for none
