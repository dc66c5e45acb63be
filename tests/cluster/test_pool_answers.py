"""What a client takes from a node's pool answers, and what a node takes as pool settings:
a Locate answer that names nodes or tiers that are not there, or more blocks than were
asked about, is read as the holders it can be; pool settings that cannot work are refused
before the node starts."""

from __future__ import annotations

import pytest

from kvstore import wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore.cluster.settings import PoolSettings
from kvstore.errors import InvalidArgumentError


def _answer(*blocks: tuple[list[int], list[int]]) -> pb.LocateResponse:
    nodes = [pb.PoolNode(node_id="a", addresses={"grpc": "127.0.0.1:1"})]
    holders = [pb.BlockHolders(nodes=n, tiers=t) for n, t in blocks]
    return pb.LocateResponse(nodes=nodes, blocks=holders)


def test_a_hostile_locate_answer_is_read_as_the_holders_it_can_be():
    dram, ssd = pb.TIER_DRAM, pb.TIER_SSD
    answer = _answer(
        ([0, 7], [dram, dram]),  # a holder index past the nodes listed
        ([0, 0], [99, ssd]),  # a tier that is none
        ([0], []),  # a holder without a tier
        ([0], [dram]),  # past the gap: not a prefix
    )
    located = wire.located_from_pb(answer, num_keys=8)
    assert located.blocks == (((0, "dram"),), ((0, "ssd"),))
    assert located.nodes[0].node_id == "a"
    assert wire.located_from_pb(_answer(*[([0], [dram])] * 10), num_keys=3).num_located == 3
    assert wire.located_from_pb(pb.LocateResponse(), num_keys=3).num_located == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"cluster_ttl_s": 0},
        {"cluster_timeout_s": -1},
        {"cluster_flush_s": 0},
        {"cluster_ttl_s": 1.0, "cluster_timeout_s": 0.5},  # a timeout of half the TTL
        {"node_id": "two words"},
        {"node_id": "x" * 129},
    ],
)
def test_pool_settings_that_cannot_work_are_refused(fields):
    with pytest.raises(InvalidArgumentError):
        PoolSettings(cluster="redis://127.0.0.1:6379/0", **fields)
