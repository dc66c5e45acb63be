"""Paged KV cache: the page tensor (`KVCache`) and its accounting (`PagePool`).

Layout: one tensor ``(num_pages, num_layers, 2, page_tokens, num_kv_heads, head_dim)``,
page-major. One page therefore holds, contiguously, K and V of every layer for its
`page_tokens` tokens: exactly the store's block layout ``(layer, k/v, token, kv_head,
head_dim)`` when ``page_tokens == block_tokens``, so a block is a zero-copy view of one
page, and with smaller pages it is one strided copy. Attention gathers one layer's pages per
sequence (`gather`), which copies anyway, so page-major costs the forward pass nothing.

A store block is ``pages_per_block = block_tokens // page_tokens`` consecutive pages of a
sequence; the prefix cache maps a block key to that tuple of pages.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from kvstore.errors import KVStoreError, PayloadSizeError
from kvstore.keys import KVLayout

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class OutOfPagesError(KVStoreError):
    """The pool has no free or evictable page left."""

    code = "RESOURCE_EXHAUSTED"


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
            PayloadSizeError: `data` is not one block of the cache's dtype; nothing written.
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
                raise PayloadSizeError(
                    f"block is {data.dtype} x {data.numel()}, expected {self.pages.dtype} x {numel}"
                )
            return data.contiguous()
        nbytes, expected = memoryview(data).nbytes, numel * self.pages.element_size()
        if nbytes != expected:
            raise PayloadSizeError(f"block is {nbytes} bytes, expected {expected}")
        with warnings.catch_warnings():  # read-only buffers: we only read from them
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=self.pages.dtype)


class PagePool:
    """Refcounted pages, a free list and a prefix cache of full blocks with LRU eviction.

    Every page is in exactly one state:

    ==========  ==========  ======  =====================================
    state       refcount    cached  where
    ==========  ==========  ======  =====================================
    free        0           no      `_free`
    evictable   0           yes     its block's key in `_evictable` (LRU)
    in use      > 0         either  held by sequences
    ==========  ==========  ======  =====================================

    All pages of a cached block share one refcount history (a sequence holds a block's pages
    together), so a block becomes evictable when its last page drops to zero.
    """

    def __init__(self, num_pages: int, pages_per_block: int) -> None:
        self.num_pages = num_pages
        self.pages_per_block = pages_per_block
        self._refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._cached: dict[bytes, tuple[int, ...]] = {}
        self._page_key: dict[int, bytes] = {}
        self._evictable: OrderedDict[bytes, None] = OrderedDict()

    @property
    def num_available(self) -> int:
        """Pages `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable) * self.pages_per_block

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, num: int) -> list[int]:
        """`num` pages with refcount 1, evicting least recently used cached blocks as needed.

        Raises:
            OutOfPagesError: fewer than `num` pages are free or evictable; nothing changed.
        """
        if num > self.num_available:
            raise OutOfPagesError(f"need {num} pages, {self.num_available} available")
        while len(self._free) < num:
            self._evict_one()
        pages = [self._free.popleft() for _ in range(num)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference to each page, in order; release a sequence tail-first, so its
        tail blocks are evicted first (a parent evicted before its child strands the child)."""
        for page in pages:
            assert self._refcount[page] > 0, f"page {page} released more often than held"
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._on_unreferenced(page)

    def match(self, keys: Sequence[bytes]) -> list[tuple[int, ...]]:
        """Pages of the longest cached prefix of `keys`, one tuple per block, each referenced."""
        hits = []
        for key in keys:
            pages = self._cached.get(key)
            if pages is None:
                break
            self._evictable.pop(key, None)
            for page in pages:
                self._refcount[page] += 1
            hits.append(pages)
        return hits

    def insert(self, key: bytes, pages: Sequence[int]) -> bool:
        """Caches held `pages` as the full block `key`; False if the key is already cached."""
        assert len(pages) == self.pages_per_block, f"a block is {self.pages_per_block} pages"
        if key in self._cached:
            return False
        for page in pages:
            assert self._refcount[page] > 0, f"page {page} is not held"
            assert page not in self._page_key, f"page {page} already caches a block"
            self._page_key[page] = key
        self._cached[key] = tuple(pages)
        return True

    def check(self) -> None:
        """Asserts the state table above holds for every page (for tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        for page, count in enumerate(self._refcount):
            key = self._page_key.get(page)
            assert count >= 0
            assert (page in free) == (count == 0 and key is None), f"page {page} misfiled"
            assert count > 0 or key is None or key in self._evictable, f"page {page} lost"
        for key in self._evictable:
            assert all(self._refcount[p] == 0 for p in self._cached[key]), "held block evictable"

    def _on_unreferenced(self, page: int) -> None:
        key = self._page_key.get(page)
        if key is None:
            self._free.append(page)
        elif all(self._refcount[p] == 0 for p in self._cached[key]):
            self._evictable[key] = None  # most recently used end

    def _evict_one(self) -> None:
        key, _ = self._evictable.popitem(last=False)
        for page in self._cached.pop(key):
            del self._page_key[page]
            self._free.append(page)
