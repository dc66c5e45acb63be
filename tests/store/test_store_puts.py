"""Two-phase puts in one store, in process, on an injected clock: a `Reservation` writes its
blocks chunk by chunk, commits or aborts itself, and expires; what it wrote is invisible
until it commits, a bad chunk or a wrong checksum changes nothing or commits nothing, and an
ended reservation is unknown. The caller that reserved it finds it again by id, no other
caller does. Bad keys and namespaces are refused before anything changes."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import KVLayout, Namespace
from kvstore.results import NO_RESERVATION, PutStatus, ReserveResult
from kvstore.store.caller import LOCAL, Caller
from tests.store.store_cases import BLOCK, NS, OTHER_NS, chain, make_store, payload, put


def test_put_is_invisible_until_commit():
    store = make_store()
    keys = chain(3)
    res = store.reserve(NS.id, keys)
    assert res.statuses == (PutStatus.RESERVED,) * 3
    for i, key in enumerate(keys):
        res.write(i, 0, payload(key))
    assert store.match(NS.id, keys).num_matched == 0
    assert store.read(NS.id, keys) == [None, None, None]
    assert res.commit() == 3
    store.check_integrity()
    assert store.match(NS.id, keys) == (3, ("dram", "dram", "dram"))
    assert store.read(NS.id, keys) == [payload(k) for k in keys]


def test_write_in_chunks_then_commit():
    store = make_store()
    [key] = chain(1)
    res = store.reserve(NS.id, [key])
    data = payload(key)
    for offset in range(0, BLOCK, 100):
        res.write(0, offset, data[offset : offset + 100])
    res.commit()
    assert store.read(NS.id, [key]) == [data]


def test_put_of_present_key_is_a_noop_that_says_so():
    store = make_store()
    keys = chain(2)
    put(store, keys)
    res = store.reserve(NS.id, keys)
    assert res.statuses == (PutStatus.PRESENT, PutStatus.PRESENT)
    assert res.commit() == 0
    assert store.stats().blocks_committed == 2


def test_a_reserve_with_nothing_to_reserve_opens_no_reservation():
    store = make_store()
    present, in_flight = chain(2), chain(1, seed=1)
    put(store, present)
    other = store.reserve(NS.id, in_flight)
    for _ in range(4000):
        res = store.reserve(NS.id, present + in_flight, [None, present[0], None])
        statuses = (PutStatus.PRESENT,) * 2 + (PutStatus.IN_FLIGHT,)
        assert res.result == ReserveResult(NO_RESERVATION, statuses)
    assert store.stats().num_reservations == 1  # only `other`
    assert res.commit() == 0
    res.abort()
    with pytest.raises(errors.UnknownReservationError):
        res.write(0, 0, payload(present[0]))
    found = store.reservation(NO_RESERVATION)  # as a wire finds it by id
    assert (found.reservation_id, found.commit()) == (NO_RESERVATION, 0)
    found.abort()
    with pytest.raises(errors.UnknownReservationError):
        found.write(0, 0, payload(present[0]))
    other.abort()
    store.check_integrity()


def test_concurrent_reservation_of_same_key_is_in_flight():
    store = make_store()
    keys = chain(2)
    first = store.reserve(NS.id, keys[:1])
    second = store.reserve(NS.id, keys)
    assert second.statuses == (PutStatus.IN_FLIGHT, PutStatus.RESERVED)
    first.abort()
    store.check_integrity()
    assert store.reserve(NS.id, keys[:1]).statuses == (PutStatus.RESERVED,)


def test_abort_frees_slots():
    store = make_store()
    res = store.reserve(NS.id, chain(3))
    assert store.stats().tiers[0].num_blocks == 3
    res.abort()
    store.check_integrity()
    assert store.stats().tiers[0].num_blocks == 0
    with pytest.raises(errors.UnknownReservationError):
        res.commit()
    with pytest.raises(errors.UnknownReservationError):
        store.reservation(res.reservation_id)


def test_reservation_expires_after_timeout():
    store = make_store(reservation_timeout_s=5.0)
    keys = chain(2)
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
        res.write(0, 0, payload(keys[0]))


def test_a_reservation_is_found_by_id_for_its_owner_only():
    store = make_store()
    a, b = Caller(owner="a"), Caller(owner="b")
    keys = chain(2)
    res = store.reserve(NS.id, keys, caller=a)
    assert store.reservation(res.reservation_id, caller=a) is res
    for caller in (b, LOCAL):  # ids are small integers, never a capability
        with pytest.raises(errors.UnknownReservationError):
            store.reservation(res.reservation_id, caller=caller)
    found = store.reservation(res.reservation_id, caller=a)
    for i, key in enumerate(keys):
        found.write(i, 0, payload(key))
    assert found.commit() == 2
    with pytest.raises(errors.UnknownReservationError):
        store.reservation(res.reservation_id, caller=a)  # ended
    assert store.read(NS.id, keys) == [payload(k) for k in keys]
    store.check_integrity()


def test_commit_of_partly_written_reservation_fails_and_keeps_it():
    store = make_store()
    keys = chain(2)
    res = store.reserve(NS.id, keys)
    res.write(0, 0, payload(keys[0]))
    res.write(1, 0, payload(keys[1])[:100])
    with pytest.raises(errors.IncompleteWriteError):
        res.commit()
    assert store.match(NS.id, keys).num_matched == 0
    res.write(1, 100, payload(keys[1])[100:])
    assert res.commit() == 2


@pytest.mark.parametrize(
    ("offset", "size", "error"),
    [
        (0, BLOCK + 1, errors.PayloadSizeError),
        (8, 8, errors.InvalidArgumentError),  # chunks must arrive in order
    ],
)
def test_bad_write_changes_nothing(offset, size, error):
    store = make_store()
    [key] = chain(1)
    res = store.reserve(NS.id, [key])
    with pytest.raises(error):
        res.write(0, offset, b"x" * size)
    res.write(0, 0, payload(key))
    res.commit()
    assert store.read(NS.id, [key]) == [payload(key)]


def test_rewind_takes_a_half_written_block_back_and_leaves_whole_ones():
    store = make_store()
    keys = chain(2)
    res = store.reserve(NS.id, keys)
    res.write(0, 0, payload(keys[0]))
    res.write(1, 0, b"x" * 100)
    res.write(1, 100, b"y" * 50)
    res.rewind(0, 0)  # whole: stays
    res.rewind(1, 100)
    res.rewind(1, 120)  # never forward
    res.rewind(1, -4)  # never before the block: back to 0 at most
    with pytest.raises(errors.InvalidArgumentError, match="expected 0"):
        res.write(1, -4, b"z" * 8)
    res.write(1, 0, b"x" * 100)
    with pytest.raises(errors.InvalidArgumentError, match="expected 100"):
        res.write(1, 150, b"z")
    res.write(1, 100, payload(keys[1])[100:])
    res.rewind(2, 0)  # no such block: a no-op
    with pytest.raises(errors.UnknownReservationError):  # no such reservation to rewind
        store.reservation(res.reservation_id + 1)
    assert res.commit() == 2
    res.rewind(1, 0)  # ended: a no-op
    assert store.read(NS.id, keys) == [payload(keys[0]), b"x" * 100 + payload(keys[1])[100:]]


def test_write_to_unreserved_index_is_rejected():
    store = make_store()
    keys = chain(2)
    put(store, keys[:1])
    res = store.reserve(NS.id, keys)  # index 0 is present, only 1 is reserved
    with pytest.raises(errors.InvalidArgumentError):
        res.write(0, 0, payload(keys[0]))


def test_commit_with_wrong_checksum_aborts_and_commits_nothing():
    store = make_store()
    keys = chain(2)
    res = store.reserve(NS.id, keys)
    for i, key in enumerate(keys):
        res.write(i, 0, payload(key))
    good = checksum(payload(keys[0]))
    with pytest.raises(errors.InvalidArgumentError, match="1 checksums for the 2 keys"):
        res.commit([good])  # malformed: refused, and the reservation stays as it was
    assert store.stats().num_reservations == 1
    with pytest.raises(errors.ChecksumMismatchError, match=r"blocks \[1\]"):
        res.commit([good, good])
    store.check_integrity()
    assert store.match(NS.id, keys).num_matched == 0
    assert store.stats().tiers[0].num_blocks == 0  # the reservation was aborted
    with pytest.raises(errors.UnknownReservationError):
        res.commit()
    res = store.reserve(NS.id, keys)
    for i, key in enumerate(keys):
        res.write(i, 0, payload(key))
    crcs = [checksum(payload(k)) for k in keys]
    assert res.commit(crcs) == 2


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
    store = make_store(max_batch_keys=8)
    put(store, chain(2))
    before = store.stats()
    with pytest.raises(error):
        getattr(store, op)(NS.id, keys)
    store.check_integrity()
    assert store.stats() == before


def test_unknown_namespace_is_rejected():
    store = make_store()
    with pytest.raises(errors.UnknownNamespaceError):
        store.reserve(OTHER_NS.id, chain(1))


def test_namespace_with_blocks_larger_than_a_slab_is_rejected():
    store = make_store()
    huge = Namespace("huge", KVLayout("float32", 64, 8, 128, 16))
    with pytest.raises(errors.InvalidArgumentError):
        store.register_namespace(huge)


def test_a_late_commit_of_an_expired_attempt_never_completes_a_newer_one():
    store = make_store(reservation_timeout_s=30.0)
    keys = chain(2, seed=7)
    late = store.reserve(NS.id, keys, [None, keys[0]])
    late.write(0, 0, b"\x01" * BLOCK)  # the writer stalls here, past its deadline
    store.clock.now += 31.0
    newer = store.reserve(NS.id, keys, [None, keys[0]])
    assert newer.result.statuses == (PutStatus.RESERVED,) * 2  # the stale attempt was freed
    for i, key in enumerate(keys):
        newer.write(i, 0, payload(key))
    for stale in (lambda: late.write(1, 0, b"\x01" * BLOCK), late.commit):
        with pytest.raises(errors.UnknownReservationError):
            stale()
    assert store.match(NS.id, keys).num_matched == 0  # the newer one is not done yet
    assert newer.commit() == 2
    assert store.read(NS.id, keys) == [payload(k) for k in keys]
    store.check_integrity()
