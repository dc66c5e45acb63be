"""Clients of one real conductor that leave a stream, over HTTP and over gRPC (hypothesis),
in front of one `kvstore engine` (`conductor_cases`): a request that would decode for seconds
more is aborted on the engine instead. Run last in its module, a check that both processes
still serve over both APIs and the engine holds no request and every page is free.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore._proto import kvstore_pb2 as pb
from tests.conftest import wait_until
from tests.fuzz import conductor_cases as cases
from tests.fuzz.conductor_cases import (
    COMPLETE,
    FUZZ_FEW,
    JSON,
    LONG,
    PROBE,
    TIMEOUT_S,
    VOCAB,
    Front,
    _is_idle,
    _still_serving,
)

front = cases.front  # a fixture: this module's engine and conductor

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
