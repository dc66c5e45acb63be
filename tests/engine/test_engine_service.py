"""`kvstore engine` processes behind a real store: Generate streams the same tokens and logits
as an in-process engine, a second engine loads what the first published, Load reports the
engine's state, bad requests get INVALID_ARGUMENT without hurting the server, and a
`--role prefill` process hands a request to a `--role decode` one through the store."""

from __future__ import annotations

import logging
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from gpu_engine.config import EngineConfig
from gpu_engine.connector import StoreConnectorConfig
from gpu_engine.engine import Engine
from gpu_engine.engine_client import EngineClient
from gpu_engine.sampling import SamplingParams
from gpu_engine.service import EngineServer, EngineServiceConfig
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgumentError
from tests.conftest import wait_until

BLOCK = 8
ENGINE_FLAGS = ("--block-tokens", str(BLOCK), "--page-tokens", str(BLOCK), "--num-pages", "256")
GREEDY = SamplingParams(max_tokens=5)


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (length,), generator=gen).tolist()


def test_engine_processes_share_blocks_through_the_store(store, engine_factory):
    prompt = _prompt(1, 6 * BLOCK + 5)
    local = Engine(EngineConfig(block_tokens=BLOCK, page_tokens=BLOCK, enable_prefix_cache=False))
    ref = local.generate([prompt], GREEDY)[0]
    first = engine_factory("--store", store.address, *ENGINE_FLAGS)
    second = engine_factory("--store", store.address, *ENGINE_FLAGS)

    out = first.generate(prompt, GREEDY, return_logits=True)
    assert out.output_token_ids == ref.output_token_ids
    assert out.usage.cached_tokens == 0
    assert out.logits is not None and ref.logits is not None
    np.testing.assert_allclose(out.logits, ref.logits.numpy(), atol=1e-4, rtol=0)
    assert out.ttft_s >= out.engine_ttft_s > 0

    load = wait_until(  # publishing is asynchronous
        lambda: (lo := first.load()).num_pending_blocks == 0 and lo, 30.0, "blocks published"
    )
    assert load.store_connected and load.num_published_blocks >= 6
    assert load.num_running == load.num_waiting == 0

    loaded = second.generate(prompt, GREEDY, return_logits=True)
    assert loaded.usage.store_cached_tokens == 6 * BLOCK
    assert loaded.output_token_ids == ref.output_token_ids
    assert loaded.logits is not None
    np.testing.assert_allclose(loaded.logits, ref.logits.numpy(), atol=1e-4, rtol=0)
    block_bytes = local.config.namespace.block_bytes
    assert second.load().bytes_loaded == 6 * block_bytes


def test_in_process_server_streams_concurrent_requests_and_rejects_bad_input():
    config = EngineConfig(block_tokens=BLOCK, page_tokens=BLOCK)
    with (
        EngineServer(config, StoreConnectorConfig(), EngineServiceConfig(port=0)) as server,
        EngineClient(server.address) as client,
    ):
        with pytest.raises(InvalidArgumentError):
            client.generate([100_000])  # outside the vocabulary
        with pytest.raises(InvalidArgumentError):
            client.generate([])
        with grpc.insecure_channel(server.address) as channel:  # bytes no message parses
            path = "/kvstore.v1.EngineService/Generate"
            with pytest.raises(grpc.RpcError) as malformed:
                list(channel.unary_stream(path)(b"\x0a\x05ab", timeout=10))
        assert malformed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        prompts = [_prompt(seed, 20 + seed) for seed in range(4)]
        ref = Engine(config).generate(prompts, GREEDY)
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: client.generate(p, GREEDY), prompts))
        assert [o.output_token_ids for o in outs] == [r.output_token_ids for r in ref]
        assert all(o.finish_reason == "length" for o in outs)
        load = client.load()
        assert not load.store_connected and load.role == "both"
        assert load.num_free_pages == load.num_pages == config.num_pages


def test_a_cancelled_stream_stops_the_request_and_frees_its_pages(caplog):
    caplog.set_level(logging.INFO, logger="gpu_engine.scheduler")
    config = EngineConfig(block_tokens=BLOCK, page_tokens=BLOCK)
    with (
        EngineServer(config, StoreConnectorConfig(), EngineServiceConfig(port=0)) as server,
        EngineClient(server.address) as client,
        grpc.insecure_channel(server.address) as channel,
    ):
        request = pb.GenerateRequest(prompt_token_ids=_prompt(0, 40), max_tokens=2000)
        call = pb_grpc.EngineServiceStub(channel).Generate(request)
        assert next(call).token_ids  # decoding: 2,000 tokens to go
        assert client.load().num_running == 1
        call.cancel()
        wait_until(lambda: "event=abort" in caplog.text, 30, "the engine aborts the request")
        load = client.load()
        assert (load.num_running, load.num_waiting) == (0, 0)
        assert load.num_free_pages == load.num_pages  # its full blocks stay cached, evictable
        # The server goes on: the same prompt again gives what an engine of its own gives.
        [ref] = Engine(config).generate([_prompt(0, 40)], GREEDY)
        assert client.generate(_prompt(0, 40), GREEDY).output_token_ids == ref.output_token_ids


def test_prefill_and_decode_engine_processes_hand_a_request_over(store, engine_factory):
    prompt = _prompt(2, 6 * BLOCK + 5)
    config = EngineConfig(block_tokens=BLOCK, page_tokens=BLOCK)
    ref = Engine(config).generate([prompt], GREEDY)[0]
    prefill = engine_factory("--store", store.address, "--role", "prefill", *ENGINE_FLAGS)
    decode = engine_factory("--store", store.address, "--role", "decode", *ENGINE_FLAGS)

    first = prefill.generate(prompt, GREEDY)
    assert first.finish_reason == "prefill"
    assert first.output_token_ids == ref.output_token_ids[:1]
    assert first.num_published_tokens == 6 * BLOCK  # committed before the stream ended

    out = decode.generate(prompt, GREEDY, num_published_tokens=first.num_published_tokens)
    assert out.output_token_ids == ref.output_token_ids and out.finish_reason == "length"
    assert out.usage.store_cached_tokens == 6 * BLOCK
    assert out.num_published_tokens == 6 * BLOCK  # echoed
    load = decode.load()
    assert (load.role, load.num_store_loaded_blocks) == ("decode", 6)
    assert prefill.load().role == "prefill"
    with pytest.raises(InvalidArgumentError, match="whole blocks"):
        decode.generate(prompt, GREEDY, num_published_tokens=BLOCK + 1)


def test_an_unknown_role_stops_the_engine_command_naming_the_roles():
    cmd = [sys.executable, "-m", "kvstore.cli", "engine", "--role", "nonsense"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "role must be one of ['both', 'prefill', 'decode']" in done.stderr


def test_a_prefetch_is_checked_like_any_request_and_computes_nothing():
    """`GenerateRequest.prefetch` from outside: a bad prompt is INVALID_ARGUMENT; a good one
    on an engine without a store loads nothing, ends at once with no token, and the engine
    serves the next request as before."""
    config = EngineConfig(block_tokens=BLOCK, page_tokens=BLOCK)
    with (
        EngineServer(config, StoreConnectorConfig(), EngineServiceConfig(port=0)) as server,
        grpc.insecure_channel(server.address) as channel,
        EngineClient(server.address) as client,
    ):
        generate = pb_grpc.EngineServiceStub(channel).Generate
        for bad in ([], [100_000], [1] * 1_000_000):
            with pytest.raises(grpc.RpcError) as err:
                list(generate(pb.GenerateRequest(prompt_token_ids=bad, prefetch=True), timeout=30))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        prompt = _prompt(3, 4 * BLOCK + 1)
        [only] = generate(pb.GenerateRequest(prompt_token_ids=prompt, prefetch=True), timeout=30)
        assert (only.finish_reason, list(only.token_ids)) == ("prefetch", [])
        assert only.usage.store_cached_tokens == only.usage.completion_tokens == 0
        out = client.generate(prompt, GREEDY)
        assert out.output_token_ids == Engine(config).generate([prompt], GREEDY)[0].output_token_ids
        load = client.load()
        assert load.num_running == load.num_waiting == 0
        assert load.num_free_pages == load.num_pages
