"""Paged KV cache: block copies in and out of pages, by slot and by block."""

from __future__ import annotations

import pytest
import torch

from gpu_engine.config import EngineConfig
from gpu_engine.errors import BlockSizeError
from gpu_engine.kv_cache import KVCache

LAYERS, HEADS, DIM, BLOCK = 2, 2, 4, 8


def _make_cache(page_tokens: int, num_pages: int = 8) -> KVCache:
    return KVCache(num_pages, LAYERS, page_tokens, HEADS, DIM, BLOCK)


def _block(seed: int) -> torch.Tensor:
    return torch.randn(
        (LAYERS, 2, BLOCK, HEADS, DIM), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("page_tokens", [2, 4, 8])
def test_write_block_then_gather_reads_the_block_layout(page_tokens: int) -> None:
    cache = _make_cache(page_tokens)
    block = _block(0)
    pages = list(range(7, 7 - cache.pages_per_block, -1))  # any pages, any order
    cache.write_block(pages, block)
    for layer in range(LAYERS):
        k, v = cache.gather(layer, torch.tensor(pages), BLOCK)
        assert torch.equal(k, block[layer, 0]) and torch.equal(v, block[layer, 1])
    assert torch.equal(cache.read_block(pages), block)


@pytest.mark.parametrize("page_tokens", [4, 8])
def test_write_block_from_bytes_round_trips(page_tokens: int) -> None:
    cache = _make_cache(page_tokens)
    block = _block(1)
    pages = list(range(cache.pages_per_block))
    cache.write_block(pages, block.numpy().tobytes())
    out = torch.empty(cache.block_shape)
    assert cache.read_block(pages, out=out) is out
    assert torch.equal(out, block)
    assert out.numel() * out.element_size() == cache.layout.block_bytes


def test_whole_page_blocks_are_zero_copy_views() -> None:
    cache = _make_cache(BLOCK)
    view = cache.block_view(3)
    view.copy_(_block(2))  # receiving into the view fills the page
    assert cache.read_block([3]).data_ptr() == view.data_ptr()
    k, _ = cache.gather(1, torch.tensor([3]), 5)
    assert torch.equal(k, _block(2)[1, 0, :5])


def test_write_then_gather_by_slot() -> None:
    cache = _make_cache(4)
    k = torch.randn(6, HEADS, DIM)
    v = torch.randn(6, HEADS, DIM)
    pages, offsets = torch.tensor([5, 5, 5, 5, 2, 2]), torch.tensor([0, 1, 2, 3, 0, 1])
    cache.write(1, pages, offsets, k, v)
    got_k, got_v = cache.gather(1, torch.tensor([5, 2]), 6)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_layout_is_the_engine_namespace_layout() -> None:
    config = EngineConfig(block_tokens=16, page_tokens=4)
    m = config.model_config
    cache = KVCache(4, m.num_layers, 4, m.num_kv_heads, m.head_dim, 16)
    assert cache.layout == config.kv_layout == config.namespace.layout


def test_write_block_refuses_a_wrong_size_and_writes_nothing() -> None:
    cache = _make_cache(4)
    with pytest.raises(BlockSizeError):
        cache.write_block([0, 1], b"\0" * 12)
    with pytest.raises(BlockSizeError):
        cache.write_block([0, 1], _block(0).double())
    assert not cache.pages.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_blocks_round_trip_as_bytes(dtype: torch.dtype) -> None:
    cache = KVCache(4, LAYERS, 4, HEADS, DIM, BLOCK, dtype=dtype)
    block = _block(3).to(dtype)
    raw = block.view(torch.uint8).numpy().tobytes()
    cache.write_block([2, 0], raw)
    assert torch.equal(cache.read_block([2, 0]), block)
    assert len(raw) == cache.layout.block_bytes and cache.layout.dtype == str(dtype)[6:]
