"""A same-host get's blocks taken as the node says they landed (`Landing`), and the calls
of a connection run in order (`InOrder`): pure logic, no node."""

from __future__ import annotations

import threading

import pytest

from kvstore import errors
from kvstore.dataplane.frames import Reply
from kvstore.dataplane.sockets.in_order import InOrder
from kvstore.dataplane.sockets.landing import Landing

SUMS = {0: 10, 1: 11, 2: 12, 3: 13}


def _landing(taken: list[int]) -> Landing:
    def take(s: int, i: int, crc: int) -> int:
        assert (s, crc) == (0, 0)
        taken.append(i)
        return SUMS[i]

    return Landing(request_id=5, num_keys=4, take=take)


def _in_parts(taken: list[tuple[int, int]], parts_done: list[int]) -> Landing:
    """3 keys in 2 parts; a part's sum is its key and part, chained: part 1 of key i sums
    to 10 * (i + 1) + 1 only after part 0 summed to 10 * (i + 1)."""

    def take(s: int, i: int, crc: int) -> int:
        assert crc == (10 * (i + 1) if s else 0), "parts continue their block's sum in order"
        taken.append((s, i))
        return 10 * (i + 1) + s

    return Landing(5, num_keys=3, take=take, num_parts=2, on_part=parts_done.append)


def test_found_blocks_are_taken_as_they_land_and_the_rest_at_the_reply():
    taken: list[int] = []
    landing = _landing(taken)
    landing.note(5, 0, b"\1\0")
    assert taken == [0]  # key 1 was not found: nothing to take
    landing.note(5, 2, b"\1")
    assert taken == [0, 2]
    found = landing.finish(Reply((1, 0, 1, 1), checksums=(10, 12, 13)))
    assert found == [True, False, True, True]
    assert taken == [0, 2, 3]  # key 3 at the reply, none taken twice


def test_a_block_whose_sum_differs_is_not_found():
    landing = _landing([])
    landing.note(5, 0, b"\1")
    assert landing.finish(Reply((1, 1, 0, 0), checksums=(10, 99))) == [True, False, False, False]


@pytest.mark.parametrize(
    "request_id, first, flags",
    [(6, 0, b"\1"), (5, 1, b"\1"), (5, 0, b"\1\1\1\1\1")],
    ids=["another call", "out of order", "past the keys"],
)
def test_notes_out_of_step_break_the_stream(request_id, first, flags):
    with pytest.raises(ConnectionError, match="out of step"):
        _landing([]).note(request_id, first, flags)


@pytest.mark.parametrize(
    "reply",
    [
        Reply((0, 0, 1, 0), checksums=(12,)),  # contradicts the note (key 0 found)
        Reply((1, 0, 0), checksums=(10,)),  # too few flags
        Reply((1, 0, 2, 0), checksums=(10, 12)),  # a flag neither 0 nor 1
        Reply((1, 0, 0, 0), checksums=(10, 11)),  # a sum too many
    ],
)
def test_a_reply_that_disagrees_breaks_the_stream(reply):
    landing = _landing([])
    landing.note(5, 0, b"\1")
    with pytest.raises(ConnectionError, match="malformed"):
        landing.finish(reply)


def test_a_call_in_parts_is_taken_part_by_part_and_says_each_part_done():
    """Units are part-major (part s of key i is unit 3 * s + i): part 0 of every found
    block, then part 1; `on_part(s)` once every unit of part s is in, before later ones."""
    taken: list[tuple[int, int]] = []
    done: list[int] = []
    landing = _in_parts(taken, done)
    landing.note(5, 0, b"\1\0")
    assert (taken, done) == ([(0, 0)], [])
    landing.note(5, 2, b"\1\1")  # part 0 ends at unit 3: part 1 of key 0 lands next
    assert (taken, done) == ([(0, 0), (0, 2), (1, 0)], [0])
    found = landing.finish(Reply((1, 0, 1), checksums=(11, 31)))
    assert found == [True, False, True]
    assert taken == [(0, 0), (0, 2), (1, 0), (1, 2)]  # the rest at the reply, none twice
    assert done == [0, 1]


def test_notes_of_a_call_in_parts_that_differ_between_parts_break_the_stream():
    landing = _in_parts([], [])
    landing.note(5, 0, b"\1\0\1")
    with pytest.raises(ConnectionError, match="differs between parts"):
        landing.note(5, 3, b"\1\1")  # key 1 missing in part 0, found in part 1
    landing = _in_parts([], [])
    landing.note(5, 0, b"\1\0\1\1")
    with pytest.raises(ConnectionError, match="out of step"):
        landing.note(5, 4, b"\0\1\1")  # past the call's 6 units
    with pytest.raises(ConnectionError, match="malformed"):
        landing.finish(Reply((1, 1, 1), checksums=(11, 21, 31)))  # key 1: not in part 0


def test_a_call_runs_on_the_callers_thread_when_none_is_queued():
    calls = InOrder("test-in-order")
    assert calls.run(threading.get_ident) == threading.get_ident()
    calls.shutdown()


def test_a_call_made_while_others_are_queued_runs_after_them():
    calls, order, release = InOrder("test-in-order"), [], threading.Event()
    first = calls.submit(lambda: (release.wait(10), order.append("first")))
    caller = threading.Thread(target=lambda: order.append(calls.run(lambda: "second")))
    caller.start()
    release.set()
    first.result(timeout=10)
    caller.join(timeout=10)
    assert order == ["first", "second"]
    calls.shutdown()
    with pytest.raises(errors.UnavailableError, match="closed"):
        calls.submit(lambda: None)
