"""Membership on a real Redis and a real Redis Cluster: nodes join with their records, a
node that stops renewing is dead to readers at its deadline (counted on the reader's clock,
no Redis call needed), a node that cannot renew fences itself, a Redis restarted empty is
noticed, and records that are not well formed are ignored."""

from __future__ import annotations

from kvstore.cluster.membership import Member, Membership, new_generation


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _member(node_id: str) -> Member:
    addresses = {"grpc": f"10.0.0.{len(node_id)}:50051", "tcp": "10.0.0.1:50052"}
    return Member(node_id, new_generation(), addresses, {"dram": 1 << 30})


def test_nodes_join_and_read_each_other(redis):
    a, b = Membership(redis, _member("a")), Membership(redis, _member("b"))
    assert a.renew() is False and b.renew() is False  # first joins: nothing lost
    live = a.refresh()
    assert set(live) == {"a", "b"}
    assert live["b"] == b.me  # addresses, capacity and generation as b filed them
    assert not a.is_fenced


def test_a_node_that_stops_renewing_is_dead_at_its_deadline(redis):
    clock = Clock()
    reader = Membership(redis, _member("reader"), ttl_s=5.0, clock=clock)
    silent = Membership(redis, _member("silent"), ttl_s=5.0)
    silent.renew()
    assert "silent" in reader.refresh()
    clock.now += 4.9
    assert "silent" in reader.live()
    clock.now += 0.2  # past its deadline: gone, whatever Redis says or not
    assert "silent" not in reader.live()


def test_a_clean_leave_is_seen_at_the_next_read(redis):
    a, b = Membership(redis, _member("a")), Membership(redis, _member("b"))
    a.renew()
    b.renew()
    b.leave()
    assert set(a.refresh()) == {"a"}


def test_a_node_that_cannot_renew_fences_itself(redis):
    clock = Clock()
    node = Membership(redis, _member("n"), ttl_s=2.0, clock=clock)
    assert node.is_fenced  # not in the pool before its first renewal
    node.renew()
    clock.now += 1.9
    assert not node.is_fenced
    clock.now += 0.1
    assert node.is_fenced
    assert node.renew() is True  # back: what it filed before is to be filed again
    assert not node.is_fenced


def test_a_redis_restarted_empty_is_noticed(redis):
    node = Membership(redis, _member("n"))
    node.renew()
    assert node.renew() is False
    redis.flushall()  # every primary of a Redis Cluster
    assert node.renew() is True


def test_records_that_are_not_well_formed_are_ignored(redis):
    node = Membership(redis, _member("n"))
    node.renew()
    redis.hset(node.key, "x", b"\xff{not json")
    redis.hset(node.key, "x:until", b"99999999999999")
    redis.hset(node.key, "y", Member("y", "g").encode())
    redis.hset(node.key, "y:until", b"soon")
    redis.hset(node.key, "z", b'{"node_id": "z"}')
    assert set(node.refresh()) == {"n"}
