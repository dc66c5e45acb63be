"""A conductor that authenticates its callers (the OpenAI clients' api key is the bearer
token) and reaches an engine that authenticates it."""

from __future__ import annotations

import grpc
import openai
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from tests.conductor.test_live import _ports, _spawn
from tests.conductor.test_view import PROFILE
from tests.conftest import free_port, wait_until

CALLER, CONDUCTOR = "token-of-an-api-caller-0001", "token-of-the-conductor-0001"


def test_only_callers_with_a_token_get_completions(tmp_path):
    (tmp_path / "callers").write_text(f"team-a {CALLER}\n")
    (tmp_path / "engine-tokens").write_text(f"conductor {CONDUCTOR}\n")
    (tmp_path / "mine").write_text(CONDUCTOR)
    PROFILE.save(profile := tmp_path / "profile.json")
    port = free_port()
    engine = _spawn(tmp_path, "engine", "engine", "--port", str(port),
                    "--auth-token-file", str(tmp_path / "engine-tokens"))  # fmt: skip
    conductor = _spawn(
        tmp_path, "conductor", "conductor", "--engines", f"127.0.0.1:{port}",
        "--engine-token-file", str(tmp_path / "mine"), "--auth-token-file",
        str(tmp_path / "callers"), "--profile", str(profile), "--port", "0", "--grpc-port", "0",
    )  # fmt: skip
    try:
        http, grpc_port = wait_until(lambda: _ports(conductor), 90.0, "the conductor serves")
        base = f"http://127.0.0.1:{http}/v1"
        ok = openai.OpenAI(base_url=base, api_key=CALLER, max_retries=0, timeout=60.0)
        out = ok.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        bad = openai.OpenAI(base_url=base, api_key="not-a-token", max_retries=0, timeout=60.0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.ConductorStub(channel)
            request = pb.CompleteRequest(prompt_token_ids=[1, 2, 3], max_tokens=3)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Complete(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        for proc in (conductor, engine):
            proc.terminate()
        codes = [proc.stop() for proc in (conductor, engine)]
    assert codes == [0, 0]
