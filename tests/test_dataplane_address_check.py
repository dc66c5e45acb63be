"""The address checker: hostile bytes are refused without touching this process, a real
worker address is accepted, and a refusal leaves a checker ready for the next caller."""

from __future__ import annotations

import pytest

from kvstore import errors
from tests.conftest import require_extra

require_extra("ucxx")

from kvstore.dataplane.address_check import AddressChecker  # noqa: E402
from kvstore.dataplane.runtime import UcxRuntime  # noqa: E402


@pytest.fixture
def worker_address():
    runtime = UcxRuntime("address-owner", {"NET_DEVICES": "lo"})
    try:
        yield runtime.worker_address
    finally:
        runtime.stop()


def test_refuses_garbage_then_accepts_a_real_address(worker_address):
    checker = AddressChecker({"NET_DEVICES": "lo"})
    try:
        for garbage in (b"\x00", b"\xff" * 8, bytes(range(200))):
            with pytest.raises(errors.InvalidArgumentError, match="not a UCX worker address"):
                checker.check(garbage)
            checker.check(worker_address)  # the restarted checker answers
        checker.check(worker_address)
    finally:
        checker.close()
