"""StoreConnector against real store processes: KV loaded from the store (DRAM and SSD) gives
the same tokens and logits as recomputed or locally cached KV, and a dead store, a failed
load or a full publish queue never changes an output."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
import torch

from gpu_engine.config import EngineConfig
from gpu_engine.connector import StoreConnector, StoreConnectorConfig
from gpu_engine.engine import Engine, RequestOutput
from gpu_engine.sampling import SamplingParams
from kvstore.client import Client
from kvstore.errors import UnavailableError
from kvstore.keys import block_keys
from tests.conftest import free_port, start_store, wait_until

BLOCK = 8
GREEDY = SamplingParams(max_tokens=6)
ATOL = 1e-4
PROMPT_LEN = 8 * BLOCK + 3  # 8 full blocks and a partial one


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine_config(**overrides: object) -> EngineConfig:
    fields: dict = {"block_tokens": BLOCK, "page_tokens": BLOCK, "num_pages": 128}
    return EngineConfig(**(fields | overrides))


def _connector(address: str, **overrides: object) -> StoreConnector:
    fields: dict = {"store": address, "timeout_s": 5.0, "load_batch_blocks": 4}
    return StoreConnector(StoreConnectorConfig(**(fields | overrides)))


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (length,), generator=gen).tolist()


def _reference(prompt: list[int]) -> RequestOutput:
    engine = Engine(_engine_config(enable_prefix_cache=False, max_prefill_tokens=4096))
    return engine.generate([prompt], GREEDY)[0]


def _assert_same(out: RequestOutput, ref: RequestOutput) -> None:
    assert out.output_token_ids == ref.output_token_ids
    assert out.logits is not None and ref.logits is not None
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)


def _publish(address: str, prompts: list[list[int]], **engine_overrides: object) -> None:
    """Runs `prompts` on a fresh engine and waits until its blocks are in the store."""
    connector = _connector(address)
    engine = Engine(_engine_config(**engine_overrides), connector)
    engine.generate(prompts, GREEDY)
    assert connector.drain(timeout_s=30.0)
    assert connector.stats().publish.num_failed_blocks == 0
    connector.close()


def _fresh_run(
    address: str, prompt: list[int], **overrides: object
) -> tuple[RequestOutput, StoreConnector]:
    """`prompt` on an engine that never saw it, loading from the store at `address`."""
    connector = _connector(address, **overrides)
    engine = Engine(_engine_config(), connector)
    out = engine.generate([prompt], GREEDY)[0]
    connector.close()
    engine.pool.check()
    return out, connector


def test_store_dram_local_and_recompute_agree(store):
    prompt = _prompt(1)
    ref = _reference(prompt)
    _publish(store.address, [prompt])

    out, connector = _fresh_run(store.address, prompt)
    assert out.usage.store_cached_tokens == 8 * BLOCK
    assert out.usage.local_cached_tokens == 0
    assert connector.stats().num_loaded_blocks == 8
    assert connector.stats().bytes_loaded == 8 * _engine_config().namespace.block_bytes
    _assert_same(out, ref)

    engine = Engine(_engine_config(), _connector(store.address))
    first, second = (engine.generate([prompt], GREEDY)[0] for _ in range(2))
    assert first.usage.store_cached_tokens == 8 * BLOCK
    assert second.usage.local_cached_tokens == 8 * BLOCK  # now in the local prefix cache
    _assert_same(first, ref)
    _assert_same(second, ref)


def test_loaded_prefix_then_computed_suffix_is_published_with_its_parent(store):
    shared = _prompt(2, 4 * BLOCK)
    _publish(store.address, [[*shared, 7]])
    longer = shared + _prompt(3, 4 * BLOCK + 3)
    out, _ = _fresh_run(store.address, longer)
    assert out.usage.store_cached_tokens == 4 * BLOCK
    _assert_same(out, _reference(longer))
    _publish(store.address, [longer])  # the suffix blocks chain onto the loaded ones
    out, _ = _fresh_run(store.address, longer)
    assert out.usage.store_cached_tokens == 8 * BLOCK
    _assert_same(out, _reference(longer))


def _ssd_store_args(tmp_path, block_bytes: int) -> tuple[str, ...]:
    return (
        "--dram-bytes", str(16 * block_bytes), "--slab-bytes", str(8 * block_bytes),
        "--ssd-path", str(tmp_path / "ssd"), "--ssd-bytes", str(4096 * block_bytes),
    )  # fmt: skip


def _wait_on_ssd(address: str, prompt: list[int]) -> None:
    """Publishes new prompts, two at a time, until every block of `prompt` is on SSD: how
    many that takes depends on the DRAM policy's order, so the pressure never repeats."""
    ns = _engine_config().namespace
    keys = block_keys(ns, prompt)
    seeds = itertools.count(100, 2)

    def is_all_on_ssd() -> bool:
        tiers = client.match(ns.id, keys).tiers
        if len(tiers) == len(keys) and set(tiers) == {"ssd"}:
            return True
        seed = next(seeds)
        _publish(address, [_prompt(seed), _prompt(seed + 1)])  # push the prompt's down
        return False

    with Client(address) as client:
        wait_until(is_all_on_ssd, 60.0, "the prompt's blocks all demoted to SSD")


def test_store_ssd_load_agrees_with_recompute(tmp_path, store_factory):
    block_bytes = _engine_config().namespace.block_bytes
    store = store_factory(*_ssd_store_args(tmp_path, block_bytes))
    prompt = _prompt(4)
    _publish(store.address, [prompt])
    _wait_on_ssd(store.address, prompt)

    out, _ = _fresh_run(store.address, prompt)
    assert out.usage.store_cached_tokens == 8 * BLOCK
    _assert_same(out, _reference(prompt))


def test_unreachable_store_recomputes():
    address = f"127.0.0.1:{free_port()}"
    prompt = _prompt(5)
    out, connector = _fresh_run(address, prompt, timeout_s=1.0)
    assert out.usage.store_cached_tokens == 0
    assert not connector.is_connected
    _assert_same(out, _reference(prompt))


def test_store_killed_after_publish_recomputes(tmp_path):
    store = start_store(tmp_path, "--dram-bytes", "16MiB")
    prompt = _prompt(6)
    _publish(store.address, [prompt])
    connector = _connector(store.address, timeout_s=1.0)
    engine = Engine(_engine_config(), connector)
    store.proc.kill()
    store.proc.wait(timeout=10)
    out = engine.generate([prompt], GREEDY)[0]
    assert out.usage.store_cached_tokens == 0
    assert connector.stats().num_load_errors >= 1
    _assert_same(out, _reference(prompt))
    connector.close()


def test_failed_batch_counts_only_the_batches_before_it(store):
    """The second get writes garbage into the pages and fails: only the first batch counts,
    and the engine recomputes over the garbage."""
    prompt = _prompt(7)
    _publish(store.address, [prompt])
    connector = _connector(store.address, load_batch_blocks=3)
    engine = Engine(_engine_config(), connector)
    real_get_into = connector._client.get_into
    calls = []

    def flaky_get_into(namespace_id, keys, buffers):  # type: ignore[no-untyped-def]
        calls.append(len(keys))
        if len(calls) == 2:
            for buf in buffers:
                buf.fill_(1e6)
            raise UnavailableError("injected mid-load failure")
        return real_get_into(namespace_id, keys, buffers)

    connector._client.get_into = flaky_get_into  # type: ignore[method-assign]
    out = engine.generate([prompt], GREEDY)[0]
    assert calls == [3, 3]
    assert out.usage.store_cached_tokens == 3 * BLOCK
    _assert_same(out, _reference(prompt))
    connector.close()


def test_blocks_evicted_between_match_and_get_stop_the_load(store):
    prompt = _prompt(8)
    _publish(store.address, [prompt])
    connector = _connector(store.address)
    engine = Engine(_engine_config(), connector)
    real_get_into = connector._client.get_into

    def gappy_get_into(namespace_id, keys, buffers):  # type: ignore[no-untyped-def]
        found = real_get_into(namespace_id, keys, buffers)
        return (*found[:2], False, *found[3:])

    connector._client.get_into = gappy_get_into  # type: ignore[method-assign]
    out = engine.generate([prompt], GREEDY)[0]
    assert out.usage.store_cached_tokens == 2 * BLOCK
    _assert_same(out, _reference(prompt))
    connector.close()


def test_full_publish_queue_drops_blocks_and_keeps_outputs(store):
    prompt = _prompt(9)
    connector = _connector(store.address, publish_buffers=2)
    engine = Engine(_engine_config(max_prefill_tokens=4096), connector)
    real_put_chain, unblock = connector._client.put_chain, threading.Event()

    def stuck_put_chain(*args, **kwargs):  # type: ignore[no-untyped-def]
        unblock.wait(timeout=30)  # the network is slow: both buffers stay taken
        return real_put_chain(*args, **kwargs)

    connector._client.put_chain = stuck_put_chain  # type: ignore[method-assign]
    out = engine.generate([prompt], GREEDY)[0]
    unblock.set()
    assert connector.drain(timeout_s=30.0)
    stats = connector.stats().publish
    assert stats.num_published_blocks == 2
    assert stats.num_dropped_blocks == 7  # 9 full blocks once decode ends
    _assert_same(out, _reference(prompt))
    connector.close()
    out, _ = _fresh_run(store.address, prompt)
    assert out.usage.store_cached_tokens == 2 * BLOCK  # the published chain prefix


def test_a_chain_cut_by_a_drop_is_not_continued(store):
    prompt = _prompt(11)  # 8 full blocks; the 9th completes while decoding
    connector = _connector(store.address, publish_buffers=2)
    engine = Engine(_engine_config(max_prefill_tokens=4096), connector)
    real_put_chain, unblock = connector._client.put_chain, threading.Event()

    def slow_put_chain(*args, **kwargs):  # type: ignore[no-untyped-def]
        unblock.wait(timeout=30)
        return real_put_chain(*args, **kwargs)

    connector._client.put_chain = slow_put_chain  # type: ignore[method-assign]
    engine.add_request(prompt, GREEDY)
    assert engine.step()  # the prefill offers 8 blocks: 2 staged, 6 dropped
    unblock.set()
    assert connector.drain(timeout_s=30.0)  # buffers are free again before block 9
    outputs = [o for _ in range(GREEDY.max_tokens) for o in engine.step() if o.finished]
    assert connector.drain(timeout_s=30.0)
    stats = connector.stats().publish
    assert (stats.num_published_blocks, stats.num_dropped_blocks) == (2, 7)
    _assert_same(outputs[0], _reference(prompt))
    connector.close()
    with Client(store.address) as client:
        assert client.stats().num_blocks == 2  # no orphan of block 9


def test_every_branch_from_a_cut_chain_is_dropped(store):
    connector = _connector(store.address, publish_buffers=1)
    Engine(_engine_config(), connector)  # binds the connector: namespace, staging shape
    real_put_chain, unblock = connector._client.put_chain, threading.Event()

    def slow_put_chain(*args, **kwargs):  # type: ignore[no-untyped-def]
        unblock.wait(timeout=30)
        return real_put_chain(*args, **kwargs)

    connector._client.put_chain = slow_put_chain  # type: ignore[method-assign]
    publisher = connector._publisher
    assert publisher is not None
    chain = block_keys(connector.namespace, _prompt(13, 4 * BLOCK))

    def fill(i: int, out: torch.Tensor) -> None:
        out.fill_(i)

    assert publisher.offer(chain[:2], fill, None) == 1  # one buffer: block 1 is dropped
    unblock.set()
    assert connector.drain(timeout_s=30.0)
    assert publisher.offer(chain[2:3], fill, chain[1]) == 0  # continues the dropped block
    assert publisher.offer(chain[3:4], fill, chain[1]) == 0  # another branch from it
    stats = publisher.stats()
    assert (stats.num_published_blocks, stats.num_dropped_blocks) == (1, 3)
    connector.close()


def test_a_chain_whose_put_failed_is_not_continued(store):
    prompt = _prompt(12)
    connector = _connector(store.address)
    engine = Engine(_engine_config(max_prefill_tokens=4096), connector)
    real_put_chain, calls = connector._client.put_chain, []

    def failing_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        if len(calls) == 1:
            raise UnavailableError("the store went away for a moment")
        return real_put_chain(*args, **kwargs)

    connector._client.put_chain = failing_once  # type: ignore[method-assign]
    engine.add_request(prompt, GREEDY)
    assert engine.step()
    assert connector.drain(timeout_s=30.0)  # the prefill's 8 blocks failed
    while engine.has_unfinished:
        engine.step()
    assert connector.drain(timeout_s=30.0)
    stats = connector.stats().publish
    assert (stats.num_failed_blocks, stats.num_dropped_blocks) == (8, 1)
    assert len(calls) == 1
    connector.close()


def test_pages_smaller_than_blocks_load_through_staging(store):
    prompt = _prompt(10)
    _publish(store.address, [prompt], page_tokens=4)
    connector = _connector(store.address)
    engine = Engine(_engine_config(page_tokens=4), connector)
    out = engine.generate([prompt], GREEDY)[0]
    assert out.usage.store_cached_tokens == 8 * BLOCK
    _assert_same(out, _reference(prompt))
    connector.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pages_publish_and_load_through_the_store(store):
    """The same path into device pages: publish from CUDA pages, load into fresh ones."""
    prompt = _prompt(11)
    ref = _reference(prompt)
    _publish(store.address, [prompt], device="cuda")
    connector = _connector(store.address)
    engine = Engine(_engine_config(device="cuda"), connector)
    out = engine.generate([prompt], GREEDY)[0]
    assert out.usage.store_cached_tokens == 8 * BLOCK
    assert out.output_token_ids == ref.output_token_ids
    assert out.logits is not None and ref.logits is not None
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-3, rtol=0)
    connector.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pages_smaller_than_blocks_load_through_device_staging(store):
    prompt = _prompt(12)
    _publish(store.address, [prompt], device="cuda", page_tokens=4)
    connector = _connector(store.address)
    engine = Engine(_engine_config(device="cuda", page_tokens=4), connector)
    out = engine.generate([prompt], GREEDY)[0]
    assert out.usage.store_cached_tokens == 8 * BLOCK
    assert out.output_token_ids == _reference(prompt).output_token_ids
    connector.close()
