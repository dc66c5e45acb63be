"""The vLLM connector's loader against a real store: pipelined chunks through a fixed staging
pool into vLLM's CPU paged layout, over the data plane and over gRPC. No vLLM needed."""

from __future__ import annotations

import pytest

from tests.conftest import require_extra

torch = require_extra("torch")

from kvstore.client import Client  # noqa: E402
from kvstore.integrations.vllm_blocks import PagedBlocks  # noqa: E402
from kvstore.integrations.vllm_loader import BlockLoader  # noqa: E402
from kvstore.integrations.vllm_plan import RequestBlocks  # noqa: E402
from kvstore.keys import KVLayout, Namespace  # noqa: E402

LAYERS, KV_HEADS, BLOCK, HEAD_DIM, NUM_PAGES = 3, 2, 4, 8, 16
NS = Namespace("vllm/cpu/loader-test", KVLayout("float32", LAYERS, KV_HEADS, HEAD_DIM, BLOCK))
WARM_UP = Namespace("kvstore/warm-up", NS.layout)
SHAPE = (NUM_PAGES, KV_HEADS, BLOCK, 2 * HEAD_DIM)  # vLLM's CPU layout, one per layer


def _pages(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(SHAPE) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(LAYERS)]


def _publish(client: Client, src: PagedBlocks, blocks: RequestBlocks, pages: list[int]) -> None:
    staging = src.gather(pages)
    client.put_chain(NS.id, blocks.keys[: len(pages)], PagedBlocks.as_buffers(staging))


def _request(num_blocks: int, dst_pages: list[int]) -> RequestBlocks:
    blocks = RequestBlocks.from_prompt("r", NS, list(range(num_blocks * BLOCK + 1)))
    blocks.block_ids = dst_pages
    return blocks


def _same_block(a: list[torch.Tensor], page_a: int, b: list[torch.Tensor], page_b: int) -> bool:
    return all(torch.equal(x[page_a], y[page_b]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("transport", ["ucx", "grpc"])
@pytest.mark.parametrize("num_buffers", [2, 4, 16])
def test_a_load_in_chunks_fills_every_vllm_block_it_names(store, transport, num_buffers):
    src_tensors, dst_tensors = _pages(0), _pages(None)
    src, dst = PagedBlocks(src_tensors, NUM_PAGES), PagedBlocks(dst_tensors, NUM_PAGES)
    src_pages, dst_pages = [3, 1, 7, 0, 9, 12, 5], [15, 2, 4, 8, 6, 11, 13]
    blocks = _request(len(src_pages), dst_pages)
    with Client(store.address, transport=transport) as client:
        client.register_namespace(NS)
        client.register_namespace(WARM_UP)
        _publish(client, src, blocks, src_pages)
        num_blocks = client.stats().num_blocks
        loader = BlockLoader(client, dst, num_buffers)
        warm = loader.warm_up(WARM_UP.id)
        phases = {"connect", "stage"} | ({"transfer"} if transport == "ucx" else set())
        assert set(warm.seconds) == phases
        assert warm.num_bytes == num_buffers * dst.block_bytes
        assert client.stats().num_blocks == num_blocks  # the warm-up block is gone
        result = loader.load(blocks.transfer(0, len(src_pages)))
        assert (result.num_loaded, result.error) == (len(src_pages), None)
        assert result.phases.num_bytes == len(src_pages) * dst.block_bytes
        assert {"connect", "submit", "transfer", "scatter"} <= set(result.phases.seconds)
        second = loader.load(blocks.transfer(2, 5))  # the pool is reused
        assert second.num_loaded == 3
    for s, d in zip(src_pages, dst_pages, strict=True):
        assert _same_block(src_tensors, s, dst_tensors, d)
    untouched = set(range(NUM_PAGES)) - set(dst_pages)
    assert all(not t[p].any() for t in dst_tensors for p in untouched)


@pytest.mark.parametrize("num_buffers", [2, 8])
def test_a_load_stops_at_the_first_missing_block_and_fills_only_the_prefix(store, num_buffers):
    src_tensors, dst_tensors = _pages(1), _pages(None)
    src, dst = PagedBlocks(src_tensors, NUM_PAGES), PagedBlocks(dst_tensors, NUM_PAGES)
    blocks = _request(6, [10, 11, 12, 13, 14, 15])
    with Client(store.address) as client:
        client.register_namespace(NS)
        _publish(client, src, blocks, [0, 1, 2, 3, 4, 5])
        client.remove(NS.id, [blocks.keys[3]])  # evicted between match and load
        loader = BlockLoader(client, dst, num_buffers)
        result = loader.load(blocks.transfer(0, 6))
        assert (result.num_loaded, result.error) == (3, None)
        assert result.phases.num_blocks == 3
        again = loader.load(blocks.transfer(0, 3))  # nothing of the cut load is in flight
        assert again.num_loaded == 3
    assert all(_same_block(src_tensors, i, dst_tensors, 10 + i) for i in range(3))
    assert all(not t[p].any() for t in dst_tensors for p in (13, 14, 15))


def test_a_store_gone_mid_session_is_an_error_with_nothing_loaded(store_factory):
    store = store_factory("--dram-bytes", "16MiB")
    dst_tensors = _pages(None)
    dst = PagedBlocks(dst_tensors, NUM_PAGES)
    blocks = _request(4, [0, 1, 2, 3])
    with Client(store.address, timeout_s=2.0) as client:
        client.register_namespace(NS)
        loader = BlockLoader(client, dst, 2)
        loader.warm_up()
        assert store.stop() == 0  # SIGTERM: gone, and its address checker with it
        result = loader.load(blocks.transfer(0, 4))
    assert result.num_loaded == 0
    assert result.error is not None
    assert not any(t.any() for t in dst_tensors)
