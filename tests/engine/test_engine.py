"""Engine correctness: reused KV (local prefix cache, or blocks through a connector) gives the
same tokens and logits as recomputation; batching, chunking and preemption change nothing; a
prefill engine's output streams its first token and finishes once published, and a decode
engine handed the blocks continues exactly."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from gpu_engine.config import EngineConfig
from gpu_engine.connector_base import KVConnector
from gpu_engine.engine import Engine, RequestOutput
from gpu_engine.errors import EngineFailedError, InvalidRequestError
from gpu_engine.runner import EngineRunner
from gpu_engine.sampling import MIN_TEMPERATURE, SamplingParams
from tests.engine.gpu_engine_connectors import DictConnector, FlakyConnector, GatedConnector

BLOCK = 8
GREEDY = SamplingParams(max_tokens=6)
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The tiny model's ops are microseconds: threads only add contention on a shared box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _make_engine(connector: KVConnector | None = None, **overrides: object) -> Engine:
    fields: dict = {"block_tokens": BLOCK, "page_tokens": 4, "num_pages": 64}
    return Engine(EngineConfig(**(fields | overrides)), connector)


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (length,), generator=gen).tolist()


def _reference(prompt: list[int], params: SamplingParams = GREEDY) -> RequestOutput:
    """Everything recomputed: no prefix cache, no connector, one-shot prefill."""
    engine = _make_engine(enable_prefix_cache=False, max_prefill_tokens=4096)
    return engine.generate([prompt], params)[0]


def _assert_same(out: RequestOutput, ref: RequestOutput) -> None:
    assert out.output_token_ids == ref.output_token_ids
    assert out.logits is not None and ref.logits is not None
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)


def _assert_idle(engine: Engine) -> None:
    engine.pool.check()
    assert not engine.has_unfinished
    assert all(engine.pool.refcount(p) == 0 for p in range(engine.config.num_pages))
    assert engine.pool.num_available == engine.config.num_pages


@pytest.mark.parametrize("page_tokens", [4, 8])
def test_local_prefix_cache_equals_recompute(page_tokens: int) -> None:
    shared = _prompt(0, 3 * BLOCK + 5)
    first, second = shared + _prompt(1, 9), shared + _prompt(2, 13)
    engine = _make_engine(page_tokens=page_tokens)
    out_first = engine.generate([first], GREEDY)[0]
    out_second = engine.generate([second], GREEDY)[0]
    out_again = engine.generate([first], GREEDY)[0]
    _assert_same(out_first, _reference(first))
    _assert_same(out_second, _reference(second))
    _assert_same(out_again, out_first)
    assert out_first.usage.cached_tokens == 0
    assert out_second.usage.local_cached_tokens == 3 * BLOCK  # the shared full blocks
    assert out_again.usage.local_cached_tokens == (len(first) - 1) // BLOCK * BLOCK
    assert out_again.usage.store_cached_tokens == 0
    _assert_idle(engine)


def test_prompt_of_whole_blocks_still_computes_its_last_block() -> None:
    prompt = _prompt(3, 4 * BLOCK)
    engine = _make_engine()
    engine.generate([prompt], GREEDY)
    out = engine.generate([prompt], GREEDY)[0]
    assert out.usage.cached_tokens == 3 * BLOCK
    _assert_same(out, _reference(prompt))


@pytest.mark.parametrize("async_load", [True, False])
@pytest.mark.parametrize("as_bytes", [False, True])
@pytest.mark.parametrize("page_tokens", [4, 8])
def test_blocks_saved_by_one_engine_load_into_another(
    page_tokens: int, as_bytes: bool, async_load: bool
) -> None:
    blocks: dict[bytes, object] = {}
    prompt = _prompt(4, 5 * BLOCK + 3)
    saver = DictConnector(blocks, as_bytes)
    _make_engine(saver, page_tokens=page_tokens).generate([prompt], GREEDY)
    assert saver.num_saved == len(blocks) == 6  # 48 computed tokens (prompt and outputs)

    connector = DictConnector(blocks, as_bytes)
    engine = _make_engine(connector, page_tokens=page_tokens, async_load=async_load)
    short = prompt[: 2 * BLOCK + 1]
    out_short, out = (engine.generate([p], GREEDY)[0] for p in (short, prompt))
    _assert_same(out_short, _reference(short))
    _assert_same(out, _reference(prompt))
    assert out_short.usage[2:] == (2 * BLOCK, 0, 2 * BLOCK)  # cached: all, local, store
    assert out.usage[2:] == (5 * BLOCK, 2 * BLOCK, 3 * BLOCK)
    _assert_idle(engine)


@pytest.mark.parametrize(
    ("mode", "limit", "loaded_blocks"),
    [
        ("raise", 0, 0),
        ("bad_count", 0, 0),
        ("partial", 0, 0),
        ("partial", 2, 2),
        ("lookup_raise", 4, 0),
        ("lookup_bad_count", 4, 0),
    ],
)
def test_failed_or_partial_loads_are_recomputed(mode: str, limit: int, loaded_blocks: int) -> None:
    blocks: dict[bytes, object] = {}
    prompt = _prompt(6, 4 * BLOCK + 1)
    _make_engine(DictConnector(blocks)).generate([prompt], GREEDY)
    engine = _make_engine(FlakyConnector(blocks, mode, limit))
    out = engine.generate([prompt], GREEDY)[0]
    _assert_same(out, _reference(prompt))
    assert out.usage.store_cached_tokens == loaded_blocks * BLOCK
    assert out.usage.cached_tokens == loaded_blocks * BLOCK
    _assert_idle(engine)


def test_running_requests_decode_while_a_load_is_in_flight() -> None:
    blocks: dict[bytes, object] = {}
    stored = _prompt(60, 4 * BLOCK + 3)
    _make_engine(DictConnector(blocks)).generate([stored], GREEDY)
    connector = GatedConnector(blocks)
    engine = _make_engine(connector)
    other = _prompt(61, 5)  # shorter than a block: nothing to look up
    engine.add_request(other, SamplingParams(max_tokens=4))
    engine.add_request(stored, GREEDY)

    early = [engine.step() for _ in range(4)]  # the load waits at the gate meanwhile
    assert [[o.request_id for o in outs] for outs in early] == [[0]] * 4
    assert early[-1][0].finished and engine.num_running == 1 and engine.has_unfinished
    _assert_same(early[-1][0], _reference(other, SamplingParams(max_tokens=4)))

    connector.gate.set()
    finished = [o for _ in range(GREEDY.max_tokens + 1) for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [1]
    _assert_same(finished[0], _reference(stored))
    assert finished[0].usage[2:] == (4 * BLOCK, 0, 4 * BLOCK)
    _assert_idle(engine)


def test_only_blocks_the_lookup_reports_are_loaded() -> None:
    blocks: dict[bytes, object] = {}
    prompt = _prompt(62, 4 * BLOCK + 3)
    _make_engine(DictConnector(blocks)).generate([prompt], GREEDY)
    connector = GatedConnector(blocks, max_hits=2)
    connector.gate.set()
    engine = _make_engine(connector)
    out = engine.generate([prompt], GREEDY)[0]  # a lone request: the step waits for its load
    _assert_same(out, _reference(prompt))
    assert len(connector.loaded_keys) == 2
    assert out.usage.store_cached_tokens == 2 * BLOCK
    _assert_idle(engine)


@pytest.mark.parametrize("async_load", [True, False])
def test_a_lone_store_hit_waits_for_its_load_in_one_step_and_computes_in_the_next(
    async_load: bool,
) -> None:
    blocks: dict[bytes, object] = {}
    prompt = _prompt(63, 4 * BLOCK + 3)
    _make_engine(DictConnector(blocks)).generate([prompt], GREEDY)
    connector = GatedConnector(blocks)
    connector.gate.set()
    engine = _make_engine(connector, async_load=async_load)
    engine.add_request(prompt, GREEDY)
    assert engine.step() == []  # admitted; the step waits for the load instead of spinning
    assert engine.num_running == 1 and engine.num_waiting == 0
    first = engine.step()  # the load is in: only the 3 tokens after the loaded blocks
    assert len(first) == 1 and first[0].output_token_ids == _reference(prompt).output_token_ids[:1]
    assert first[0].usage.store_cached_tokens == 4 * BLOCK
    while engine.has_unfinished:
        engine.step()
    _assert_idle(engine)


@pytest.mark.parametrize("max_prefill_tokens", [1, 5, 8, 13])
def test_chunked_prefill_equals_one_shot(max_prefill_tokens: int) -> None:
    prompt = _prompt(7, 50)
    out = _make_engine(max_prefill_tokens=max_prefill_tokens).generate([prompt], GREEDY)[0]
    _assert_same(out, _reference(prompt))


def test_batch_equals_each_alone() -> None:
    prompts = [_prompt(10 + i, n) for i, n in enumerate([3, 17, 40, 8, 29])]
    params = [
        SamplingParams(max_tokens=5),
        SamplingParams(max_tokens=9, temperature=0.8, seed=1),
        SamplingParams(max_tokens=3),
        SamplingParams(max_tokens=12, temperature=1.5, seed=2),
        SamplingParams(max_tokens=7),
    ]
    engine = _make_engine(max_prefill_tokens=32)  # admissions spread over steps, chunked
    outs = engine.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        _assert_same(out, _reference(prompt, sp))
        assert out.usage.completion_tokens == sp.max_tokens
    _assert_idle(engine)


def test_preemption_under_a_small_pool_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpu_engine.scheduler")
    prompts = [_prompt(20 + i, 20) for i in range(4)]
    params = SamplingParams(max_tokens=14)
    engine = _make_engine(num_pages=24, max_prefill_tokens=64)  # 4 x 34 tokens need 36 pages
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        _assert_same(out, _reference(prompt, params))
        assert out.usage.cached_tokens == 0  # counted on first admission only
    assert "event=preempt" in caplog.text
    _assert_idle(engine)


def test_eviction_under_a_small_pool_keeps_outputs_exact() -> None:
    engine = _make_engine(num_pages=16)
    prompts = [_prompt(30 + i, 3 * BLOCK + 2) for i in range(4)]  # 7 pages each, 6 cacheable
    for prompt in prompts:
        engine.generate([prompt], GREEDY)
        engine.pool.check()
    assert engine.pool.num_cached_blocks * 2 <= 16
    recent, evicted = (
        engine.generate([prompts[-1]], GREEDY)[0],
        engine.generate([prompts[0]], GREEDY)[0],
    )
    assert recent.usage.local_cached_tokens == 3 * BLOCK
    assert evicted.usage.local_cached_tokens == 0
    _assert_same(recent, _reference(prompts[-1]))
    _assert_same(evicted, _reference(prompts[0]))
    _assert_idle(engine)


def test_streamed_outputs_and_metrics_from_an_injected_clock() -> None:
    ticks = iter(range(100))
    engine = Engine(EngineConfig(), clock=lambda: float(next(ticks)))
    engine.add_request(_prompt(40, 10), SamplingParams(max_tokens=3))  # arrives at 0
    streamed = [engine.step() for _ in range(3)]  # tokens at 1, 2, 3
    assert [len(s) for s in streamed] == [1, 1, 1]
    assert [s[0].finished for s in streamed] == [False, False, True]
    assert streamed[0][0].logits is None and streamed[-1][0].logits is not None
    out = streamed[-1][0]
    assert out.metrics.ttft_s == 1.0 and out.metrics.tpot_s == 1.0
    assert out.usage == (10, 3, 0, 0, 0)
    assert engine.step() == []


def test_seeded_sampling_is_reproducible_and_stop_tokens_stop() -> None:
    prompt = _prompt(50, 12)
    hot = SamplingParams(max_tokens=10, temperature=2.0, seed=7)
    a, b = (_make_engine().generate([prompt], hot)[0] for _ in range(2))
    c = _make_engine().generate([prompt], SamplingParams(max_tokens=10, temperature=2.0, seed=8))[0]
    assert a.output_token_ids == b.output_token_ids != c.output_token_ids
    stop = a.output_token_ids[3]
    first = a.output_token_ids.index(stop)
    stopped = _make_engine().generate([prompt], SamplingParams(10, 2.0, 7, (stop,)))[0]
    assert stopped.output_token_ids == a.output_token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and a.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "max_tokens"), [([], 1), ([512], 1), ([-1], 1), ([1] * 4000, 100), ([1] * 200, 60)]
)
def test_bad_requests_are_refused(prompt: list[int], max_tokens: int) -> None:
    engine = _make_engine(num_pages=64)  # 256 tokens of pages
    with pytest.raises(InvalidRequestError):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    assert not engine.has_unfinished


def test_a_prefill_engine_streams_its_first_token_and_finishes_once_published() -> None:
    blocks: dict[bytes, object] = {}
    prompt, ticks = _prompt(70, 5 * BLOCK + 3), iter(range(100))
    ref = _reference(prompt)
    prefill = Engine(
        EngineConfig(block_tokens=BLOCK, page_tokens=4, role="prefill", async_load=False),
        DictConnector(blocks),
        clock=lambda: float(next(ticks)),
    )
    prefill.add_request(prompt, GREEDY)  # arrives at 0
    assert prefill.step() == []  # the dict's lookup claims every block: a load of none
    [first] = prefill.step()  # its token at 1; published inline
    assert (first.output_token_ids, first.finished) == (ref.output_token_ids[:1], False)
    assert prefill.has_unfinished and len(blocks) == 5
    [done] = prefill.step()  # no token: the publish is collected
    assert done.finish_reason == "prefill" and done.output_token_ids == first.output_token_ids
    assert done.num_published_tokens == 5 * BLOCK and done.error is None
    assert done.metrics.ttft_s == 1.0 and done.logits is not None
    _assert_idle(prefill)

    decode = _make_engine(DictConnector(blocks), role="decode", max_prefill_tokens=16)
    decode.add_request(prompt, GREEDY, num_published_tokens=done.num_published_tokens)
    outs = [o for _ in range(20) if decode.has_unfinished for o in decode.step() if o.finished]
    _assert_same(outs[0], ref)
    assert outs[0].usage.store_cached_tokens == 5 * BLOCK
    _assert_idle(decode)


@pytest.mark.parametrize("num_published_tokens", [-BLOCK, BLOCK + 1, 3 * BLOCK])
def test_a_published_count_that_is_not_whole_blocks_of_the_prompt_is_refused(
    num_published_tokens: int,
) -> None:
    engine = _make_engine(role="decode")
    with pytest.raises(InvalidRequestError, match="whole blocks"):
        engine.add_request(_prompt(71, 2 * BLOCK + 1), GREEDY, num_published_tokens)
    assert not engine.has_unfinished


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_reuses_kv() -> None:
    blocks: dict[bytes, object] = {}
    prompt = _prompt(60, 5 * BLOCK + 3)
    ref = _reference(prompt)
    saver = _make_engine(DictConnector(blocks), device="cuda")
    cold, warm = (saver.generate([prompt], GREEDY)[0] for _ in range(2))
    loaded = _make_engine(DictConnector(blocks), device="cuda").generate([prompt], GREEDY)[0]
    assert cold.output_token_ids == ref.output_token_ids
    torch.testing.assert_close(cold.logits, ref.logits, atol=1e-3, rtol=0)
    _assert_same(warm, cold)
    _assert_same(loaded, cold)
    assert warm.usage.local_cached_tokens == loaded.usage.store_cached_tokens == 5 * BLOCK


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), 1e-44, 0.005, -1.0])
def test_a_temperature_sampling_cannot_survive_is_refused(temperature: float) -> None:
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=temperature)


def test_the_smallest_temperature_samples_real_tokens() -> None:
    params = SamplingParams(max_tokens=4, temperature=MIN_TEMPERATURE, seed=3)
    [out] = _make_engine().generate([_prompt(4, 12)], params)
    assert len(out.output_token_ids) == 4 and all(t >= 0 for t in out.output_token_ids)


def test_a_step_that_raises_ends_every_request_and_refuses_new_ones() -> None:
    engine = _make_engine(num_pages=1024)
    runner = EngineRunner(engine).start()
    try:  # 2,000 tokens: still decoding when the fault comes, however slow this machine
        running = runner.submit(_prompt(5, 12), SamplingParams(max_tokens=2000))
        assert isinstance(running.get(timeout=30), RequestOutput)

        def lost(*args: object) -> torch.Tensor:
            raise RuntimeError("device lost")  # a fault in the forward pass

        engine.model = lost  # type: ignore[assignment]
        while isinstance(out := running.get(timeout=30), RequestOutput):
            assert not out.finished
        assert isinstance(out, EngineFailedError) and "device lost" in str(out)
        later = runner.submit(_prompt(6, 12), GREEDY)
        assert isinstance(later.get(timeout=30), EngineFailedError)
    finally:
        runner.stop()
