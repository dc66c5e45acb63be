"""Paged KV cache: the page tensor and the copies in and out of it (`KVCache`).

Layout: one tensor ``(num_pages, num_layers, 2, page_tokens, num_kv_heads, head_dim)``,
page-major. One page therefore holds, contiguously, K and V of every layer for its
`page_tokens` tokens: exactly the store's block layout ``(layer, k/v, token, kv_head,
head_dim)`` when ``page_tokens == block_tokens``, so a block is a zero-copy view of one
page, and with smaller pages it is one strided copy. Attention gathers one layer's pages per
sequence (`gather`), which copies anyway, so page-major costs the forward pass nothing.

A store block is ``pages_per_block = block_tokens // page_tokens`` consecutive pages of a
sequence; which pages are free, held or cached is `gpu_engine.page_pool.PagePool`'s business.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from gpu_engine.errors import BlockSizeError
from kvstore.keys import KVLayout

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class KVCache:
    """The page tensor and the copies in and out of it. Knows nothing of sequences."""

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        page_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        block_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        assert block_tokens % page_tokens == 0, "page_tokens must divide block_tokens"
        self.page_tokens = page_tokens
        self.block_tokens = block_tokens
        self.pages_per_block = block_tokens // page_tokens
        # (P, L, 2, T, H, D)
        shape = (num_pages, num_layers, 2, page_tokens, num_kv_heads, head_dim)
        self.pages = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def layout(self) -> KVLayout:
        _, layers, _, _, heads, dim = self.pages.shape
        return KVLayout(_DTYPE_NAMES[self.pages.dtype], layers, heads, dim, self.block_tokens)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """(L, 2, B, H, D): the store's contiguous block layout."""
        _, layers, _, _, heads, dim = self.pages.shape
        return (layers, 2, self.block_tokens, heads, dim)

    def write(self, layer: int, slot_pages: torch.Tensor, slot_offsets: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:  # fmt: skip
        """Stores new tokens' K and V (each (N, H, D)) at (page, offset) slots of `layer`."""
        self.pages[:, layer, 0][slot_pages, slot_offsets] = k
        self.pages[:, layer, 1][slot_pages, slot_offsets] = v

    def gather(
        self, layer: int, page_table: torch.Tensor, context_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence's first `context_len` tokens, each (context_len, H, D)."""
        heads, dim = self.pages.shape[-2:]
        k = self.pages[:, layer, 0].index_select(0, page_table)  # (n, T, H, D)
        v = self.pages[:, layer, 1].index_select(0, page_table)
        return (k.view(-1, heads, dim)[:context_len], v.view(-1, heads, dim)[:context_len])

    def gather_batch(
        self, layer: int, page_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole pages of B sequences, (B, P) tables -> each (B, P * T, H, D)."""
        heads, dim = self.pages.shape[-2:]
        flat = page_tables.flatten()  # (B * P,)
        k = self.pages[:, layer, 0].index_select(0, flat)  # (B * P, T, H, D)
        v = self.pages[:, layer, 1].index_select(0, flat)
        batch = page_tables.shape[0]
        return k.view(batch, -1, heads, dim), v.view(batch, -1, heads, dim)

    def block_view(self, page: int) -> torch.Tensor:
        """Zero-copy (L, 2, B, H, D) view of the block in `page`; needs page_tokens == block_tokens.

        Receive a block straight into it, or send from it; valid while the page is held.
        """
        assert self.pages_per_block == 1, "block_view needs page_tokens == block_tokens"
        return self.pages[page]

    def read_block(self, pages: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """One block as a contiguous (L, 2, B, H, D) tensor.

        Without `out` and with one page per block this is a view (zero copies): copy it before
        the page is released. Otherwise one copy into `out` (e.g. a pinned staging buffer).
        Raw bytes of any dtype: ``read_block(...).view(torch.uint8)`` (on CPU, ``.numpy()``).
        """
        assert len(pages) == self.pages_per_block, f"a block is {self.pages_per_block} pages"
        if out is None and self.pages_per_block == 1:
            return self.pages[pages[0]]
        if out is None:
            out = torch.empty(self.block_shape, dtype=self.pages.dtype, device=self.pages.device)
        split = out.view(self._split_block_shape)  # (L, 2, pages_per_block, T, H, D)
        for j, page in enumerate(pages):
            split[:, :, j].copy_(self.pages[page])
        return out

    def write_block(self, pages: Sequence[int], data: torch.Tensor | bytes | memoryview) -> None:
        """Copies one block, (L, 2, B, H, D) tensor or its raw bytes, into `pages` (one copy).

        Raises:
            BlockSizeError: `data` is not one block of the cache's dtype; nothing written.
        """
        assert len(pages) == self.pages_per_block, f"a block is {self.pages_per_block} pages"
        block = self._as_block(data).view(self._split_block_shape)
        for j, page in enumerate(pages):
            self.pages[page].copy_(block[:, :, j])

    @property
    def _split_block_shape(self) -> tuple[int, ...]:
        layers, _, _, heads, dim = self.block_shape
        return (layers, 2, self.pages_per_block, self.page_tokens, heads, dim)

    def _as_block(self, data: torch.Tensor | bytes | memoryview) -> torch.Tensor:
        numel = math.prod(self.block_shape)
        if isinstance(data, torch.Tensor):
            if data.dtype != self.pages.dtype or data.numel() != numel:
                raise BlockSizeError(
                    f"block is {data.dtype} x {data.numel()}, expected {self.pages.dtype} x {numel}"
                )
            return data.contiguous()
        nbytes, expected = memoryview(data).nbytes, numel * self.pages.element_size()
        if nbytes != expected:
            raise BlockSizeError(f"block is {nbytes} bytes, expected {expected}")
        with warnings.catch_warnings():  # read-only buffers: we only read from them
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=self.pages.dtype)
