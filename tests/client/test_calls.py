"""`calls.put_steps` driven by `drive` and `drive_async`: which calls a put over gRPC sends,
in which order, and what it leaves behind when one of them fails. The steps do no I/O, so
each test stands in for the node with a `run` that answers or raises."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import calls
from kvstore.results import PutStatus, ReserveResult

RESERVED = ReserveResult(7, (PutStatus.RESERVED, PutStatus.PRESENT))
BLOCKS = [np.zeros(4, np.uint8), np.ones(4, np.uint8)]


def _node(fail_on: str = "", abort_fails: bool = False):
    """A `run` answering Reserve with RESERVED; it raises UnavailableError on `fail_on`
    (and on Abort too with `abort_fails`); `sent` lists the methods called."""
    sent: list[str] = []

    def run(call: calls.Call) -> object:
        sent.append(call.method)
        if call.method == fail_on or (abort_fails and call.method == "Abort"):
            raise errors.UnavailableError(f"{call.method} failed")
        if call.method == "Write":
            list(call.request)  # the stream is consumed, as gRPC would
        return {"Reserve": RESERVED, "Write": 4, "Commit": 1, "Abort": None}[call.method]

    return run, sent


def _steps() -> calls.Steps:
    return calls.put_steps(b"n" * 32, [b"a" * 32, b"b" * 32], BLOCKS, None, 1 << 20)


def test_a_put_reserves_writes_what_was_reserved_and_commits():
    run, sent = _node()
    result = calls.drive(_steps(), run)
    assert sent == ["Reserve", "Write", "Commit"]
    assert (result.num_stored, result.num_present, result.num_in_flight) == (1, 1, 0)


@pytest.mark.parametrize("fail_on", ["Write", "Commit"])
@pytest.mark.parametrize("abort_fails", [False, True])
def test_a_failed_write_or_commit_aborts_and_raises_its_own_error(fail_on, abort_fails):
    run, sent = _node(fail_on, abort_fails)
    with pytest.raises(errors.UnavailableError, match=f"{fail_on} failed"):
        calls.drive(_steps(), run)
    assert sent[-1] == "Abort" and sent.count("Abort") == 1


def test_nothing_reserved_sends_nothing_more():
    present = ReserveResult(0, (PutStatus.PRESENT, PutStatus.IN_FLIGHT))

    def run(call: calls.Call) -> object:
        assert call.method == "Reserve"
        return present

    assert calls.drive(_steps(), run).num_stored == 0


def test_the_async_driver_sends_the_same_calls():
    run, sent = _node("Write")

    async def arun(call: calls.Call) -> object:
        return run(call)

    with pytest.raises(errors.UnavailableError):
        asyncio.run(calls.drive_async(_steps(), arun))
    assert sent == ["Reserve", "Write", "Abort"]
