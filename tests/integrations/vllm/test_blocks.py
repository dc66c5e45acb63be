"""Copies between vLLM's paged KV tensors and store blocks, for both of vLLM's layouts.

Runs without vLLM (torch only): the layouts are plain tensors here, on the CPU. The GPU
layout is the flash-attention one, exercised with CPU tensors of the same shape.
"""

from __future__ import annotations

import pytest

from tests.conftest import require_extra

torch = require_extra("torch")

from kvstore.integrations.vllm.blocks import PagedBlocks  # noqa: E402

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


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_gather_into_fills_each_buffer_with_its_block_of_every_layer(layout):
    src = _caches(layout, "random")
    paged = PagedBlocks(src, NUM_BLOCKS)
    block_ids = [6, 2, 4]
    # A slice of a larger pool, as a publisher's staging hands it out.
    pool = torch.full((5, LAYERS, paged.layer_elems), -1.0, dtype=torch.bfloat16)
    outs = pool[1:4]
    paged.gather_into(block_ids, outs)
    for out, block_id in zip(outs, block_ids, strict=True):
        for i, cache in enumerate(src):
            assert torch.equal(out[i], _block(cache, layout, block_id).reshape(-1))
    assert (pool[0] == -1).all() and (pool[4] == -1).all()  # nothing outside the slice
    assert torch.equal(outs, paged.gather(block_ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_into_from_device_pages_equals_the_host_copy():
    host = _caches("gpu", "random")
    device = PagedBlocks([c.cuda() for c in host], NUM_BLOCKS)
    outs = device.empty(2)  # pinned
    device.gather_into([5, 1], outs)
    assert torch.equal(outs, PagedBlocks(host, NUM_BLOCKS).gather([5, 1]))
