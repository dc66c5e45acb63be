"""Puts that a transport receives in place: it lands each reserved block in the writable view
`Reservation.views` gives, sums each slot as the bytes arrive, and commits with those sums
(`commit(written=...)`), which the store compares with the sender's instead of summing again.
Nothing is visible before the commit, a wrong sum on either side commits nothing, and a
commit must name every reserved block."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.results import NO_RESERVATION
from kvstore.store import Reservation
from tests.store.store_cases import BLOCK, NS, chain, make_store, payload, put


def _receive_in_place(res: Reservation, keys: list[bytes]) -> dict[int, int]:
    """What a transport does with `views`: lands each block, sums its slot."""
    views = res.views()
    for i, view in views.items():
        view[:] = payload(keys[i])
    return {i: checksum(view) for i, view in views.items()}


def test_transport_writes_in_place_through_views():
    store = make_store()
    keys = chain(2)
    res = store.reserve(NS.id, keys)
    views = res.views()
    for i, key in enumerate(keys):
        views[i][:] = payload(key)
    with pytest.raises(errors.IncompleteWriteError):  # landed, but not said to be written
        res.commit()
    with pytest.raises(errors.InvalidArgumentError, match="sums for blocks"):
        res.commit(written={0: checksum(views[0])})  # block 1 not said to be written
    assert store.match(NS.id, keys).num_matched == 0
    assert res.commit(written={i: checksum(v) for i, v in views.items()}) == 2
    assert store.read(NS.id, keys) == [payload(k) for k in keys]
    with pytest.raises(errors.UnknownReservationError):
        res.views()


def test_checksums_a_transport_computed_on_arrival_are_what_commit_compares():
    store = make_store()
    keys = chain(2)
    sent = [checksum(payload(k)) for k in keys]
    res = store.reserve(NS.id, keys)
    views = res.views()
    for i, key in enumerate(keys):
        views[i][:] = payload(key)
    # The node's own sum of block 1 says its slot holds other bytes than were sent.
    with pytest.raises(errors.ChecksumMismatchError, match=r"blocks \[1\]"):
        res.commit(sent, written={0: sent[0], 1: sent[1] ^ 1})
    assert store.match(NS.id, keys).num_matched == 0
    res = store.reserve(NS.id, keys)
    views = res.views()
    for i, key in enumerate(keys):
        views[i][:] = payload(key)
    assert res.commit(sent, written=dict(enumerate(sent))) == 2
    assert store.stats().checksum_failures == 0
    store.check_integrity()  # the committed blocks carry the sums, and they hold
    assert store.read(NS.id, keys) == [payload(k) for k in keys]


def test_batch_commit_of_blocks_written_in_place_skips_present_keys():
    store = make_store()
    keys = chain(4, seed=7)
    put(store, keys[1:2])
    res = store.reserve(NS.id, keys)
    assert sorted(res.views()) == [0, 2, 3]
    written = _receive_in_place(res, keys)
    assert store.match(NS.id, keys).num_matched == 0  # nothing visible before the commit
    sent = [checksum(payload(k)) for k in keys]
    assert res.commit(sent, written=written) == 3
    store.check_integrity()
    assert store.read(NS.id, keys) == [payload(k) for k in keys]
    assert store.stats().bytes_written == 4 * BLOCK


def test_batch_commit_with_a_wrong_sum_commits_nothing():
    store = make_store()
    keys = chain(3, seed=8)
    res = store.reserve(NS.id, keys)
    written = _receive_in_place(res, keys)
    sent = [checksum(payload(k)) for k in keys]
    sent[2] ^= 1  # the sender summed other bytes than its slot holds
    with pytest.raises(errors.ChecksumMismatchError, match=r"blocks \[2\]"):
        res.commit(sent, written=written)
    assert store.match(NS.id, keys).num_matched == 0
    assert store.stats().num_reservations == 0
    store.check_integrity()


def test_batch_commit_needs_a_sum_for_every_reserved_block():
    store = make_store()
    keys = chain(3, seed=9)
    res = store.reserve(NS.id, keys)
    written = _receive_in_place(res, keys)
    del written[1]
    with pytest.raises(errors.InvalidArgumentError, match="sums for blocks"):
        res.commit(written=written)
    assert store.stats().num_reservations == 1  # unchanged: it can still be committed
    assert res.commit(written=written | {1: checksum(payload(keys[1]))})
    store.check_integrity()
    with pytest.raises(errors.UnknownReservationError):
        res.views()
    assert store.reservation(NO_RESERVATION).commit(written={}) == 0
