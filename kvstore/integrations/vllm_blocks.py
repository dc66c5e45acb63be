"""Worker-side copies between vLLM's paged KV tensors and store blocks.

A store block is every layer's K and V for `block_tokens` tokens, layer after layer, each
layer's part in the order of vLLM's per-block slice. vLLM's layouts differ by backend:

    CPU         (num_blocks, kv_heads, block_size, 2 * head_dim)   K, V packed per row
    GPU (flash) (2, num_blocks, block_size, kv_heads, head_dim)    K plane, V plane

so the layout kind is part of the namespace: a CPU and a GPU engine never share bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _block_major(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A view of `cache` with the block dimension first."""
    if cache.shape[0] == num_blocks:
        return cache
    assert cache.shape[1] == num_blocks, f"no block dimension in {tuple(cache.shape)}"
    return cache.transpose(0, 1)


class PagedBlocks:
    """Gathers and scatters whole blocks of all layers of vLLM's KV cache."""

    def __init__(self, caches: Sequence[torch.Tensor], num_blocks: int) -> None:
        self.layers = [_block_major(c, num_blocks) for c in caches]
        first = self.layers[0]
        self.dtype = first.dtype
        self.layer_elems = first[0].numel()  # elements of one block of one layer
        assert all(t[0].numel() == self.layer_elems for t in self.layers), "uneven layers"

    @property
    def block_elems(self) -> int:
        return self.layer_elems * len(self.layers)

    @property
    def block_bytes(self) -> int:
        return self.block_elems * self.dtype.itemsize

    def empty(self, num_blocks: int) -> torch.Tensor:
        """A host staging tensor of `num_blocks` store blocks; (n, layers, layer_elems)."""
        pin = self.layers[0].is_cuda
        shape = (num_blocks, len(self.layers), self.layer_elems)
        return torch.empty(shape, dtype=self.dtype, pin_memory=pin)

    @staticmethod
    def as_buffers(staging: torch.Tensor) -> list[np.ndarray]:
        """One writable uint8 numpy view per staging block, what every transport accepts."""
        flat = staging.view(torch.uint8).reshape(staging.shape[0], -1)
        return list(flat.numpy())

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copies blocks out of the paged cache into a new staging tensor."""
        out = self.empty(len(block_ids))
        index = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].device)
        for i, layer in enumerate(self.layers):
            out[:, i].copy_(layer.index_select(0, index).reshape(len(block_ids), -1))
        return out

    def scatter(self, staging: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Writes staging blocks (n, layers, layer_elems) into the paged cache."""
        if not block_ids:
            return
        device = self.layers[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        src = staging.to(device, non_blocking=True)
        for i, layer in enumerate(self.layers):
            shape = (len(block_ids), *layer.shape[1:])
            layer.index_copy_(0, index, src[:, i].reshape(shape))
