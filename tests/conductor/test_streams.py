"""The conductor's bounds on response streams, over real processes: a tiny engine, and a
conductor in front of it that authenticates two tenants and keeps at most 2 streams per
client and 3 in all open, ending a stream whose reader takes nothing for 2 s. The attacker
is a process of its own (this module run as a script, so its imports stay light: nothing
that brings torch at the top) that opens streaming completions and never reads them; the
test process is everyone else.

Past its bound a tenant's next stream is refused, over HTTP (429) and gRPC
(RESOURCE_EXHAUSTED) alike: its streams over both count together. A stalled stream is ended
once a write of it has waited out the deadline: the stall is counted, its engine request
aborted and its ticket ended, and its slot given back (HTTP: at once, the connection
aborted; gRPC: once the reader of the stalled message goes away). Meanwhile another tenant
is served as usual.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest

from kvstore import cli
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.bounds import StreamSettings
from kvstore.conductor.front.config import ConductorConfig
from kvstore.config import build
from kvstore.errors import InvalidArgumentError
from tests.conftest import free_port, wait_until

ATTACKER, GOOD = "token-of-a-stalling-reader-01", "token-of-a-good-reader-00001"
PER_CLIENT, IN_ALL, STALL_S = 2, 3, 2.0
# Each SSE chunk repeats the request's `model`: this one makes every chunk ~16 KB, so a few
# hundred tokens fill what the kernel buffers for a reader that takes nothing (the sender's
# buffer alone grows to megabytes on loopback) and aiohttp's writes start to wait.
MODEL = "m" * 16_000
ATTACK_TOKENS = 1000  # far more than the buffers take: the stream stalls long before its end
PROMPT = [1, 2, 3]


@dataclass
class Front:
    http: str  # base URL of the conductor's HTTP API
    grpc: str  # its gRPC address
    engine: str  # the engine behind it


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    # Here, not at the top: these bring torch, which the attacker process has no use for.
    from tests.conductor.test_live import _ports, _spawn
    from tests.conductor.test_view import PROFILE

    tmp = tmp_path_factory.mktemp("streams")
    (tmp / "callers").write_text(f"attacker {ATTACKER}\ngood {GOOD}\n")
    PROFILE.save(profile := tmp / "profile.json")
    port = free_port()
    engine = _spawn(tmp, "engine", "engine", "--port", str(port), "--num-pages", "2048")
    conductor = _spawn(
        tmp, "conductor", "conductor", "--engines", f"127.0.0.1:{port}",
        "--auth-token-file", str(tmp / "callers"), "--profile", str(profile),
        "--policy", "round-robin", "--port", "0", "--grpc-port", "0",
        "--max-streams-per-client", str(PER_CLIENT), "--max-streams", str(IN_ALL),
        "--stream-stall-timeout-s", str(STALL_S),
    )  # fmt: skip
    try:
        http, grpc_port = wait_until(lambda: _ports(conductor), 90.0, "the conductor serves")
        yield Front(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}", f"127.0.0.1:{port}")
    finally:
        for proc in (conductor, engine):
            proc.terminate()
        codes = [proc.stop() for proc in (conductor, engine)]
    assert codes == [0, 0], conductor.log()


# --- the attacker: `python -m tests.conductor.test_streams http|grpc HOST:PORT TOKEN N` ---


def _stall_http(address: str, token: str, n: int) -> list[socket.socket]:
    """`n` streaming completions on raw sockets that are never read."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": ATTACK_TOKENS, "stream": True}
    data = json.dumps(body | {"temperature": 0}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    host, port = address.rsplit(":", 1)
    held = []
    for _ in range(n):
        sock = socket.socket()
        # A small receive window (set before connect, which fixes it) keeps the kernel from
        # taking megabytes more on the reader's side: the conductor's writes wait sooner.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(head.encode() + data)
        held.append(sock)
    return held


def _stall_grpc(address: str, token: str, n: int) -> list[object]:
    """`n` Complete calls that are never iterated."""
    # The calls' messages are ~10 bytes: with the default 64 KiB stream window (and BDP
    # probes growing it) thousands would fit before the conductor's writes wait. A 1 KiB
    # window, never grown, fills after ~70.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    request = pb.CompleteRequest(prompt_token_ids=PROMPT, max_tokens=ATTACK_TOKENS)
    channel = grpc.insecure_channel(address, options=options)
    stub = pb_grpc.ConductorStub(channel)
    return [channel, *(stub.Complete(request, metadata=_bearer(token)) for _ in range(n))]


def _attack(argv: list[str]) -> None:
    kind, address, token, n = argv
    stall = _stall_http if kind == "http" else _stall_grpc
    held = stall(address, token, int(n))
    sys.stdin.read()  # holds them, unread, until killed
    del held


def _attacker(front: Front, kind: str, n: int) -> subprocess.Popen[bytes]:
    address = front.http.removeprefix("http://") if kind == "http" else front.grpc
    cmd = [sys.executable, "-m", "tests.conductor.test_streams", kind, address, ATTACKER, str(n)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(timeout=30)


# --- what the test process sees ---


def _bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def _client(front: Front, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.http + "/v1", api_key=token, max_retries=0, timeout=60.0)


def _metric(front: Front, series: str) -> float:
    with urllib.request.urlopen(front.http + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert found, f"no {series} in /metrics"
    return float(found.group(1))


def _open(front: Front) -> float:
    return _metric(front, 'kvstore_open_streams{service="conductor"}')


def _stalled(front: Front) -> float:
    return _metric(front, 'kvstore_stalled_streams_total{service="conductor"}')


def _refused(front: Front) -> float:
    return _metric(front, 'kvstore_refused_streams_total{service="conductor"}')


def _is_idle(front: Front) -> bool:
    """The engine runs nothing and holds no pages; the conductor's view has nothing
    decoding on it (every ticket ended)."""
    with grpc.insecure_channel(front.engine) as channel:
        load = pb_grpc.EngineServiceStub(channel).Load(pb.LoadRequest(), timeout=10)
    decoding = f'kvstore_conductor_engine_decoding_requests{{engine="{front.engine}"}}'
    return (load.num_running, load.num_free_pages, _metric(front, decoding)) == (
        0,
        load.num_pages,
        0,
    )


def _stream_ids(client: openai.OpenAI, max_tokens: int) -> list[int]:
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True
    )
    return [t for c in stream for t in c.model_extra["kvstore"]["token_ids"]]


def _complete(front: Front, token: str, max_tokens: int) -> list[pb.CompleteResponse]:
    with grpc.insecure_channel(front.grpc) as channel:
        request = pb.CompleteRequest(prompt_token_ids=PROMPT, max_tokens=max_tokens)
        return list(pb_grpc.ConductorStub(channel).Complete(request, metadata=_bearer(token)))


def _refused_over_http(front: Front, token: str) -> dict[str, object]:
    """The 429's error of a stream request with `token`."""
    with pytest.raises(openai.RateLimitError) as refused:
        _stream_ids(_client(front, token), 2)
    assert refused.value.response.status_code == 429
    error = refused.value.response.json()["error"]
    assert error["code"] == "too_many_streams"
    assert (error["max_streams_per_client"], error["max_streams"]) == (PER_CLIENT, IN_ALL)
    return error


def _refused_over_grpc(front: Front, token: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _complete(front, token, 2)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_streams_per_client = 2" in refused.value.details()
    assert dict(refused.value.trailing_metadata())["kvstore-error"] == "TooManyStreamsError"


# --- the tests ---


def test_stalled_http_streams_are_ended_and_their_tenant_held_to_its_bound(front):
    stalled, refused = _stalled(front), _refused(front)
    attacker = _attacker(front, "http", PER_CLIENT)
    try:
        wait_until(lambda: _open(front) == PER_CLIENT, 30.0, "the attacker's streams are open")
        # Its tenant is at its bound (the stalls take a few hundred tokens and 2 s more).
        error = _refused_over_http(front, ATTACKER)
        assert "max_streams_per_client = 2" in str(error["message"])
        _refused_over_grpc(front, ATTACKER)  # its gRPC calls count with its HTTP streams
        # Another tenant gets the one slot left, and past it is refused by the bound in all.
        good = _client(front, GOOD)
        held = good.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3000, temperature=0, stream=True
        )
        assert next(iter(held)).model_extra["kvstore"]["token_ids"]
        assert "max_streams = 3" in str(_refused_over_http(front, GOOD)["message"])
        held.close()
        wait_until(lambda: _open(front) <= PER_CLIENT, 10.0, "the good stream's slot is back")
        assert len(_stream_ids(good, 8)) == 8
        assert _refused(front) == refused + 3
        what = "the stalled streams are ended"
        wait_until(lambda: _stalled(front) == stalled + PER_CLIENT, 30.0, what)
        # Their connections are aborted: the slots are free with the attacker still there.
        wait_until(lambda: _open(front) == 0, 10.0, "their slots are given back")
        wait_until(lambda: _is_idle(front), 10.0, "their engine requests are aborted")
        assert attacker.poll() is None
        assert _stream_ids(_client(front, ATTACKER), 4)  # a reader that reads is served again
    finally:
        _kill(attacker)
    assert _open(front) == 0


def test_stalled_grpc_streams_are_ended_and_their_tenant_held_to_its_bound(front):
    stalled, refused = _stalled(front), _refused(front)
    attacker = _attacker(front, "grpc", PER_CLIENT)
    try:
        wait_until(lambda: _open(front) == PER_CLIENT, 30.0, "the attacker's calls are open")
        _refused_over_grpc(front, ATTACKER)
        _refused_over_http(front, ATTACKER)  # its HTTP streams count with its gRPC calls
        msgs = _complete(front, GOOD, 8)  # another tenant is served meanwhile
        assert sum(len(m.token_ids) for m in msgs) == 8 and msgs[-1].finish_reason == "length"
        assert _stream_ids(_client(front, GOOD), 8)
        assert _refused(front) == refused + 2
        what = "the stalled calls are ended"
        wait_until(lambda: _stalled(front) == stalled + PER_CLIENT, 30.0, what)
        wait_until(lambda: _is_idle(front), 10.0, "their engine requests are aborted")
        # Each stalled message waits below for its reader: the slots stay taken until then.
        assert _open(front) == PER_CLIENT
    finally:
        _kill(attacker)
    wait_until(lambda: _open(front) == 0, 10.0, "the slots are given back with the reader gone")


def test_stream_limits_are_checked():
    with pytest.raises(InvalidArgumentError, match="max_streams_per_client"):
        StreamSettings(max_streams_per_client=4, max_streams=3)
    with pytest.raises(InvalidArgumentError, match="stream_stall_timeout_s"):
        StreamSettings(stream_stall_timeout_s=0)
    args = cli.build_parser().parse_args(["conductor", "--engines", "127.0.0.1:1"])
    with pytest.raises(InvalidArgumentError, match="max_streams_per_client"):
        build(ConductorConfig, args, {"KVSTORE_MAX_STREAMS_PER_CLIENT": "300"})


if __name__ == "__main__":
    _attack(sys.argv[1:])
