"""Placement of a put over a pool (`kvstore.client.placement`): pieces never straddle a
chain group and each says where it sits in its chain; nodes receive pieces in proportion
to their capacity, the same from every writer, and a joining node moves only what it
wins; the writer's own node is preferred only where that costs no balance."""

from __future__ import annotations

import collections
import itertools

from kvstore.client.placement import choose, place
from kvstore.keys import CHAIN_GROUP_BLOCKS, ChainPosition, KVLayout, Namespace, block_keys

GiB = 1 << 30
NS = Namespace("placement", KVLayout("float16", 2, 2, 16, 4))


def _chain(n: int) -> list[bytes]:
    return block_keys(NS, list(range(n * NS.block_tokens)))


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in range(n)]


def test_pieces_follow_chain_groups_and_state_their_place():
    keys = _chain(3 * CHAIN_GROUP_BLOCKS)
    start = 20  # a put that continues a chain inside its first group
    nodes = {f"n{i}": GiB for i in range(8)}
    pieces = place(keys[start:], ChainPosition.of(keys, start), nodes, "n0")
    assert pieces[0].start == 0 and pieces[-1].stop == len(keys) - start
    for before, after in itertools.pairwise(pieces):
        assert before.stop == after.start and before.address != after.address
    for piece in pieces:
        depth = start + piece.start
        assert piece.position == ChainPosition.of(keys, depth)
    cuts = {start + p.start for p in pieces[1:]}
    assert all(cut % CHAIN_GROUP_BLOCKS == 0 for cut in cuts)  # never inside a group
    assert place(keys, None, nodes, "n0")[0].position is None  # a chain's root


def test_nodes_take_pieces_in_proportion_to_their_capacity():
    nodes = {"small": 1 * GiB, "mid": 2 * GiB, "large": 5 * GiB}
    counts = collections.Counter(choose(k, nodes, "elsewhere") for k in _keys(8000))
    for address, capacity in nodes.items():
        share = counts[address] / 8000
        assert abs(share - capacity / (8 * GiB)) < 0.03, (address, share)


def test_every_writer_places_a_piece_alike_and_a_joining_node_moves_only_what_it_wins():
    nodes = {f"n{i}": GiB for i in range(5)}
    keys = _keys(2000)
    before = [choose(k, nodes, "w") for k in keys]
    assert before == [choose(k, dict(reversed(nodes.items())), "w") for k in keys]
    after = [choose(k, {**nodes, "n5": GiB}, "w") for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == "n5" for _, a in moved)
    assert 0.1 < len(moved) / len(keys) < 0.25  # about 1/6 moved, all to the newcomer


def test_the_writers_node_is_preferred_only_where_it_costs_no_balance():
    keys = _keys(6000)
    equal = {"home": GiB, "b": GiB, "c": GiB}
    share = sum(choose(k, equal, "home") == "home" for k in keys) / len(keys)
    assert 0.6 < share < 0.73  # one of the best two of three: about 2/3
    small_home = {"home": GiB, "b": 4 * GiB, "c": 4 * GiB}
    share = sum(choose(k, small_home, "home") == "home" for k in keys) / len(keys)
    assert share < 1 / 9 + 0.03  # never more than its capacity's share


def test_a_puts_first_piece_stays_home_and_the_rest_spread_even_over_two_nodes():
    two = {"home": GiB, "b": GiB}
    later = []
    for seed in range(200):
        keys = [(seed << 16 | i).to_bytes(4, "big") * 8 for i in range(4 * CHAIN_GROUP_BLOCKS)]
        pieces = place(keys, None, two, "home")
        assert pieces[0].address == "home"
        for group in range(CHAIN_GROUP_BLOCKS, len(keys), CHAIN_GROUP_BLOCKS):
            later += [p.address for p in pieces if p.start <= group < p.stop]
    assert 0.4 < later.count("home") / len(later) < 0.6


def test_without_members_everything_goes_home():
    keys = _chain(70)
    assert [(p.start, p.stop, p.address) for p in place(keys, None, {}, "me")] == [(0, 70, "me")]
