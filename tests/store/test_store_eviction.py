"""Eviction in one DRAM-only store, in process, on an injected clock: a full store evicts by
its policy and counts it (prefix-aware policies take chain tails before their parents, plain
LRU takes roots), a leased block is never evicted, a store full of leased blocks refuses a
reserve and reserves nothing, and a lease that expires makes its blocks evictable again."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.store.eviction import POLICIES
from tests.store.store_cases import NS, chain, make_store, payload, put


# Recency policies only: prefix-2q evicts each chain's never-read last block first.
@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
def test_full_store_evicts_and_counts(policy):
    store = make_store(num_blocks=8, policy=policy)
    chains = [chain(4, seed=s) for s in range(4)]
    for keys in chains:
        put(store, keys)
    stats = store.stats()
    assert (stats.num_blocks, stats.evictions, stats.blocks_committed) == (8, 8, 16)
    for keys in chains[2:]:  # the two most recent chains survive whole
        assert store.read(NS.id, keys) == [payload(k) for k in keys]


def test_prefix_lru_evicts_tails_before_parents_lru_evicts_roots():
    outcomes = {}
    for policy in ("lru", "prefix-lru"):
        store = make_store(num_blocks=8, policy=policy)
        put(store, chain(4, seed=1))
        old = chain(4, seed=0)
        put(store, old)
        store.read(NS.id, old)  # old chain is now the most recent
        put(store, chain(2, seed=2))  # two evictions
        outcomes[policy] = store.match(NS.id, chain(4, seed=1)).num_matched
    # LRU touched the chain root first, so it evicted the root: nothing matches.
    # Prefix-aware LRU evicted the two tail blocks: the first two still match.
    assert outcomes == {"lru": 0, "prefix-lru": 2}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_leased_blocks_are_never_evicted(policy):
    store = make_store(num_blocks=4, policy=policy)
    keys = chain(4)
    put(store, keys)
    lease = store.acquire(NS.id, keys[:2])
    put(store, chain(2, seed=1))
    store.check_integrity()
    assert store.match(NS.id, keys[:2]).num_matched == 2
    assert [bytes(v) for v in lease.views] == [payload(k) for k in keys[:2]]
    with pytest.raises(errors.StoreFullError):
        put(store, chain(3, seed=2))
    store.check_integrity()
    lease.release()
    put(store, chain(3, seed=2))


def test_store_full_of_leases_raises_and_reserves_nothing():
    store = make_store(num_blocks=4)
    keys = chain(4)
    put(store, keys)
    store.acquire(NS.id, keys)
    before = store.stats()
    with pytest.raises(errors.StoreFullError):
        store.reserve(NS.id, chain(1, seed=5))
    store.check_integrity()
    assert store.stats().num_reservations == before.num_reservations
    assert store.stats().tiers == before.tiers


def test_lease_expires_and_block_becomes_evictable():
    store = make_store(num_blocks=4, lease_timeout_s=10.0)
    keys = chain(4)
    put(store, keys)
    store.acquire(NS.id, keys)
    store.clock.now += 10.0
    put(store, chain(1, seed=3))  # reserve sweeps the expired lease, then evicts
    stats = store.stats()
    assert (stats.expired_leases, stats.num_leases, stats.evictions) == (1, 0, 1)
