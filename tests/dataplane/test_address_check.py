"""The address checker: hostile bytes are refused without touching this process, a real
worker address is accepted, and a refusal leaves a checker ready for the next caller."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore import errors
from tests.conftest import require_extra

require_extra("ucxx")

from kvstore.dataplane.ucx.address_check import AddressChecker  # noqa: E402
from kvstore.dataplane.ucx.runtime import UcxRuntime  # noqa: E402


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


def test_the_checker_exits_when_its_node_goes_away():
    """A node killed without closing its checker closes the checker's stdin: it must exit, not
    live on as an orphan (UCX's progress thread would keep it alive)."""
    cmd = [sys.executable, "-m", "kvstore.dataplane.ucx.address_check"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        proc.stdin.close()  # what the kernel does when the node dies
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
