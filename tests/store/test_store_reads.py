"""Reads from one store, in process, on an injected clock: `match` finds the longest
committed prefix, a key means nothing in another namespace, and a `Lease` holds the blocks
it found until released or expired. `Lease.read_chunk` copies a live lease's bytes and
renews it, and refuses an ended one rather than read a slot that may hold another block. A
block removed while leased keeps its slot until the release; a corrupted one is a miss;
hits, misses and bytes are counted."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.store.caller import Caller
from tests.store.store_cases import BLOCK, NS, OTHER_NS, chain, make_store, payload, put


def test_match_stops_at_first_missing_key():
    store = make_store()
    keys = chain(4)
    put(store, keys[:2])
    put(store, keys[3:])  # a chain of its own: keys[2], its parent, was never stored
    assert store.match(NS.id, keys).num_matched == 2
    assert store.match(NS.id, keys[3:]).num_matched == 1


def test_keys_of_another_namespace_miss():
    store = make_store()
    store.register_namespace(OTHER_NS)
    keys = chain(2)
    put(store, keys)
    assert store.match(OTHER_NS.id, keys).num_matched == 0
    assert store.read(OTHER_NS.id, keys) == [None, None]
    assert store.remove(OTHER_NS.id, keys) == 0


def test_read_chunk_copies_a_live_lease_and_renews_it():
    store = make_store(lease_timeout_s=10.0)
    keys = chain(2)
    put(store, keys)
    lease = store.acquire(NS.id, [keys[0], chain(1, seed=5)[0], keys[1]])
    for offset in range(0, BLOCK, 64):  # 40 s in all, never 10 s without a read
        store.clock.now += 9.0
        assert lease.read_chunk(2, offset, 64) == payload(keys[1])[offset:][:64]
        assert lease.expires_at == store.clock.now + 10.0
    for index, offset in ((1, 0), (2, -64), (3, 0)):  # a miss, before the block, past keys
        with pytest.raises(errors.InvalidArgumentError, match=f"of block {index}"):
            lease.read_chunk(index, offset, 64)
    lease.release()
    with pytest.raises(errors.LeaseExpiredError):
        lease.read_chunk(0, 0, 64)
    lease.release()  # ended: a no-op
    store.check_integrity()


def test_read_chunk_after_expiry_fails_and_never_reads_the_reused_slot():
    store = make_store(num_blocks=2, lease_timeout_s=10.0)
    keys = chain(2)
    put(store, keys)
    lease = store.acquire(NS.id, keys)
    store.clock.now += 10.0
    assert store.remove(NS.id, keys) == 2
    others = chain(2, seed=9)
    put(store, others)  # only two slots: the leased ones, freed as the lease expired
    with pytest.raises(errors.LeaseExpiredError, match="has ended"):
        lease.read_chunk(0, 0, BLOCK)
    assert store.stats().expired_leases == 1
    assert store.read(NS.id, others) == [payload(k) for k in others]


def test_a_lease_describes_what_it_found_and_ends_with_its_block():
    store = make_store(lease_timeout_s=10.0)
    keys = chain(2)
    put(store, keys)
    missing = chain(1, seed=5)[0]
    with store.acquire(NS.id, [keys[0], missing, keys[1]], caller=Caller(owner="a")) as lease:
        assert lease.found == (True, False, True)
        assert lease.checksums[1] == 0
        assert lease.expires_at == store.clock.now + 10.0
        assert store.stats().num_leases == 1
    assert store.stats().num_leases == 0
    with pytest.raises(errors.LeaseExpiredError):
        lease.read_chunk(0, 0, 64)
    store.check_integrity()


def test_remove_while_leased_frees_slot_on_release():
    store = make_store()
    keys = chain(2)
    put(store, keys)
    lease = store.acquire(NS.id, keys)
    assert store.remove(NS.id, keys) == 2
    store.check_integrity()
    assert store.match(NS.id, keys).num_matched == 0
    assert store.stats().tiers[0].num_blocks == 2  # still held by the reader
    assert bytes(lease.views[1]) == payload(keys[1])
    lease.release()
    store.check_integrity()
    assert store.stats().tiers[0].num_blocks == 0


def test_corrupted_block_is_a_miss_and_is_dropped():
    store = make_store(verify_reads=True)
    keys = chain(3)
    put(store, keys)
    lease = store.acquire(NS.id, keys[1:2])
    lease.views[0][5] ^= 0xFF  # flip a byte behind the store's back
    lease.release()
    assert store.read(NS.id, keys) == [payload(keys[0]), None, payload(keys[2])]
    store.check_integrity()
    stats = store.stats()
    assert (stats.checksum_failures, stats.num_blocks) == (1, 2)
    assert store.match(NS.id, keys).num_matched == 1


def test_hits_misses_and_bytes_are_counted():
    store = make_store()
    keys = chain(3)
    put(store, keys[:2])
    store.read(NS.id, keys)
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.bytes_read) == (2, 1, 2 * BLOCK)
    assert stats.bytes_written == 2 * BLOCK
