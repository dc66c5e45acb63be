"""The page pool: refcounted KV pages, a free list and a prefix cache of full blocks.

A store block is ``pages_per_block`` consecutive pages of a sequence; the prefix cache maps a
block key to that tuple of pages. Knows nothing of requests (`gpu_engine.block_manager` does)
nor of the page tensor (`gpu_engine.kv_cache`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from gpu_engine.errors import OutOfPagesError


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
