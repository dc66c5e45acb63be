"""Arbitrary JSON, bytes, content types and SLO headers to one real conductor's
`POST /v1/completions` (hypothesis), in front of one `kvstore engine` (`conductor_cases`). It
answers 200, 400, 429 or 503 and nothing else (never a 500): a 400 carries a JSON error
message, a 200 a whole completion or a stream that ends with `[DONE]`. After every example
both processes run, a small greedy completion gives the engine's own tokens, and the engine
holds no request and no page.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import event, example, given
from hypothesis import strategies as st

from tests.fuzz import conductor_cases as cases
from tests.fuzz.conductor_cases import (
    ALLOWED_HTTP,
    FIELDS,
    FUZZ,
    JSON,
    MAX_POSITION,
    PROBE,
    SHORT,
    VOCAB,
    _damaged,
    _is_bad_temperature,
    _post,
    _still_serving,
    long_prompts,
)

front = cases.front  # a fixture: this module's engine and conductor

# -- checks ----------------------------------------------------------------------------------


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """Random bytes, deep nesting (under aiohttp's 1 MiB body limit), or a damaged body."""
    kind = draw(st.sampled_from(["random", "nested", "damaged"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "nested":
        return draw(st.sampled_from([b"[", b'{"prompt":'])) * draw(st.integers(1, 100_000))
    return _damaged(draw, json.dumps(draw(bodies())).encode())


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
