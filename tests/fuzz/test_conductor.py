"""Arbitrary JSON, bytes, headers and messages to one real conductor (hypothesis).

One `kvstore engine` (tiny preset, role "both", no store) behind one `kvstore conductor` on
the fixed test profile. `POST /v1/completions` answers 200, 400, 429 or 503 and nothing
else (never a 500): a 400 carries a JSON error message, a 200 a whole completion or a stream
that ends with `[DONE]`. `Conductor/Complete` ends OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED
or UNAVAILABLE, never UNKNOWN or INTERNAL. After every example both processes run, a small
greedy completion gives the engine's own tokens, and the engine holds no request and no page;
a client that leaves mid-stream included.
"""

from __future__ import annotations

import http.client
import json
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from gpu_engine.config import MODEL_PRESETS
from gpu_engine.engine_client import EngineClient
from gpu_engine.sampling import SamplingParams
from kvstore._proto import kvstore_pb2 as pb
from kvstore.conductor.front.completion import MIN_TEMPERATURE
from tests.conductor.test_live import Proc, _conductor, _engine, _ports
from tests.conftest import wait_until

COMPLETE = "/kvstore.v1.Conductor/Complete"  # kvstore_pb2_grpc.ConductorStub
TINY = MODEL_PRESETS["tiny"]
VOCAB, MAX_POSITION = TINY.vocab_size, TINY.max_position
SHORT = 16  # most output tokens an accepted fuzzed request may ask for: the run stays quick
LONG = 1000  # output tokens of a stream its client leaves: seconds of decoding, unless aborted
MAX_MESSAGES = SHORT + 2  # a gRPC stream read this far is cancelled: it asked for more
TIMEOUT_S = 30.0
PROBE = [1, 2, 3, 4, 5]  # the valid greedy completion after every example
JSON = {"Content-Type": "application/json"}
ALLOWED_HTTP = frozenset({200, 400, 429, 503})
ALLOWED_GRPC = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
    }
)
FIELDS = ("prompt", "max_tokens", "temperature", "seed", "stream", "n", "return_token_ids")
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FUZZ_FEW = settings(FUZZ, max_examples=25)


@dataclass
class Front:
    conductor: Proc
    engine_proc: Proc
    http_port: int
    channel: grpc.Channel  # to the conductor's gRPC port
    engine: EngineClient  # beside the conductor: its load, and the probe's reference
    reference: list[int]  # the engine's greedy output for PROBE


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    tmp = tmp_path_factory.mktemp("fuzz-conductor")
    engine_proc, address = _engine(tmp, "engine", "both", "")
    conductor = _conductor(tmp, "conductor", [address], "", "cache-aware-predictive")
    try:
        http_port, grpc_port = wait_until(lambda: _ports(conductor), 90.0, "the conductor serves")
        with (
            grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
            EngineClient(address, timeout_s=TIMEOUT_S) as engine,
        ):
            params = SamplingParams(max_tokens=4)
            reference = list(engine.generate(PROBE, params).output_token_ids)
            yield Front(conductor, engine_proc, http_port, channel, engine, reference)
    finally:
        for proc in (conductor, engine_proc):
            proc.terminate()
        codes = [proc.stop() for proc in (conductor, engine_proc)]
    assert codes == [0, 0], codes


# -- checks ----------------------------------------------------------------------------------


def _post(front: Front, body: bytes, headers: dict[str, str]) -> tuple[int, str, bytes]:
    """Status, content type and whole body (a stream: to its end) of one POST."""
    conn = http.client.HTTPConnection("127.0.0.1", front.http_port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body, headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def _check_http(status: int, kind: str, body: bytes) -> Any:
    """The answer is one of the allowed ones, whole; returns its JSON (a stream's: the last
    message, with the usage)."""
    event(f"HTTP {status}")
    assert status in ALLOWED_HTTP, f"HTTP {status}: {body[:500]!r}"
    if kind.startswith("text/event-stream"):
        event("stream")
        assert status == 200
        events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
        assert events[-1] == b"[DONE]", body[-500:]
        return [json.loads(e) for e in events[:-1]][-1]
    msg = json.loads(body)
    if status == 200:
        assert msg["choices"][0]["finish_reason"] in ("length", "stop"), msg
    else:
        assert isinstance(msg["error"]["message"], str) and msg["error"]["message"], msg
    return msg


def _still_serving(front: Front) -> None:
    """Both processes run, the probe gives the engine's own greedy tokens, and once any
    request the example left has been aborted the engine holds nothing."""
    assert front.conductor.proc.poll() is None, f"the conductor exited:\n{front.conductor.log()}"
    assert front.engine_proc.proc.poll() is None, "the engine exited"
    body = json.dumps({"prompt": PROBE, "max_tokens": 4, "temperature": 0}).encode()
    status, _, answer = _post(front, body, JSON)
    assert status == 200, answer
    assert json.loads(answer)["kvstore"]["token_ids"] == front.reference
    wait_until(lambda: _is_idle(front.engine), TIMEOUT_S, "the engine holds no request")


def _is_idle(engine: EngineClient) -> bool:
    load = engine.load()
    return (load.num_running, load.num_waiting, load.num_free_pages) == (0, 0, load.num_pages)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_bad_temperature(value: object) -> bool:
    """What the conductor must refuse: engines sample softmax(logits / temperature)."""
    if not isinstance(value, int | float):
        return True
    return value != 0 and not MIN_TEMPERATURE <= value <= sys.float_info.max


# -- strategies ------------------------------------------------------------------------------

# Integers of every size but those that would make an accepted request decode for long.
ints = st.one_of(
    st.integers(-8, SHORT),
    st.integers(MAX_POSITION, 2**200),
    st.integers(-(2**200), -1),
    st.sampled_from([2**31 - 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64, 10**300]),
)
floats = st.one_of(
    st.floats(),  # NaN and the infinities: Python's json writes them and reads them back
    st.sampled_from([0.0, -0.0, 5e-324, 1e-45, 1e-40, 0.005, 0.01, 2.0, 1e300]),
)
texts = st.one_of(
    st.text(max_size=30), st.sampled_from(["NaN", "Infinity", "-1", "1e999", "0x10", "4"])
)
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=10))
json_values = st.recursive(
    st.none() | st.booleans() | ints | floats | texts,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
    max_leaves=12,
)
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB, 2**40), ints)
long_prompts = st.integers(MAX_POSITION - 3 * SHORT, MAX_POSITION + 8).map(
    lambda n: [i % VOCAB for i in range(n)]  # at and over what the engine's positions hold
)
prompts = st.one_of(
    st.text(max_size=40),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    st.lists(token_ids, max_size=40),
    long_prompts,
    st.lists(st.text(max_size=8) | st.lists(token_ids, max_size=8), max_size=3),  # a batch
    json_values,
)
FIELD_VALUES = {
    "prompt": prompts,
    "max_tokens": st.one_of(st.integers(1, SHORT), ints, json_values),
    "temperature": st.one_of(floats, ints, json_values),
    "seed": st.one_of(ints, st.booleans(), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "n": st.one_of(st.sampled_from([1, 1.0, True, 2, 0, -1]), json_values),
    "return_token_ids": st.one_of(st.booleans(), json_values),
}
valid_bodies = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
        | st.text(min_size=1, max_size=40)
    },
    optional={
        "max_tokens": st.integers(1, SHORT),
        "temperature": st.sampled_from([0, 0.0, 0.5, 1, 2.0]),
        "seed": st.integers(0, 2**64 - 1),
        "stream": st.booleans(),
        "n": st.just(1),
        "return_token_ids": st.booleans(),
    },
)


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with up to three fields replaced by any value, or dropped."""
    body = draw(valid_bodies)
    for name in draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=3)):
        if draw(st.integers(0, 4)):
            body[name] = draw(FIELD_VALUES[name])
        else:
            body.pop(name, None)
    return body


# Field values a client can send (RFC 9110: visible ASCII, space, tab, obs-text).
header_values = st.one_of(
    st.text(st.characters(codec="latin-1", exclude_categories=["Cc"]), max_size=20),
    st.floats().map(repr),
    st.sampled_from(["25", "0", "-5", "nan", "inf", "1e-320", "1e999", " 40 ", "1_000"]),
)
slo_headers = st.fixed_dictionaries(
    {}, optional={"x-slo-ttft-ms": header_values, "x-slo-tbt-ms": header_values}
)
content_types = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-8",
            "application/json; charset=utf-16",
            "application/json; charset=foo",  # no such codec
            "application/json; charset=base64",  # a codec, but not of text
            "text/plain",
            "multipart/form-data; boundary=x",
        ]
    ),
    header_values,
)


def _damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` cut short, extended, or with one bit flipped."""
    damage = draw(st.sampled_from(["cut", "extend", "flip"]))
    if damage == "cut":
        return data[: draw(st.integers(0, len(data)))]
    if damage == "extend" or not data:
        return data + draw(st.binary(min_size=1, max_size=20))
    bit = draw(st.integers(0, 8 * len(data) - 1))
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """Random bytes, deep nesting (under aiohttp's 1 MiB body limit), or a damaged body."""
    kind = draw(st.sampled_from(["random", "nested", "damaged"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "nested":
        return draw(st.sampled_from([b"[", b'{"prompt":'])) * draw(st.integers(1, 100_000))
    return _damaged(draw, json.dumps(draw(bodies())).encode())


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


# -- HTTP ------------------------------------------------------------------------------------


@FUZZ
@given(body=json_values)
def test_arbitrary_json_bodies(front, body):
    status, kind, answer = _post(front, json.dumps(body).encode(), JSON)
    _check_http(status, kind, answer)
    if not isinstance(body, dict) or "prompt" not in body:
        assert status == 400, answer
    _still_serving(front)


@FUZZ
# Each once a 500 or a dead engine: float() of a huge integer, uint32 / uint64 overflow on
# the way to the engine, a bool seed, and temperatures whose softmax is NaN on the engine.
@example(body={"prompt": [1], "temperature": 10**400}, headers={})
@example(body={"prompt": [1], "max_tokens": 2**40}, headers={})
@example(body={"prompt": [1, 2**40], "max_tokens": 2}, headers={})
@example(body={"prompt": [1], "max_tokens": 2, "seed": 2**70}, headers={})
@example(body={"prompt": [1], "max_tokens": 2, "seed": True}, headers={})
@example(body={"prompt": [1], "max_tokens": 2, "temperature": math.nan}, headers={})
@example(body={"prompt": [1], "max_tokens": 2, "temperature": 1e-44}, headers={})
@given(body=bodies(), headers=slo_headers)
def test_completion_fields_of_any_type(front, body, headers):
    status, kind, answer = _post(front, json.dumps(body).encode(), JSON | headers)
    msg = _check_http(status, kind, answer)
    max_tokens, seed = body.get("max_tokens", SHORT), body.get("seed", 0)
    if _is_bad_temperature(body.get("temperature", 1.0)):
        assert status == 400, answer
    if not (_is_int(max_tokens) and 1 <= max_tokens < 2**32):
        assert status == 400, answer
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**64):
        assert status == 400, answer
    if status == 200:
        assert msg["usage"]["completion_tokens"] <= max_tokens
    _still_serving(front)


@FUZZ
@example(body=b"[" * 100_000, content_type="application/json")  # RecursionError: a 500
@example(body=b'{"prompt": [1]}', content_type="application/json; charset=foo")  # LookupError
@given(body=raw_bodies(), content_type=content_types)
def test_raw_bytes_bodies_and_content_types(front, body, content_type):
    status, kind, answer = _post(front, body, {"Content-Type": content_type})
    _check_http(status, kind, answer)
    try:
        json.loads(body.decode("utf-8"))
        is_json = True
    except (ValueError, RecursionError):
        is_json = False
    if not is_json and "charset" not in content_type:
        event("not JSON")
        assert status == 400, answer
    _still_serving(front)


@FUZZ
@given(headers=slo_headers)
def test_slo_headers(front, headers):
    """A value that is not a positive number of milliseconds is a 400; any other is served
    or refused with the policy's reason."""
    body = json.dumps({"prompt": PROBE, "max_tokens": 2, "temperature": 0}).encode()
    status, kind, answer = _post(front, body, JSON | headers)
    msg = _check_http(status, kind, answer)
    values = [v.strip(" \t") for v in headers.values()]
    if all(v.isascii() for v in values):
        assert (status == 400) is not all(_is_positive(v) for v in values), answer
    if status == 429:
        assert msg["error"]["reason"], msg
    _still_serving(front)


def _is_positive(value: str) -> bool:
    try:
        return float(value) > 0
    except ValueError:
        return False


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


# -- clients that leave ----------------------------------------------------------------------


def _leave_http(front: Front, prompt: list[int], num_chunks: int) -> None:
    body = {"prompt": prompt, "max_tokens": LONG, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", front.http_port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), JSON)
        response = conn.getresponse()
        assert response.status == 200
        for _ in range(num_chunks):
            assert response.readline().startswith(b"data: {")
            response.readline()
    finally:
        conn.close()


def _leave_grpc(front: Front, prompt: list[int], num_chunks: int) -> None:
    request = pb.CompleteRequest(prompt_token_ids=prompt, max_tokens=LONG, temperature=0)
    call = front.channel.unary_stream(COMPLETE, None, None)(
        request.SerializeToString(), timeout=TIMEOUT_S
    )
    for _ in range(num_chunks):
        next(call)
    call.cancel()


LEAVE: dict[str, Callable[[Front, list[int], int], None]] = {
    "http": _leave_http,
    "grpc": _leave_grpc,
}


@pytest.mark.parametrize("api", LEAVE)
@FUZZ_FEW
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64),
    num_chunks=st.integers(1, 3),
)
def test_a_client_that_leaves_a_stream_makes_the_engine_abort(front, api, prompt, num_chunks):
    """Its request would decode for seconds more: the engine aborts it instead."""
    num_aborts = front.engine_proc.log().count("event=abort")
    LEAVE[api](front, prompt, num_chunks)
    what = "the engine aborts the request"
    wait_until(lambda: front.engine_proc.log().count("event=abort") > num_aborts, 10.0, what)
    _still_serving(front)


def test_after_the_fuzzing_nothing_is_left_running(front):
    """Run last in this module: both processes serve, over HTTP and gRPC, and the engine
    holds no request and every page is free."""
    _still_serving(front)
    request = pb.CompleteRequest(prompt_token_ids=PROBE, max_tokens=4, temperature=0)
    msgs = list(
        front.channel.unary_stream(COMPLETE, None, pb.CompleteResponse.FromString)(
            request.SerializeToString(), timeout=TIMEOUT_S
        )
    )
    assert [t for m in msgs for t in m.token_ids] == front.reference
    wait_until(lambda: _is_idle(front.engine), TIMEOUT_S, "the engine holds no request")
