"""What the fuzz tests of one real conductor share (`test_conductor_http.py`,
`test_conductor_grpc.py`, `test_conductor_cleanup.py`): one `kvstore engine` (tiny preset,
role "both", no store) behind one `kvstore conductor` on the fixed test profile, a module's
`front`; a POST, the check after every example that both processes run, a small greedy
completion gives the engine's own tokens and the engine holds no request and no page; which
temperatures must be refused; and the strategies both APIs draw from."""

from __future__ import annotations

import http.client
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gpu_engine.config import MODEL_PRESETS
from gpu_engine.engine_client import EngineClient
from gpu_engine.sampling import SamplingParams
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


def _is_bad_temperature(value: object) -> bool:
    """What the conductor must refuse: engines sample softmax(logits / temperature)."""
    if not isinstance(value, int | float):
        return True
    return value != 0 and not MIN_TEMPERATURE <= value <= sys.float_info.max


# -- strategies ------------------------------------------------------------------------------

long_prompts = st.integers(MAX_POSITION - 3 * SHORT, MAX_POSITION + 8).map(
    lambda n: [i % VOCAB for i in range(n)]  # at and over what the engine's positions hold
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
