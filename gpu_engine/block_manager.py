"""A request's pages and block keys over the `PagePool` (nano-vllm's block manager, in small).

Admission reuses the longest prefix of a request's full prompt blocks that the prefix cache
holds and allocates pages for all its other tokens; decode grows it a page at a time; a
request computed (or loaded) past a block boundary caches that block. At most
``(prompt_len - 1) // block_tokens`` blocks are reused, so the last prompt token is always
computed and yields the first token's logits.
"""

from __future__ import annotations

from typing import NamedTuple

from gpu_engine.connector_base import BlockPages
from gpu_engine.page_pool import PagePool
from gpu_engine.request import Request
from kvstore.keys import ChainPosition, Namespace, block_keys


class Uncached(NamedTuple):
    """The full prompt blocks of an admitted request that the prefix cache did not hold:
    blocks ``first_block, first_block + 1, ...``, the store's to offer."""

    first_block: int
    parent_key: bytes | None  # key of block first_block - 1; None: a root
    keys: list[bytes]
    position: ChainPosition | None = None  # where keys[0] sits in its chain; None: a root


class BlockManager:
    """Gives requests pages from `pool` and caches their full blocks in it.

    Args:
        pool: the pages; the block manager is its only client.
        namespace: block keys are the store's keys in this namespace.
        block_tokens, page_tokens: tokens per block and per page.
        enable_prefix_cache: whether full blocks are cached and reused at all.
    """

    def __init__(
        self,
        pool: PagePool,
        namespace: Namespace,
        block_tokens: int,
        page_tokens: int,
        enable_prefix_cache: bool,
    ) -> None:
        self.pool = pool
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.pages_per_block = block_tokens // page_tokens
        self.enable_prefix_cache = enable_prefix_cache

    def allocate(self, req: Request) -> Uncached | None:
        """Pages for all tokens of `req`, reusing cached blocks (`req.num_computed` counts
        them); None, and nothing held, when the pool cannot hold it now."""
        keys = self._keys(req, (len(req.token_ids) - 1) // self.block_tokens)
        hits = self.pool.match(keys) if self.enable_prefix_cache else []
        reused = [page for block in hits for page in block]
        need = self.num_pages(len(req.token_ids)) - len(reused)
        if need > self.pool.num_available:
            self.pool.release(reused[::-1])
            return None
        req.pages = reused + self.pool.allocate(need)
        req.num_computed = len(hits) * self.block_tokens
        parent = keys[len(hits) - 1] if hits else None
        position = ChainPosition.of(keys, len(hits)) if len(hits) < len(keys) else None
        return Uncached(len(hits), parent, keys[len(hits) :], position)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Pages for the first `num_tokens` tokens of `req`; False, nothing changed, when the
        pool cannot hold them now."""
        need = self.num_pages(num_tokens) - len(req.pages)
        if need > self.pool.num_available:
            return False
        if need > 0:
            req.pages += self.pool.allocate(need)
        return True

    def free(self, req: Request) -> None:
        """Releases every page of `req`; its cached blocks stay cached until evicted."""
        self.pool.release(req.pages[::-1])  # tail first: evicted before its parents
        req.pages = []
        req.num_computed = 0

    def computed_blocks(
        self, req: Request, first: int, last: int
    ) -> tuple[bytes | None, ChainPosition | None, list[bytes], list[BlockPages]]:
        """(parent key, place in the chain, keys, pages) of blocks ``first...last - 1`` of
        `req`, just computed; caches them."""
        all_keys = self._keys(req, last)
        keys, blocks = all_keys[first:last], self.blocks(req, first, last)
        self.cache(keys, blocks)
        parent = all_keys[first - 1] if first else None
        return parent, ChainPosition.of(all_keys, first), keys, blocks

    def prompt_blocks(self, req: Request) -> tuple[list[bytes], list[BlockPages]]:
        """(keys, pages) of every full prompt block of `req`, from the first; all computed
        or loaded once its first token is sampled."""
        num_blocks = req.num_prompt_tokens // self.block_tokens
        return self._keys(req, num_blocks), self.blocks(req, 0, num_blocks)

    def cache(self, keys: list[bytes], blocks: list[BlockPages]) -> None:
        """Caches held full blocks (block i is `keys[i]` in `blocks[i]`) for reuse."""
        if self.enable_prefix_cache:
            for key, pages in zip(keys, blocks, strict=True):
                self.pool.insert(key, pages)

    def blocks(self, req: Request, first: int, last: int) -> list[BlockPages]:
        """The pages of blocks ``first...last - 1`` of `req`, a tuple per block."""
        ppb, pages = self.pages_per_block, req.pages
        return [tuple(pages[i * ppb : (i + 1) * ppb]) for i in range(first, last)]

    def num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def _keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """The first `num_blocks` chained block keys of `req`, extending its memo."""
        have = len(req.keys)
        if num_blocks > have:
            bt = self.block_tokens
            parent = req.keys[-1] if req.keys else None
            tokens = req.token_ids[have * bt : num_blocks * bt]
            req.keys += block_keys(self.namespace, tokens, parent=parent)
        return req.keys[:num_blocks]
