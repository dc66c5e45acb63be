"""Copies between vLLM's paged KV tensors and store blocks, for both of vLLM's layouts.

Runs without vLLM (torch only): the layouts are plain tensors here, on the CPU. The GPU
layout is the flash-attention one, exercised with CPU tensors of the same shape.
"""

from __future__ import annotations

import pytest

from tests.conftest import require_extra

torch = require_extra("torch")

from kvstore.integrations.vllm_blocks import PagedBlocks  # noqa: E402

NUM_BLOCKS, LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 8, 3, 2, 4, 8

LAYOUTS = {
    # (num_blocks, kv_heads, block_size, 2 * head_dim): K and V packed per row
    "cpu": (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM),
    # (2, num_blocks, block_size, kv_heads, head_dim): a K plane and a V plane
    "gpu": (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
}


def _caches(layout: str, fill: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = LAYOUTS[layout]
    if fill == "zeros":
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def _block(cache: torch.Tensor, layout: str, block_id: int) -> torch.Tensor:
    return cache[block_id] if layout == "cpu" else cache[:, block_id]


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_blocks_round_trip_between_engines(layout):
    src, dst = _caches(layout, "random"), _caches(layout, "zeros")
    paged_src, paged_dst = PagedBlocks(src, NUM_BLOCKS), PagedBlocks(dst, NUM_BLOCKS)
    layer_bytes = KV_HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2  # bfloat16
    assert paged_src.block_bytes == LAYERS * layer_bytes

    staging = paged_src.gather([3, 1])
    buffers = PagedBlocks.as_buffers(staging)
    assert [b.nbytes for b in buffers] == [paged_src.block_bytes] * 2
    # A store block is every layer's slice of that block, layer after layer.
    first = buffers[0][:layer_bytes].view("<u2")
    assert (
        bytes(first) == _block(src[0], layout, 3).contiguous().view(torch.uint16).numpy().tobytes()
    )

    received = paged_dst.empty(2)
    for mine, theirs in zip(PagedBlocks.as_buffers(received), buffers, strict=True):
        mine[:] = theirs  # what a transfer into the staging views does
    paged_dst.scatter(received, [5, 0])
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(_block(d, layout, 5), _block(s, layout, 3))
        assert torch.equal(_block(d, layout, 0), _block(s, layout, 1))
        untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 5)]
        assert all(not _block(d, layout, b).any() for b in untouched)


def test_scatter_of_nothing_changes_nothing():
    dst = _caches("cpu", "zeros")
    PagedBlocks(dst, NUM_BLOCKS).scatter(PagedBlocks(dst, NUM_BLOCKS).empty(0), [])
    assert not any(c.any() for c in dst)
