"""Chain links stay acyclic: a parent is committed in the namespace or earlier in the call,
never the key itself, and a key that came back never lands below its own children."""

from __future__ import annotations

import contextlib
import random

import pytest

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import PutStatus
from kvstore.store import Store, StoreConfig
from kvstore.store.tiers.base import Record, RecordHeader
from kvstore.store.tiers.ssd import SsdTier

NS = Namespace("chain-model", KVLayout("float16", 2, 1, 8, 4))  # 256-byte blocks
OTHER_NS = Namespace("other-model", KVLayout("float16", 2, 1, 8, 4))
BLOCK = NS.block_bytes
PREFIX_POLICIES = ["prefix-lru", "prefix-2q"]


def _make_store(policy: str = "prefix-lru", num_blocks: int = 16) -> Store:
    config = StoreConfig(dram_bytes=num_blocks * BLOCK, slab_bytes=4 * BLOCK, policy=policy)
    store = Store(config)
    store.register_namespace(NS)
    store.register_namespace(OTHER_NS)
    return store


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def _payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key)))[:BLOCK]


def _put(store: Store, keys: list[bytes], parents: list[bytes | None], ns: Namespace = NS) -> None:
    res = store.reserve(ns.id, keys, parents)
    for i, status in enumerate(res.statuses):
        if status is PutStatus.RESERVED:
            res.write(i, 0, _payload(keys[i]))
    res.commit()
    store.check_integrity()


def _put_chain(
    store: Store, keys: list[bytes], parent: bytes | None = None, ns: Namespace = NS
) -> None:
    _put(store, keys, [parent, *keys[:-1]], ns)


def _refused(store: Store, error: type[Exception], keys: list[bytes], parents: list) -> None:
    before = store.stats()
    with pytest.raises(error):
        store.reserve(NS.id, keys, parents)
    after = store.stats()
    assert (after.num_blocks, after.num_reservations) == (before.num_blocks, 0)
    assert after.tiers == before.tiers
    store.check_integrity()


def test_a_key_is_never_its_own_parent():
    with _make_store() as store:
        [key] = _chain(1)
        _refused(store, errors.ChainCycleError, [key], [key])
        other = _chain(1, seed=1)[0]
        _refused(store, errors.ChainCycleError, [other, key], [None, key])


def test_a_parent_later_in_the_call_is_unknown():
    with _make_store() as store:
        a, b = _chain(2)
        _refused(store, errors.UnknownParentError, [a, b], [b, a])  # a 2-cycle in one call
        _refused(store, errors.UnknownParentError, [b, a], [a, None])


@pytest.mark.parametrize("where", ["never stored", "in flight", "other namespace", "removed"])
def test_a_parent_that_is_not_committed_in_the_namespace_is_refused(where):
    with _make_store() as store:
        parent, child = _chain(2)
        if where == "in flight":
            store.reserve(NS.id, [parent])
        elif where == "other namespace":
            _put_chain(store, [parent], ns=OTHER_NS)
        elif where == "removed":
            _put_chain(store, [parent])
            store.remove(NS.id, [parent])
        with pytest.raises(errors.UnknownParentError, match="chain is cut"):
            store.reserve(NS.id, [child], [parent])
        store.check_integrity()


def test_an_evicted_parent_cuts_the_chain_and_a_new_root_starts_it_again():
    with _make_store(policy="lru", num_blocks=4) as store:
        chain = _chain(6)
        _put_chain(store, chain[:2])
        _put_chain(store, _chain(4, seed=1))  # evicts the first chain
        assert store.match(NS.id, chain).num_matched == 0
        with pytest.raises(errors.UnknownParentError):
            store.reserve(NS.id, chain[2:4], [chain[1], chain[2]])
        _put_chain(store, chain[:4])  # from its root again: accepted
        assert store.match(NS.id, chain).num_matched == 4


@pytest.mark.parametrize("depth", [1, 4])
def test_a_key_back_after_removal_never_lands_below_its_children(depth):
    with _make_store() as store:
        chain = _chain(depth + 1)
        _put_chain(store, chain)
        store.remove(NS.id, chain[:1])  # its children still name it
        _refused(store, errors.ChainCycleError, chain[:1], [chain[-1]])
        _put_chain(store, chain[:1])  # back as the root it was: accepted, and linked
        assert store.match(NS.id, chain).num_matched == depth + 1


def test_a_call_may_build_on_its_own_earlier_keys_and_on_present_ones():
    with _make_store() as store:
        chain = _chain(4)
        _put_chain(store, chain[:2])
        res = store.reserve(NS.id, chain, [None, chain[0], chain[1], chain[2]])
        assert res.statuses == (PutStatus.PRESENT,) * 2 + (PutStatus.RESERVED,) * 2
        res.abort()
        store.check_integrity()


@pytest.mark.parametrize("policy", PREFIX_POLICIES)
@pytest.mark.parametrize("seed", range(8))
def test_hostile_links_never_leave_a_block_that_cannot_be_evicted(policy, seed):
    """Random links, removals and re-puts over four keys; after every few, a fresh chain the
    size of all of DRAM still fits: every block that got in can be evicted."""
    rng = random.Random(seed)
    keys = _chain(4, seed=seed)
    fresh = _chain(16, seed=100 + seed)
    with _make_store(policy=policy, num_blocks=16) as store:
        for _ in range(20):
            for _ in range(40):
                key = rng.choice(keys)
                if rng.random() < 0.3:
                    store.remove(NS.id, [key])
                    continue
                with contextlib.suppress(errors.BadParentError):
                    _put(store, [key], [rng.choice([None, key, *keys])])
            _put_chain(store, fresh)
            assert store.stats().num_blocks == 16
            store.remove(NS.id, fresh)


def test_links_that_close_a_cycle_on_ssd_are_cut_at_start_up(tmp_path):
    """Records written before links were checked: a self-parent and a 2-cycle come back as
    evictable blocks."""
    path = tmp_path / "ssd"
    own, a, b = _chain(3)
    tier = SsdTier(str(path), 64 * BLOCK)
    tier.save_meta(NS.id, NS.encode())
    links = [(own, own), (a, b), (b, a)]
    tier.write(
        [
            Record(NS.id + key, RecordHeader(NS.id, parent, checksum(_payload(key)), BLOCK, seq), p)
            for seq, (key, parent) in enumerate(links, start=1)
            if (p := _payload(key))
        ]
    )
    tier.close()
    config = StoreConfig(
        dram_bytes=16 * BLOCK, slab_bytes=4 * BLOCK, ssd_path=str(path), ssd_bytes=64 * BLOCK
    )
    with Store(config) as store:
        store.check_integrity()
        assert set(store.eviction_order("ssd")) == {(NS.id, own), (NS.id, a)}
        assert store.read(NS.id, [own, a, b]) == [_payload(k) for k in (own, a, b)]
