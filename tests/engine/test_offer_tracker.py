"""OfferTracker: a request's offers are pending until their put returns or raises, or until
they are settled by hand (never handed to the publisher); a failed put settles every offer
staged before it (the publisher may have cut them); waits are bounded."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from gpu_engine.offer_tracker import OfferTracker


def _put(keys: Sequence[bytes], blocks: Sequence[object], parent: bytes | None) -> object:
    return len(keys)


def _failing_put(keys: Sequence[bytes], blocks: Sequence[object], parent: bytes | None) -> object:
    raise ConnectionError("store gone")


def test_an_offer_is_pending_until_its_put_returns() -> None:
    tracker = OfferTracker()
    put = tracker.track(1, _put)
    assert tracker.num_pending(1) == 1 and not tracker.wait(1, timeout_s=0.0)
    assert put([b"k"], [None], None) == 1
    assert tracker.num_pending(1) == 0 and tracker.wait(1, timeout_s=0.0)


def test_an_offer_never_put_is_settled_by_hand_and_others_stay_pending() -> None:
    tracker = OfferTracker()
    tracker.track(1, _put)
    kept = tracker.track(1, _put)
    tracker.settle(1)  # the publisher staged nothing of the first
    assert tracker.num_pending(1) == 1
    kept([b"k"], [None], None)
    assert tracker.wait(1, timeout_s=0.0)


def test_a_failed_put_settles_every_offer_staged_before_it() -> None:
    tracker = OfferTracker()
    tracker.track(1, _put)  # cut by the publisher: never put
    failing = tracker.track(2, _failing_put)
    with pytest.raises(ConnectionError):
        failing([b"k"], [None], None)
    assert tracker.wait(1, timeout_s=0.0) and tracker.wait(2, timeout_s=0.0)
    later = tracker.track(1, _put)  # staged after the failure: pending again
    assert tracker.num_pending(1) == 1
    later([b"k"], [None], None)
    assert tracker.num_pending(1) == 0


def test_a_wait_returns_when_another_thread_settles() -> None:
    tracker = OfferTracker()
    put = tracker.track(3, _put)
    waiting = threading.Thread(target=put, args=([b"k"], [None], None))
    waiting.start()
    assert tracker.wait(3, timeout_s=30.0)
    waiting.join(timeout=30)
