"""Arbitrary bytes and arbitrary messages to one real conductor's `Conductor/Complete`
(hypothesis), in front of one `kvstore engine` (`conductor_cases`). A call ends OK,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED or UNAVAILABLE, never UNKNOWN or INTERNAL; bytes that do
not parse and a request with both or neither prompt are INVALID_ARGUMENT, and so is a
temperature an engine cannot sample at. After every example both processes run, a small
greedy completion gives the engine's own tokens, and the engine holds no request and no page.
"""

from __future__ import annotations

import math

import grpc
from google.protobuf.message import DecodeError
from hypothesis import event, example, given
from hypothesis import strategies as st

from kvstore._proto import kvstore_pb2 as pb
from tests.fuzz import conductor_cases as cases
from tests.fuzz.conductor_cases import (
    ALLOWED_GRPC,
    COMPLETE,
    FUZZ,
    MAX_MESSAGES,
    MAX_POSITION,
    SHORT,
    TIMEOUT_S,
    VOCAB,
    Front,
    _damaged,
    _is_bad_temperature,
    _still_serving,
    long_prompts,
)

front = cases.front  # a fixture: this module's engine and conductor

# -- strategies ------------------------------------------------------------------------------

u32 = st.one_of(st.integers(0, SHORT), st.integers(0, 2**32 - 1), st.just(2**32 - 1))
u64 = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1), st.just(2**64 - 1))
doubles = st.none() | st.floats() | st.sampled_from([5e-324, 1e-300, 1e-3, 30.0, 1e308])
MESSAGE_VALUES = {
    "prompt_token_ids": st.one_of(
        st.lists(st.integers(0, VOCAB - 1), max_size=40), st.lists(u32, max_size=40), long_prompts
    ),
    "prompt": st.text(max_size=40),
    "max_tokens": st.one_of(st.integers(0, SHORT), st.integers(MAX_POSITION, 2**32 - 1), u32),
    "temperature": st.one_of(st.floats(width=32), st.sampled_from([0.0, 1e-45, 1e-40, 0.005])),
    "seed": st.none() | u64,
    "ttft_slo_s": doubles,
    "tbt_slo_ms": doubles,
}


@st.composite
def requests(draw: st.DrawFn) -> pb.CompleteRequest:
    """A valid request with up to three fields set to any value, or cleared."""
    request = pb.CompleteRequest(
        max_tokens=draw(st.integers(0, SHORT)), temperature=draw(st.sampled_from([0.0, 0.5, 1.0]))
    )
    if draw(st.booleans()):
        request.prompt = draw(st.text(min_size=1, max_size=40))
    else:
        request.prompt_token_ids[:] = draw(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
        )
    for name in draw(st.lists(st.sampled_from(list(MESSAGE_VALUES)), unique=True, max_size=3)):
        value = draw(MESSAGE_VALUES[name])
        request.ClearField(name)
        if isinstance(value, list):
            getattr(request, name).extend(value)
        elif value is not None:
            setattr(request, name, value)
    return request


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    """Random bytes, or a damaged well-formed request."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    return _damaged(draw, draw(requests()).SerializeToString())


# -- gRPC ------------------------------------------------------------------------------------


def _complete(front: Front, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """The status a Complete of `payload` ends with; OK for one cancelled after MAX_MESSAGES
    messages."""
    call = front.channel.unary_stream(COMPLETE, None, None)(payload, timeout=TIMEOUT_S)
    messages: list[bytes] = []
    try:
        for message in call:
            messages.append(message)
            if len(messages) == MAX_MESSAGES:
                event("stream cancelled early")
                call.cancel()
                return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    assert pb.CompleteResponse.FromString(messages[-1]).finish_reason in ("length", "stop")
    return grpc.StatusCode.OK, ""


def _check_grpc(code: grpc.StatusCode, details: str) -> None:
    event(f"Complete: {code.name}")
    assert code in ALLOWED_GRPC, f"Complete answered {code.name}: {details}"


@FUZZ
@given(payload=raw_requests())
def test_raw_bytes_to_complete(front, payload):
    code, details = _complete(front, payload)
    _check_grpc(code, details)
    try:
        pb.CompleteRequest.FromString(payload)
    except DecodeError:
        event("malformed")
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"{code.name}: {details}"
    _still_serving(front)


@FUZZ
@example(request=pb.CompleteRequest(prompt_token_ids=[1], temperature=math.nan))
@example(request=pb.CompleteRequest(prompt_token_ids=[1], temperature=1e-44))
@given(request=requests())
def test_arbitrary_complete_requests(front, request):
    code, details = _complete(front, request.SerializeToString())
    _check_grpc(code, details)
    if bool(request.prompt) == bool(request.prompt_token_ids):
        assert code is grpc.StatusCode.INVALID_ARGUMENT, details
    if _is_bad_temperature(request.temperature):
        assert code is grpc.StatusCode.INVALID_ARGUMENT, details
    _still_serving(front)
