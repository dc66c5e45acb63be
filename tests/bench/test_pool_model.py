"""The pool model the cluster bench replays traces with (`kvstore.bench.pool_model`) and
its simulation at many nodes (`cluster_scale`): reads local first and one lookup for the
rest, puts placed, evictions counted, and the Redis work each costs."""

from __future__ import annotations

from kvstore.bench.cluster_scale import simulate
from kvstore.bench.pool_model import PoolModel, Served
from kvstore.bench.trace_file import TraceLine

CHAIN = tuple(range(1, 41))  # 40 blocks: two chain groups


def test_a_prefix_its_node_holds_costs_no_lookup_and_one_elsewhere_costs_one():
    alone = PoolModel(1, per_node=100)
    assert alone.serve(CHAIN) == Served(0, True, 2, 40, 0, 0)  # a miss asks the index
    assert alone.serve(CHAIN) == Served(40, False, 0, 0, 0, 1)  # all at home: no lookup
    pool = PoolModel(2, per_node=100)
    pool.serve(CHAIN)  # at node 0 (its first piece at least)
    second = pool.serve(CHAIN)  # served by node 1, which holds none of it
    assert (second.num_hit, second.looked_up, second.groups_looked_up) == (40, True, 2)
    assert 1 <= second.nodes_read <= 2 and second.num_stored == 0


def test_per_node_caches_share_nothing_and_evictions_are_counted():
    apart = PoolModel(2, per_node=100, shared=False)
    apart.serve(CHAIN)
    assert apart.serve(CHAIN).num_hit == 0  # node 1 does not see node 0's blocks
    small = PoolModel(1, per_node=10)
    assert small.serve(CHAIN).num_evicted == 30


def test_the_simulation_counts_redis_work_per_request_and_per_second():
    requests = [TraceLine(i * 1000, 40 * 512, 10, CHAIN) for i in range(10)]
    one, ten = simulate(requests, [1, 10], fraction=1.0)
    assert one["lookups_per_request"] == 0.1  # only the first: then its node holds it all
    assert one["redis_commands_per_request"] == (2 + 2 * 40) / 10
    assert ten["membership_commands_per_s"] == 10 * (4 / 2.0 + 2)
    assert ten["requests_per_s"] == 10 * one["requests_per_s"]
    assert ten["redis_primaries"] == 1
