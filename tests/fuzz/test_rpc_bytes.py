"""Arbitrary bytes to every RPC of one real store node (hypothesis), with and without tokens
(`rpc_cases`): the unary RPCs, `DataPlaneInfo`, `Get`, `Write` streams and the standard health
service. Every call ends OK or with a status that names the caller's mistake or the node's
limits, never UNKNOWN or INTERNAL; a request that does not parse is INVALID_ARGUMENT with one
log line, on the health service too; with tokens, a call without one is UNAUTHENTICATED before
any handler reads its bytes. After every example the node still serves and holds nothing open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import event, given
from hypothesis import strategies as st

from tests.conftest import wait_until
from tests.fuzz import rpc_cases as cases
from tests.fuzz.rpc_cases import (
    FUZZ,
    FUZZ_FEW,
    MESSAGES,
    REQUESTS,
    SERVICE,
    UNARY,
    Node,
    _check_allowed,
    _code,
    _still_serving,
)

node = cases.node  # a fixture: this module's node, without authentication and with tokens


def _parses(method: str, data: bytes) -> bool:
    try:
        REQUESTS[method].FromString(data)
    except DecodeError:
        return False
    return True


def _log_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What was logged at INFO or above, less asyncio's note of a task collected with the
    loop of an earlier test (garbage collection runs it at any moment, in any test)."""
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.INFO
        and not (r.name == "asyncio" and r.getMessage().startswith("Task was destroyed"))
    ]


def _one_log_line(caplog: pytest.LogCaptureFixture, method: str) -> None:
    """A malformed request is logged once: not zero times, not a traceback per layer."""
    lines = wait_until(lambda: _log_lines(caplog), 5.0, f"{method}: a log line")
    assert len(lines) == 1, [f"{r.name}: {r.getMessage()}" for r in lines]


@st.composite
def raw_requests(draw: st.DrawFn, method: str) -> bytes:
    """Random bytes, or a well-formed request cut short, extended or with a bit flipped."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    data = bytearray(draw(MESSAGES[method]).SerializeToString())
    damage = draw(st.sampled_from(["cut", "extend", "flip"]))
    if damage == "cut":
        return bytes(data[: draw(st.integers(0, len(data)))])
    if damage == "extend" or not data:
        return bytes(data) + draw(st.binary(min_size=1, max_size=20))
    bit = draw(st.integers(0, 8 * len(data) - 1))
    data[bit // 8] ^= 1 << (bit % 8)
    return bytes(data)


# -- raw bytes -------------------------------------------------------------------------------


def _raw_unary(node: Node, method: str) -> Callable[[bytes], bytes]:
    return node.channel.unary_unary(SERVICE + method, None, None)


def _raw_bytes_to_unary(node: Node, caplog, method: str, payload: bytes) -> None:
    caplog.clear()
    caplog.set_level(logging.INFO)
    code, details = _code(lambda: _raw_unary(node, method)(payload, timeout=10.0))
    _check_allowed(method, code, details)
    if not _parses(method, payload):
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {code.name}: {details}"
        _one_log_line(caplog, method)
    _still_serving(node)


@pytest.mark.parametrize("method", UNARY)
@FUZZ
@given(data=st.data())
def test_raw_bytes_to_unary_rpcs(node, caplog, method, data):
    _raw_bytes_to_unary(node, caplog, method, data.draw(raw_requests(method)))


@pytest.mark.parametrize("method", [*UNARY, "DataPlaneInfo"])
@FUZZ_FEW
@given(payload=st.binary(max_size=256))
def test_raw_bytes_without_a_token_are_unauthenticated(node, caplog, method, payload):
    """With tokens, a call without one is refused before any handler reads its bytes;
    without, no call is refused for lacking one."""
    with grpc.insecure_channel(node.server.address) as bare:
        code, details = _code(lambda: bare.unary_unary(SERVICE + method)(payload, timeout=10.0))
    if node.has_tokens:
        assert code is grpc.StatusCode.UNAUTHENTICATED
    else:
        _check_allowed(method, code, details)
    _still_serving(node)


@FUZZ_FEW
@given(payload=raw_requests("DataPlaneInfo"))
def test_raw_bytes_to_data_plane_info(node, caplog, payload):
    _raw_bytes_to_unary(node, caplog, "DataPlaneInfo", payload)


@FUZZ
@given(payload=st.binary(max_size=64))
def test_raw_bytes_to_health_check(node, caplog, payload):
    """The standard health service is behind the same decoding as the store's RPCs."""
    caplog.clear()
    caplog.set_level(logging.INFO)
    check = node.channel.unary_unary("/grpc.health.v1.Health/Check", None, None)
    code, details = _code(lambda: check(payload, timeout=10.0))
    try:
        service = health_pb2.HealthCheckRequest.FromString(payload).service
    except DecodeError:
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"Check: {code.name}: {details}"
        _one_log_line(caplog, "Check")
    else:
        known = service in ("", "kvstore.v1.KVStore")
        assert code is (grpc.StatusCode.OK if known else grpc.StatusCode.NOT_FOUND), details
    _still_serving(node)


@FUZZ
@given(payload=raw_requests("Get"))
def test_raw_bytes_to_get(node, caplog, payload):
    caplog.clear()
    caplog.set_level(logging.INFO)
    get = node.channel.unary_stream(SERVICE + "Get", None, None)
    code, details = _code(lambda: list(get(payload, timeout=10.0)))
    _check_allowed("Get", code, details)
    if not _parses("Get", payload):
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"Get: {code.name}: {details}"
        _one_log_line(caplog, "Get")
    _still_serving(node)


@FUZZ
@given(chunks=st.lists(raw_requests("Write"), min_size=1, max_size=3))
def test_raw_bytes_to_write(node, caplog, chunks):
    """A stream whose first chunk does not parse is INVALID_ARGUMENT; any other ends as
    its first bad chunk says (after it, nothing more of the stream is read)."""
    caplog.clear()
    caplog.set_level(logging.INFO)
    write = node.channel.stream_unary(SERVICE + "Write", None, None)
    code, details = _code(lambda: write(iter(chunks), timeout=10.0))
    _check_allowed("Write", code, details)
    if not _parses("Write", chunks[0]):
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"Write: {code.name}: {details}"
        _one_log_line(caplog, "Write")
    _still_serving(node)
