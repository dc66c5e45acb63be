"""vLLM's OpenAI-compatible server with the kvstore connector, driven by the `openai` client:
a second, fresh server process gets the prefix the first one stored, with identical output.

Real processes throughout: a store, two `vllm.entrypoints.openai.api_server` processes (the
CPU wheel's server; `vllm serve` itself fails there), the tiny generated model.
"""

from __future__ import annotations

import os

import pytest

if not os.environ.get("KVSTORE_REQUIRE_VLLM"):
    pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvstore.bench.vllm_engine import kv_transfer_config  # noqa: E402
from kvstore.bench.vllm_model import build_model  # noqa: E402
from kvstore.client import Client  # noqa: E402
from tests.conftest import free_port, wait_until  # noqa: E402
from tests.integrations.vllm.vllm_fixtures import openai_server, prompt_tokens  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
PROMPT = prompt_tokens(seed=7, length=12 * BLOCK + 9)  # 12 full blocks and a tail
LOADABLE = 12 * BLOCK


def _complete(server, model: str) -> tuple[list[int], int]:
    """Greedy completion of PROMPT (token ids); its output tokens and cached prompt tokens."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300)
    reply = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = reply.choices[0]
    details = reply.usage.prompt_tokens_details
    return list(choice.token_ids), (details.cached_tokens or 0) if details else 0


def test_a_second_server_process_loads_the_prefix_the_first_one_stored(store, tmp_path):
    model = str(build_model(tmp_path / "tiny"))
    kv = kv_transfer_config({"connector": "kvstore", "store": store.address})
    with openai_server(tmp_path, "first", model, kv, free_port()) as first:
        output, cached = _complete(first, model)
        assert cached == 0
    assert "event=publish_stats published=12 dropped=0 failed=0" in first.log()
    with Client(store.address) as client:
        wait_until(lambda: client.stats().num_blocks >= 12, 30.0, "the prefix is in the store")
    with openai_server(tmp_path, "second", model, kv, free_port()) as second:
        again, cached = _complete(second, model)
    assert again == output
    assert cached == LOADABLE
    assert "event=load_warm_up" in second.log()
    assert "event=load_incomplete" not in second.log()
