"""Single-node store semantics, in process, with an injected clock."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import NO_RESERVATION, PutStatus
from kvstore.store import Store, StoreConfig
from kvstore.store.eviction import POLICIES

NS = Namespace("test-model", KVLayout("float16", 2, 1, 8, 4))  # 256-byte blocks
OTHER_NS = Namespace("other-model", KVLayout("float16", 2, 1, 8, 4))
BLOCK = NS.block_bytes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _make_store(num_blocks: int = 16, policy: str = "prefix-lru", **kw) -> Store:
    config = StoreConfig(dram_bytes=num_blocks * BLOCK, slab_bytes=4 * BLOCK, policy=policy, **kw)
    store = Store(config, clock=FakeClock())
    store.register_namespace(NS)
    return store


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def _payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def _put(store: Store, keys: list[bytes], parent: bytes | None = None) -> None:
    res = store.reserve(NS.id, keys, [parent, *keys[:-1]])
    for i, status in enumerate(res.statuses):
        if status is PutStatus.RESERVED:
            store.write(res.reservation_id, i, 0, _payload(keys[i]))
    store.commit(res.reservation_id)
    store.check_integrity()


def test_put_is_invisible_until_commit():
    store = _make_store()
    keys = _chain(3)
    res = store.reserve(NS.id, keys)
    assert res.statuses == (PutStatus.RESERVED,) * 3
    for i, key in enumerate(keys):
        store.write(res.reservation_id, i, 0, _payload(key))
    assert store.match(NS.id, keys).num_matched == 0
    assert store.read(NS.id, keys) == [None, None, None]
    assert store.commit(res.reservation_id) == 3
    store.check_integrity()
    assert store.match(NS.id, keys) == (3, ("dram", "dram", "dram"))
    assert store.read(NS.id, keys) == [_payload(k) for k in keys]


def test_write_in_chunks_then_commit():
    store = _make_store()
    [key] = _chain(1)
    res = store.reserve(NS.id, [key])
    data = _payload(key)
    for offset in range(0, BLOCK, 100):
        store.write(res.reservation_id, 0, offset, data[offset : offset + 100])
    store.commit(res.reservation_id)
    assert store.read(NS.id, [key]) == [data]


def test_put_of_present_key_is_a_noop_that_says_so():
    store = _make_store()
    keys = _chain(2)
    _put(store, keys)
    res = store.reserve(NS.id, keys)
    assert res.statuses == (PutStatus.PRESENT, PutStatus.PRESENT)
    assert store.commit(res.reservation_id) == 0
    assert store.stats().blocks_committed == 2


def test_a_reserve_with_nothing_to_reserve_opens_no_reservation():
    store = _make_store()
    present, in_flight = _chain(2), _chain(1, seed=1)
    _put(store, present)
    other = store.reserve(NS.id, in_flight)
    for _ in range(4000):
        res = store.reserve(NS.id, present + in_flight, [None, present[0], None])
        assert res == (NO_RESERVATION, (PutStatus.PRESENT,) * 2 + (PutStatus.IN_FLIGHT,))
    assert store.stats().num_reservations == 1  # only `other`
    assert store.commit(NO_RESERVATION) == 0
    store.abort(NO_RESERVATION)
    with pytest.raises(errors.UnknownReservationError):
        store.write(NO_RESERVATION, 0, 0, _payload(present[0]))
    store.abort(other.reservation_id)
    store.check_integrity()


def test_concurrent_reservation_of_same_key_is_in_flight():
    store = _make_store()
    keys = _chain(2)
    first = store.reserve(NS.id, keys[:1])
    second = store.reserve(NS.id, keys)
    assert second.statuses == (PutStatus.IN_FLIGHT, PutStatus.RESERVED)
    store.abort(first.reservation_id)
    store.check_integrity()
    assert store.reserve(NS.id, keys[:1]).statuses == (PutStatus.RESERVED,)


def test_match_stops_at_first_missing_key():
    store = _make_store()
    keys = _chain(4)
    _put(store, keys[:2])
    _put(store, keys[3:])  # a chain of its own: keys[2], its parent, was never stored
    assert store.match(NS.id, keys).num_matched == 2
    assert store.match(NS.id, keys[3:]).num_matched == 1


def test_keys_of_another_namespace_miss():
    store = _make_store()
    store.register_namespace(OTHER_NS)
    keys = _chain(2)
    _put(store, keys)
    assert store.match(OTHER_NS.id, keys).num_matched == 0
    assert store.read(OTHER_NS.id, keys) == [None, None]
    assert store.remove(OTHER_NS.id, keys) == 0


def test_abort_frees_slots():
    store = _make_store()
    res = store.reserve(NS.id, _chain(3))
    assert store.stats().tiers[0].num_blocks == 3
    store.abort(res.reservation_id)
    store.check_integrity()
    assert store.stats().tiers[0].num_blocks == 0
    with pytest.raises(errors.UnknownReservationError):
        store.commit(res.reservation_id)


def test_reservation_expires_after_timeout():
    store = _make_store(reservation_timeout_s=5.0)
    keys = _chain(2)
    res = store.reserve(NS.id, keys)
    store.clock.now += 4.9
    store.expire()
    assert store.stats().num_reservations == 1
    store.clock.now += 0.2
    store.expire()
    store.check_integrity()
    stats = store.stats()
    assert (stats.num_reservations, stats.expired_reservations) == (0, 1)
    assert stats.tiers[0].num_blocks == 0
    with pytest.raises(errors.UnknownReservationError):
        store.write(res.reservation_id, 0, 0, _payload(keys[0]))


def test_commit_of_partly_written_reservation_fails_and_keeps_it():
    store = _make_store()
    keys = _chain(2)
    res = store.reserve(NS.id, keys)
    store.write(res.reservation_id, 0, 0, _payload(keys[0]))
    store.write(res.reservation_id, 1, 0, _payload(keys[1])[:100])
    with pytest.raises(errors.IncompleteWriteError):
        store.commit(res.reservation_id)
    assert store.match(NS.id, keys).num_matched == 0
    store.write(res.reservation_id, 1, 100, _payload(keys[1])[100:])
    assert store.commit(res.reservation_id) == 2


@pytest.mark.parametrize(
    ("offset", "size", "error"),
    [
        (0, BLOCK + 1, errors.PayloadSizeError),
        (8, 8, errors.InvalidArgumentError),  # chunks must arrive in order
    ],
)
def test_bad_write_changes_nothing(offset, size, error):
    store = _make_store()
    [key] = _chain(1)
    res = store.reserve(NS.id, [key])
    with pytest.raises(error):
        store.write(res.reservation_id, 0, offset, b"x" * size)
    store.write(res.reservation_id, 0, 0, _payload(key))
    store.commit(res.reservation_id)
    assert store.read(NS.id, [key]) == [_payload(key)]


def test_rewind_takes_a_half_written_block_back_and_leaves_whole_ones():
    store = _make_store()
    keys = _chain(2)
    res = store.reserve(NS.id, keys)
    rid = res.reservation_id
    store.write(rid, 0, 0, _payload(keys[0]))
    store.write(rid, 1, 0, b"x" * 100)
    store.write(rid, 1, 100, b"y" * 50)
    store.rewind(rid, 0, 0)  # whole: stays
    store.rewind(rid, 1, 100)
    store.rewind(rid, 1, 120)  # never forward
    with pytest.raises(errors.InvalidArgumentError, match="expected 100"):
        store.write(rid, 1, 150, b"z")
    store.write(rid, 1, 100, _payload(keys[1])[100:])
    store.rewind(rid + 1, 0, 0)  # no such reservation: a no-op
    assert store.commit(rid) == 2
    store.rewind(rid, 1, 0)  # ended: a no-op
    assert store.read(NS.id, keys) == [_payload(keys[0]), b"x" * 100 + _payload(keys[1])[100:]]


def test_write_to_unreserved_index_is_rejected():
    store = _make_store()
    keys = _chain(2)
    _put(store, keys[:1])
    res = store.reserve(NS.id, keys)  # index 0 is present, only 1 is reserved
    with pytest.raises(errors.InvalidArgumentError):
        store.write(res.reservation_id, 0, 0, _payload(keys[0]))


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ([], errors.EmptyRequestError),
        ([b"short"], errors.BadKeyError),
        ([b"k" * 32, b"k" * 32], errors.DuplicateKeyError),
        ([bytes([i]) * 32 for i in range(9)], errors.BatchTooLargeError),
    ],
)
@pytest.mark.parametrize("op", ["match", "reserve", "acquire", "remove"])
def test_bad_keys_are_rejected_and_change_nothing(keys, error, op):
    store = _make_store(max_batch_keys=8)
    _put(store, _chain(2))
    before = store.stats()
    with pytest.raises(error):
        getattr(store, op)(NS.id, keys)
    store.check_integrity()
    assert store.stats() == before


def test_unknown_namespace_is_rejected():
    store = _make_store()
    with pytest.raises(errors.UnknownNamespaceError):
        store.reserve(OTHER_NS.id, _chain(1))


def test_namespace_with_blocks_larger_than_a_slab_is_rejected():
    store = _make_store()
    huge = Namespace("huge", KVLayout("float32", 64, 8, 128, 16))
    with pytest.raises(errors.InvalidArgumentError):
        store.register_namespace(huge)


# Recency policies only: prefix-2q evicts each chain's never-read last block first.
@pytest.mark.parametrize("policy", ["lru", "prefix-lru"])
def test_full_store_evicts_and_counts(policy):
    store = _make_store(num_blocks=8, policy=policy)
    chains = [_chain(4, seed=s) for s in range(4)]
    for chain in chains:
        _put(store, chain)
    stats = store.stats()
    assert (stats.num_blocks, stats.evictions, stats.blocks_committed) == (8, 8, 16)
    for chain in chains[2:]:  # the two most recent chains survive whole
        assert store.read(NS.id, chain) == [_payload(k) for k in chain]


def test_prefix_lru_evicts_tails_before_parents_lru_evicts_roots():
    outcomes = {}
    for policy in ("lru", "prefix-lru"):
        store = _make_store(num_blocks=8, policy=policy)
        _put(store, _chain(4, seed=1))
        old = _chain(4, seed=0)
        _put(store, old)
        store.read(NS.id, old)  # old chain is now the most recent
        _put(store, _chain(2, seed=2))  # two evictions
        outcomes[policy] = store.match(NS.id, _chain(4, seed=1)).num_matched
    # LRU touched the chain root first, so it evicted the root: nothing matches.
    # Prefix-aware LRU evicted the two tail blocks: the first two still match.
    assert outcomes == {"lru": 0, "prefix-lru": 2}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_leased_blocks_are_never_evicted(policy):
    store = _make_store(num_blocks=4, policy=policy)
    keys = _chain(4)
    _put(store, keys)
    lease = store.acquire(NS.id, keys[:2])
    _put(store, _chain(2, seed=1))
    store.check_integrity()
    assert store.match(NS.id, keys[:2]).num_matched == 2
    assert [bytes(v) for v in lease.views] == [_payload(k) for k in keys[:2]]
    with pytest.raises(errors.StoreFullError):
        _put(store, _chain(3, seed=2))
    store.check_integrity()
    store.release(lease.lease_id)
    _put(store, _chain(3, seed=2))


def test_store_full_of_leases_raises_and_reserves_nothing():
    store = _make_store(num_blocks=4)
    keys = _chain(4)
    _put(store, keys)
    store.acquire(NS.id, keys)
    before = store.stats()
    with pytest.raises(errors.StoreFullError):
        store.reserve(NS.id, _chain(1, seed=5))
    store.check_integrity()
    assert store.stats().num_reservations == before.num_reservations
    assert store.stats().tiers == before.tiers


def test_lease_expires_and_block_becomes_evictable():
    store = _make_store(num_blocks=4, lease_timeout_s=10.0)
    keys = _chain(4)
    _put(store, keys)
    store.acquire(NS.id, keys)
    store.clock.now += 10.0
    _put(store, _chain(1, seed=3))  # reserve sweeps the expired lease, then evicts
    stats = store.stats()
    assert (stats.expired_leases, stats.num_leases, stats.evictions) == (1, 0, 1)


def test_read_chunk_copies_a_live_lease_and_renews_it():
    store = _make_store(lease_timeout_s=10.0)
    keys = _chain(2)
    _put(store, keys)
    lease = store.acquire(NS.id, [keys[0], _chain(1, seed=5)[0], keys[1]])
    for offset in range(0, BLOCK, 64):  # 40 s in all, never 10 s without a read
        store.clock.now += 9.0
        assert store.read_chunk(lease.lease_id, 2, offset, 64) == _payload(keys[1])[offset:][:64]
    with pytest.raises(errors.InvalidArgumentError, match="no block 1"):
        store.read_chunk(lease.lease_id, 1, 0, 64)  # a miss
    store.release(lease.lease_id)
    with pytest.raises(errors.LeaseExpiredError):
        store.read_chunk(lease.lease_id, 0, 0, 64)
    store.check_integrity()


def test_read_chunk_after_expiry_fails_and_never_reads_the_reused_slot():
    store = _make_store(num_blocks=2, lease_timeout_s=10.0)
    keys = _chain(2)
    _put(store, keys)
    lease = store.acquire(NS.id, keys)
    store.clock.now += 10.0
    assert store.remove(NS.id, keys) == 2
    others = _chain(2, seed=9)
    _put(store, others)  # only two slots: the leased ones, freed as the lease expired
    with pytest.raises(errors.LeaseExpiredError, match="has ended"):
        store.read_chunk(lease.lease_id, 0, 0, BLOCK)
    assert store.stats().expired_leases == 1
    assert store.read(NS.id, others) == [_payload(k) for k in others]


def test_remove_while_leased_frees_slot_on_release():
    store = _make_store()
    keys = _chain(2)
    _put(store, keys)
    lease = store.acquire(NS.id, keys)
    assert store.remove(NS.id, keys) == 2
    store.check_integrity()
    assert store.match(NS.id, keys).num_matched == 0
    assert store.stats().tiers[0].num_blocks == 2  # still held by the reader
    assert bytes(lease.views[1]) == _payload(keys[1])
    store.release(lease.lease_id)
    store.check_integrity()
    assert store.stats().tiers[0].num_blocks == 0


def test_corrupted_block_is_a_miss_and_is_dropped():
    store = _make_store(verify_reads=True)
    keys = _chain(3)
    _put(store, keys)
    lease = store.acquire(NS.id, keys[1:2])
    lease.views[0][5] ^= 0xFF  # flip a byte behind the store's back
    store.release(lease.lease_id)
    assert store.read(NS.id, keys) == [_payload(keys[0]), None, _payload(keys[2])]
    store.check_integrity()
    stats = store.stats()
    assert (stats.checksum_failures, stats.num_blocks) == (1, 2)
    assert store.match(NS.id, keys).num_matched == 1


def test_commit_with_wrong_checksum_aborts_and_commits_nothing():
    store = _make_store()
    keys = _chain(2)
    res = store.reserve(NS.id, keys)
    for i, key in enumerate(keys):
        store.write(res.reservation_id, i, 0, _payload(key))
    good = checksum(_payload(keys[0]))
    with pytest.raises(errors.ChecksumMismatchError, match=r"blocks \[1\]"):
        store.commit(res.reservation_id, [good, good])
    store.check_integrity()
    assert store.match(NS.id, keys).num_matched == 0
    assert store.stats().tiers[0].num_blocks == 0  # the reservation was aborted
    res = store.reserve(NS.id, keys)
    for i, key in enumerate(keys):
        store.write(res.reservation_id, i, 0, _payload(key))
    crcs = [checksum(_payload(k)) for k in keys]
    assert store.commit(res.reservation_id, crcs) == 2


def test_hits_misses_and_bytes_are_counted():
    store = _make_store()
    keys = _chain(3)
    _put(store, keys[:2])
    store.read(NS.id, keys)
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.bytes_read) == (2, 1, 2 * BLOCK)
    assert stats.bytes_written == 2 * BLOCK


def test_transport_writes_in_place_through_reservation_views():
    store = _make_store()
    keys = _chain(2)
    res = store.reserve(NS.id, keys)
    for i, key in enumerate(keys):
        store.reservation_view(res.reservation_id, i)[:] = _payload(key)
    store.mark_written(res.reservation_id, 0)
    with pytest.raises(errors.IncompleteWriteError):
        store.commit(res.reservation_id)
    store.mark_written(res.reservation_id, 1)
    assert store.commit(res.reservation_id) == 2
    assert store.read(NS.id, keys) == [_payload(k) for k in keys]
    with pytest.raises(errors.UnknownReservationError):
        store.reservation_view(res.reservation_id, 0)


def test_checksums_a_transport_computed_on_arrival_are_what_commit_compares():
    store = _make_store()
    keys = _chain(2)
    sent = [checksum(_payload(k)) for k in keys]
    res = store.reserve(NS.id, keys)
    for i, key in enumerate(keys):
        store.reservation_view(res.reservation_id, i)[:] = _payload(key)
        # The node's own sum of block 1 says its slot holds other bytes than were sent.
        store.mark_written(res.reservation_id, i, sent[i] if i == 0 else sent[i] ^ 1)
    with pytest.raises(errors.ChecksumMismatchError, match=r"blocks \[1\]"):
        store.commit(res.reservation_id, sent)
    assert store.match(NS.id, keys).num_matched == 0
    res = store.reserve(NS.id, keys)
    for i, key in enumerate(keys):
        store.reservation_view(res.reservation_id, i)[:] = _payload(key)
        store.mark_written(res.reservation_id, i, sent[i])
    assert store.commit(res.reservation_id, sent) == 2
    assert store.stats().checksum_failures == 0
    store.check_integrity()  # the committed blocks carry the sums, and they hold
    assert store.read(NS.id, keys) == [_payload(k) for k in keys]


def _receive_in_place(store: Store, rid: int, keys: list[bytes]) -> dict[int, int]:
    """What a transport does with `reservation_views`: lands each block, sums its slot."""
    views = store.reservation_views(rid)
    for i, view in views.items():
        view[:] = _payload(keys[i])
    return {i: checksum(view) for i, view in views.items()}


def test_batch_commit_of_blocks_written_in_place_skips_present_keys():
    store = _make_store()
    keys = _chain(4, seed=7)
    _put(store, keys[1:2])
    res = store.reserve(NS.id, keys)
    assert sorted(store.reservation_views(res.reservation_id)) == [0, 2, 3]
    written = _receive_in_place(store, res.reservation_id, keys)
    assert store.match(NS.id, keys).num_matched == 0  # nothing visible before the commit
    sent = [checksum(_payload(k)) for k in keys]
    assert store.commit(res.reservation_id, sent, written=written) == 3
    store.check_integrity()
    assert store.read(NS.id, keys) == [_payload(k) for k in keys]
    assert store.stats().bytes_written == 4 * BLOCK


def test_batch_commit_with_a_wrong_sum_commits_nothing():
    store = _make_store()
    keys = _chain(3, seed=8)
    res = store.reserve(NS.id, keys)
    written = _receive_in_place(store, res.reservation_id, keys)
    sent = [checksum(_payload(k)) for k in keys]
    sent[2] ^= 1  # the sender summed other bytes than its slot holds
    with pytest.raises(errors.ChecksumMismatchError, match=r"blocks \[2\]"):
        store.commit(res.reservation_id, sent, written=written)
    assert store.match(NS.id, keys).num_matched == 0
    assert store.stats().num_reservations == 0
    store.check_integrity()


def test_batch_commit_needs_a_sum_for_every_reserved_block():
    store = _make_store()
    keys = _chain(3, seed=9)
    res = store.reserve(NS.id, keys)
    written = _receive_in_place(store, res.reservation_id, keys)
    del written[1]
    with pytest.raises(errors.InvalidArgumentError, match="sums for blocks"):
        store.commit(res.reservation_id, written=written)
    assert store.stats().num_reservations == 1  # unchanged: it can still be committed
    assert store.commit(res.reservation_id, written=written | {1: checksum(_payload(keys[1]))})
    store.check_integrity()
    with pytest.raises(errors.UnknownReservationError):
        store.reservation_views(res.reservation_id)
    assert store.commit(NO_RESERVATION, written={}) == 0
