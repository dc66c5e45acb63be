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


def _flat_view(layer: torch.Tensor) -> torch.Tensor | None:
    """`layer` as (num_blocks, layer_elems) without a copy; None where its blocks are not
    contiguous (the flash layout's K and V planes)."""
    try:
        return layer.view(layer.shape[0], -1)
    except RuntimeError:
        return None


class PagedBlocks:
    """Gathers and scatters whole blocks of all layers of vLLM's KV cache."""

    def __init__(self, caches: Sequence[torch.Tensor], num_blocks: int) -> None:
        self.layers = [_block_major(c, num_blocks) for c in caches]
        first = self.layers[0]
        self.dtype = first.dtype
        self.layer_elems = first[0].numel()  # elements of one block of one layer
        assert all(t[0].numel() == self.layer_elems for t in self.layers), "uneven layers"
        self._flat = [_flat_view(t) for t in self.layers]

    def layer_rows(self) -> list[np.ndarray] | None:
        """Per layer, a uint8 view (num_blocks, layer bytes) of the paged cache whose row b
        is that layer's part of block b, where every layer keeps it contiguous in host
        memory (the CPU layout); None where not (device memory, the flash layout)."""
        if self.layers[0].device.type != "cpu" or any(f is None for f in self._flat):
            return None
        return [f.view(torch.uint8).numpy() for f in self._flat if f is not None]

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
        return list(PagedBlocks.as_rows(staging))

    @staticmethod
    def as_rows(staging: torch.Tensor) -> np.ndarray:
        """One writable uint8 numpy array of a row per staging block: a call checks it once
        (`buffers.checked_buffers`), a list of rows row by row."""
        return staging.view(torch.uint8).reshape(staging.shape[0], -1).numpy()

    @staticmethod
    def as_buffer(block: torch.Tensor) -> np.ndarray:
        """A writable uint8 numpy view of one host staging block (layers, layer_elems)."""
        return block.view(torch.uint8).reshape(-1).numpy()

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copies blocks out of the paged cache into a new staging tensor."""
        out = self.empty(len(block_ids))
        self.gather_into(block_ids, out)
        return out

    def gather_into(self, block_ids: Sequence[int], outs: torch.Tensor) -> None:
        """Copies blocks `block_ids` of the paged cache into host staging `outs`
        (n, layers, layer_elems), e.g. a slice of a publisher's pool; done on return."""
        assert outs.shape[0] == len(block_ids), f"{len(block_ids)} blocks into {len(outs)}"
        device = self.layers[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        if outs.device == device:
            self._gather(index, outs)
            return
        # Device pages: gather on the device, then one transfer for the whole batch.
        staged = torch.empty(outs.shape, dtype=outs.dtype, device=device)
        self._gather(index, staged)
        outs.copy_(staged)

    def _gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        for i, (layer, flat) in enumerate(zip(self.layers, self._flat, strict=True)):
            if flat is not None:  # straight into the strided destination, no temporary
                torch.index_select(flat, 0, index, out=out[:, i])
            else:
                out[:, i].copy_(layer.index_select(0, index).reshape(len(index), -1))

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
