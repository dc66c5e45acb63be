"""Prefill/decode disaggregation over a real store process: a prefill engine finishes a
request at its first token only once every full prompt block is committed in the store (also
the blocks its bounded publisher dropped and those its prefix cache held but the store lost),
and a decode engine handed the published count loads them, recomputes only the partial last
block and streams the same tokens and logits as a single engine, greedy and seeded; blocks
the store lost meanwhile are recomputed, and a store that cannot take the blocks is the
request's error, never a silent drop."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from gpu_engine.config import EngineConfig
from gpu_engine.connector import StoreConnector, StoreConnectorConfig
from gpu_engine.engine import Engine, RequestOutput
from gpu_engine.errors import PublishError
from gpu_engine.sampling import SamplingParams
from kvstore.client import Client
from kvstore.keys import block_keys
from tests.conftest import free_port

BLOCK = 8
NUM_FULL = 8
PROMPT_LEN = NUM_FULL * BLOCK + 3  # 8 full blocks and a partial one
GREEDY = SamplingParams(max_tokens=6)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, seed=1234)
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(**overrides: object) -> EngineConfig:
    fields: dict = {"block_tokens": BLOCK, "page_tokens": BLOCK, "num_pages": 128}
    return EngineConfig(**(fields | overrides))


def _engine(address: str, role: str, **overrides: object) -> tuple[Engine, StoreConnector]:
    fields: dict = {"store": address, "timeout_s": 5.0}
    connector = StoreConnector(StoreConnectorConfig(**(fields | overrides)))
    return Engine(_config(role=role), connector), connector


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (length,), generator=gen).tolist()


def _reference(prompt: list[int], params: SamplingParams) -> RequestOutput:
    return Engine(_config()).generate([prompt], params)[0]


def _keys(prompt: list[int]) -> list[bytes]:
    return block_keys(_config().namespace, prompt)


def _num_committed(address: str, prompt: list[int]) -> int:
    with Client(address) as client:
        return client.match(_config().namespace.id, _keys(prompt)).num_matched


def _prefill(address: str, prompt: list[int], params: SamplingParams, **overrides: object):
    engine, connector = _engine(address, "prefill", **overrides)
    out = engine.generate([prompt], params)[0]
    connector.close()
    engine.pool.check()
    return out, connector


def _decode(address: str, prompt: list[int], params: SamplingParams, num_published: int):
    engine, connector = _engine(address, "decode")
    engine.add_request(prompt, params, num_published_tokens=num_published)
    outs = [o for _ in range(100) if engine.has_unfinished for o in engine.step() if o.finished]
    connector.close()
    engine.pool.check()
    return outs[0], connector


def _assert_same(out: RequestOutput, ref: RequestOutput) -> None:
    assert out.output_token_ids == ref.output_token_ids
    assert out.logits is not None and ref.logits is not None
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_then_decode_gives_a_single_engines_tokens(store, params):
    prompt = _prompt(1)
    ref = _reference(prompt, params)
    prefilled, _ = _prefill(store.address, prompt, params)
    assert prefilled.finish_reason == "prefill" and prefilled.error is None
    assert prefilled.output_token_ids == ref.output_token_ids[:1]
    assert prefilled.num_published_tokens == NUM_FULL * BLOCK

    out, connector = _decode(store.address, prompt, params, prefilled.num_published_tokens)
    _assert_same(out, ref)
    assert out.finish_reason == "length"
    usage = out.usage
    assert usage.cached_tokens == usage.store_cached_tokens == NUM_FULL * BLOCK  # all full
    assert usage.local_cached_tokens == 0
    assert connector.stats().num_loaded_blocks == NUM_FULL


def test_a_finished_prefill_has_every_full_block_in_the_store(store):
    prompts = [_prompt(2), _prompt(3, 4 * BLOCK)]  # a partial last block, and none
    engine, connector = _engine(store.address, "prefill")
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):  # no drain: finished means stored
        assert _num_committed(store.address, prompt) == len(prompt) // BLOCK
        assert out.num_published_tokens == len(prompt) // BLOCK * BLOCK
    connector.close()
    # With no partial block, the last full one is recomputed for its logits (as in vLLM).
    out, _ = _decode(store.address, prompts[1], GREEDY, 4 * BLOCK)
    assert out.usage.store_cached_tokens == 3 * BLOCK
    _assert_same(out, _reference(prompts[1], GREEDY))


def test_a_prefill_engine_publishes_what_its_bounded_publisher_dropped(store):
    prompt = _prompt(4)
    out, connector = _prefill(store.address, prompt, GREEDY, publish_buffers=2)
    assert connector.stats().publish.num_dropped_blocks == NUM_FULL - 2
    assert out.num_published_tokens == NUM_FULL * BLOCK and out.error is None
    assert _num_committed(store.address, prompt) == NUM_FULL


def test_a_prefill_finish_waits_for_its_offered_blocks_instead_of_putting_them_again(store):
    prompt = _prompt(9)
    engine, connector = _engine(store.address, "prefill")  # async_load: the default
    real_put_chain, unblock, calls = connector._client.put_chain, threading.Event(), []

    def slow_put_chain(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(args[1]))
        assert unblock.wait(timeout=30), "the test never let the put through"
        return real_put_chain(*args, **kwargs)

    connector._client.put_chain = slow_put_chain  # type: ignore[method-assign]
    engine.add_request(prompt, GREEDY)
    [first] = engine.step()  # the prompt's 8 blocks are offered; their put is stuck
    assert not first.finished and engine.has_unfinished
    unblock.set()
    outs = [o for _ in range(100) if engine.has_unfinished for o in engine.step() if o.finished]
    assert outs[0].num_published_tokens == NUM_FULL * BLOCK
    assert calls == [NUM_FULL]  # one put: the publish found every block committed
    connector.close()


def test_a_prefill_engine_republishes_cached_blocks_the_store_lost(store):
    prompt = _prompt(5)
    engine, connector = _engine(store.address, "prefill")
    engine.generate([prompt], GREEDY)
    with Client(store.address) as client:
        assert client.remove(_config().namespace.id, _keys(prompt)) == NUM_FULL
    again = engine.generate([prompt], GREEDY)[0]
    assert again.usage.local_cached_tokens == NUM_FULL * BLOCK  # nothing computed, or saved
    assert again.num_published_tokens == NUM_FULL * BLOCK
    assert _num_committed(store.address, prompt) == NUM_FULL
    connector.close()


@pytest.mark.parametrize("num_lost", [3, NUM_FULL])
def test_a_decode_engine_recomputes_blocks_the_store_lost(store, num_lost):
    prompt = _prompt(6)
    prefilled, _ = _prefill(store.address, prompt, SEEDED)
    with Client(store.address) as client:
        lost = _keys(prompt)[NUM_FULL - num_lost :]
        assert client.remove(_config().namespace.id, lost) == num_lost
    out, _ = _decode(store.address, prompt, SEEDED, prefilled.num_published_tokens)
    assert out.usage.store_cached_tokens == (NUM_FULL - num_lost) * BLOCK
    _assert_same(out, _reference(prompt, SEEDED))


def test_a_store_that_cannot_take_the_blocks_is_the_requests_error():
    prompt = _prompt(7)
    address = f"127.0.0.1:{free_port()}"  # nothing listens
    out, _ = _prefill(address, prompt, GREEDY, timeout_s=1.0, publish_timeout_s=1.0)
    assert out.finish_reason == "prefill"
    assert isinstance(out.error, PublishError)
    assert out.num_published_tokens == out.error.num_published_tokens == 0
    assert out.output_token_ids == _reference(prompt, GREEDY).output_token_ids[:1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_cuda_prefill_then_decode_gives_a_single_engines_tokens(store, params):
    prompt = _prompt(8)
    ref = Engine(_config(device="cuda")).generate([prompt], params)[0]
    prefill = StoreConnector(StoreConnectorConfig(store=store.address))
    engine = Engine(_config(role="prefill", device="cuda"), prefill)
    prefilled = engine.generate([prompt], params)[0]
    prefill.close()
    assert prefilled.num_published_tokens == NUM_FULL * BLOCK and prefilled.error is None
    decode = StoreConnector(StoreConnectorConfig(store=store.address))
    engine = Engine(_config(role="decode", device="cuda"), decode)
    engine.add_request(prompt, params, num_published_tokens=prefilled.num_published_tokens)
    outs = [o for _ in range(100) if engine.has_unfinished for o in engine.step() if o.finished]
    decode.close()
    assert outs[0].output_token_ids == ref.output_token_ids
    assert outs[0].usage.store_cached_tokens == NUM_FULL * BLOCK
    assert outs[0].logits is not None and ref.logits is not None
    torch.testing.assert_close(outs[0].logits, ref.logits, atol=1e-3, rtol=0)
