"""The store's inventory as a mirror reads it (`Store.watch_inventory`): every commit,
eviction, removal, demotion and promotion is noted with the block's state now; each block
knows its place and chain group (a piece whose parent another node holds, at the place its
writer states); a restarted store places its recovered blocks again; and
past its bound the inventory says it forgot (the mirror then reads every block)."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.keys import CHAIN_GROUP_BLOCKS, MAX_CHAIN_DEPTH, ChainPosition
from kvstore.store.inventory import Holding
from tests.store import ssd_fault_cases as ssd
from tests.store.store_cases import NS, chain, make_store, payload, put


def _tiers(holdings: list[Holding]) -> dict[bytes, str | None]:
    return {h.key: h.tier for h in holdings}


def test_a_commit_is_noted_with_its_tier_and_chain_group():
    store = make_store(num_blocks=128)
    store.watch_inventory()
    keys = chain(2 * CHAIN_GROUP_BLOCKS + 3)
    put(store, keys[:10])
    put(store, keys[10:], parent=keys[9])  # a second call below the first
    changed, overflowed = store.inventory_changes()
    assert not overflowed
    assert [h.key for h in sorted(changed, key=lambda h: keys.index(h.key))] == keys
    groups = {h.key: h.group for h in changed}
    for depth, key in enumerate(keys):
        assert groups[key] == keys[depth - depth % CHAIN_GROUP_BLOCKS]
    assert set(_tiers(changed).values()) == {"dram"}
    assert {h.namespace_id for h in changed} == {NS.id}  # a node without tenants: its own
    assert store.inventory_changes() == ([], False)  # taken: nothing new


def test_evictions_and_removals_are_noted_as_not_held():
    store = make_store(num_blocks=8, policy="lru")
    store.watch_inventory()
    old, new = chain(4, seed=1), chain(8, seed=2)
    put(store, old)
    store.inventory_changes()
    put(store, new)  # evicts all of `old`
    tiers = _tiers(store.inventory_changes()[0])
    assert all(tiers[k] is None for k in old)
    assert all(tiers[k] == "dram" for k in new)
    store.remove(NS.id, new[-1:])
    assert _tiers(store.inventory_changes()[0]) == {new[-1]: None}


def test_an_aborted_put_is_never_held():
    store = make_store()
    store.watch_inventory()
    keys = chain(3)
    store.reserve(NS.id, keys, [None, *keys[:-1]]).abort()
    assert {h.tier for h in store.inventory_changes()[0]} <= {None}
    assert store.held_ids() == []


def test_demotion_and_promotion_move_a_block_between_tiers(tmp_path):
    store = ssd.make_store(tmp_path, dram_blocks=4, ssd_blocks=32)
    store.watch_inventory()
    first, second = ssd.chain(4, seed=1), ssd.chain(4, seed=2)
    ssd.put(store, first)
    ssd.put(store, second)  # `first` leaves DRAM for SSD
    tiers = _tiers(store.inventory_changes()[0])
    assert [tiers[k] for k in first] == ["ssd"] * 4
    store.read(ssd.NS.id, first)  # back in DRAM
    tiers = _tiers(store.inventory_changes()[0])
    assert [tiers[k] for k in first] == ["dram"] * 4
    store.close()


def test_a_restarted_store_places_what_it_recovered(tmp_path):
    keys = ssd.chain(CHAIN_GROUP_BLOCKS + 8, seed=3)
    store = ssd.make_store(tmp_path, dram_blocks=4, ssd_blocks=64)
    for i in range(0, len(keys), 4):  # all but the last few leave DRAM for SSD
        run = keys[i : i + 4]
        res = store.reserve(ssd.NS.id, run, [keys[i - 1] if i else None, *run[:-1]])
        for j, key in enumerate(run):
            res.write(j, 0, ssd.payload(key))
        res.commit()
    store.close()
    reopened = ssd.make_store(tmp_path, dram_blocks=4, ssd_blocks=64)
    held = reopened.holdings(reopened.held_ids())
    assert len(held) > CHAIN_GROUP_BLOCKS  # across a group boundary
    expected = {key: keys[d - d % CHAIN_GROUP_BLOCKS] for d, key in enumerate(keys)}
    assert {h.key: h.group for h in held} == {h.key: expected[h.key] for h in held}
    assert {h.tier for h in held} == {"ssd"}
    reopened.close()


def test_past_its_bound_the_inventory_says_it_forgot():
    store = make_store(num_blocks=64)
    store.watch_inventory(max_changes=5)
    put(store, chain(6))
    assert store.inventory_changes() == ([], True)
    put(store, chain(2, seed=1))
    changed, overflowed = store.inventory_changes()
    assert (len(changed), overflowed) == (2, False)
    assert len(store.holdings(store.held_ids())) == 8


def test_a_piece_whose_parent_is_elsewhere_is_filed_at_its_stated_place():
    store = make_store(num_blocks=128)
    store.watch_inventory()
    keys = chain(2 * CHAIN_GROUP_BLOCKS + 4)
    group_start = CHAIN_GROUP_BLOCKS  # this node holds from here on; another the rest
    piece = keys[group_start + 5 :]  # starts inside the second group
    position = ChainPosition(group_start + 5, keys[group_start])
    res = store.reserve(NS.id, piece, [keys[group_start + 4], *piece[:-1]], position=position)
    for i, key in enumerate(piece):
        res.write(i, 0, payload(key))
    res.commit()
    groups = {h.key: h.group for h in store.inventory_changes()[0]}
    for depth in range(group_start + 5, len(keys)):
        assert groups[keys[depth]] == keys[depth - depth % CHAIN_GROUP_BLOCKS]
    assert store.match(NS.id, keys).num_matched == 0  # its chain's head is on another node


@pytest.mark.parametrize(
    "case",
    ["no parent", "depth 0", "depth past the bound", "short group", "aligned, group not itself"],
)
def test_a_position_that_cannot_be_is_refused_and_reserves_nothing(case):
    store = make_store()
    keys = chain(CHAIN_GROUP_BLOCKS + 2)
    piece, parent = keys[3:], keys[2]
    parents: list[bytes | None] = [parent, *piece[:-1]]
    position = {
        "no parent": ChainPosition(3, keys[0]),
        "depth 0": ChainPosition(0, keys[0]),
        "depth past the bound": ChainPosition(MAX_CHAIN_DEPTH, keys[0]),
        "short group": ChainPosition(3, keys[0][:8]),
        "aligned, group not itself": ChainPosition(CHAIN_GROUP_BLOCKS, keys[0]),
    }[case]
    if case == "no parent":
        parents[0] = None
    if case == "aligned, group not itself":
        piece, parents = keys[CHAIN_GROUP_BLOCKS:], [keys[CHAIN_GROUP_BLOCKS - 1], keys[-2]]
    with pytest.raises(errors.InvalidArgumentError):
        store.reserve(NS.id, piece, parents, position=position)
    assert store.stats().num_reservations == 0


def test_without_a_position_a_parent_held_elsewhere_cuts_the_chain():
    store = make_store()
    keys = chain(4)
    with pytest.raises(errors.UnknownParentError):
        store.reserve(NS.id, keys[2:], [keys[1], keys[2]])
