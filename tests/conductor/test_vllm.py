"""`kvstore conductor` in front of a real vLLM server (CPU, a tiny random Llama) that runs the
kvstore connector against a real store: the conductor streams vLLM's own greedy token ids,
passes on its cached-token count for a repeated prompt, and refuses a request over its TTFT
SLO with 429 before vLLM sees it.

Needs vLLM: run in .venv-vllm (``.venv-vllm/bin/pytest -m vllm tests/conductor/test_vllm.py``);
elsewhere it is skipped, as tests/integrations/vllm/test_connector.py is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

if not os.environ.get("KVSTORE_REQUIRE_VLLM"):
    pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvstore.bench.vllm_engine import ENV  # noqa: E402 - after the skip
from kvstore.bench.vllm_model import build_model  # noqa: E402
from tests.conftest import free_port, start_store, wait_until  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
BLOCK = 32
PROMPT = [(i * 7919) % 2000 + 3 for i in range(6 * BLOCK + 8)]  # 6 full blocks and a tail


def _is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _spawn(log_path: Path, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(vLLM's base URL, the conductor's), both serving."""
    tmp = tmp_path_factory.mktemp("conductor-vllm")
    model = build_model(tmp / "model")
    store = start_store(tmp, "--dram-bytes", "256MiB")
    kv = {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"kvstore.address": store.address},
    }  # fmt: skip
    port, procs = free_port(), []
    vllm_cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--dtype", "float32", "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    vllm_url = f"http://127.0.0.1:{port}"
    try:
        procs.append(_spawn(tmp / "vllm.log", vllm_cmd, {**os.environ, **ENV}))
        wait_until(lambda: _is_healthy(vllm_url), 600.0, "vLLM serves")
        conductor_cmd = [
            sys.executable, "-m", "kvstore.cli", "conductor", "--engines", vllm_url,
            "--backend-block-tokens", str(BLOCK), "--port", "0", "--grpc-port", "-1",
        ]  # fmt: skip
        procs.append(_spawn(tmp / "conductor.log", conductor_cmd))
        log_path, serving = tmp / "conductor.log", r"conductor_serving http=\S+:(\d+)"
        found = wait_until(
            lambda: re.search(serving, log_path.read_text()), 120.0, "the conductor serves"
        )
        yield vllm_url, f"http://127.0.0.1:{found.group(1)}"
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
        store.stop()


def _direct(vllm_url: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        vllm_url + "/v1/completions",
        data=json.dumps({**body, "return_token_ids": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def test_the_conductor_streams_vllms_tokens_and_its_cached_count(servers):
    vllm_url, conductor_url = servers
    with urllib.request.urlopen(vllm_url + "/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]["id"]
    client = openai.OpenAI(base_url=conductor_url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    ids = [t for chunk in stream for t in chunk.model_extra["kvstore"]["token_ids"]]
    assert ids == _direct(vllm_url, model)
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.model_extra["kvstore"]["token_ids"] == ids
    assert again.usage.prompt_tokens_details.cached_tokens == 6 * BLOCK
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, extra_headers={"x-slo-ttft-ms": "0.001"}
        )
    assert refused.value.response.json()["error"]["reason"] == "ttft"
