"""The page pool's accounting: refcounts, the free list, the prefix cache and LRU eviction,
with the state table checked after every mutation."""

from __future__ import annotations

import pytest

from gpu_engine.errors import OutOfPagesError
from gpu_engine.page_pool import PagePool


def test_allocate_release_and_out_of_pages() -> None:
    pool = PagePool(4, 1)
    pages = pool.allocate(3)
    assert sorted(pages) == [0, 1, 2] and pool.num_available == 1
    with pytest.raises(OutOfPagesError):
        pool.allocate(2)
    assert pool.num_available == 1  # the failed call changed nothing
    pool.release(pages)
    pool.check()
    assert pool.num_available == 4
    assert all(pool.refcount(p) == 0 for p in range(4))


def test_shared_block_is_freed_only_by_its_last_holder() -> None:
    pool = PagePool(4, 2)
    pages = pool.allocate(2)
    assert pool.insert(b"k0", pages)
    assert not pool.insert(b"k0", pages)  # already cached
    assert pool.match([b"k0", b"k1"]) == [tuple(pages)]
    assert [pool.refcount(p) for p in pages] == [2, 2]
    pool.release(pages)
    pool.check()
    assert pool.num_available == 2  # still held once
    pool.release(pages)
    pool.check()
    assert pool.num_available == 4 and pool.num_cached_blocks == 1  # evictable, not gone
    assert pool.match([b"k0"]) == [tuple(pages)]  # a hit revives it
    pool.check()


def test_eviction_is_lru_and_a_sequence_released_tail_first_loses_its_tail_first() -> None:
    pool = PagePool(4, 1)
    seq = pool.allocate(3)
    for i, page in enumerate(seq):
        pool.insert(b"k%d" % i, [page])
    pool.release(seq[::-1])
    pool.check()
    assert pool.allocate(2)  # one free page, then evicts the least recent: k2 (the tail)
    assert pool.match([b"k0", b"k1", b"k2"]) == [(seq[0],), (seq[1],)]
    pool.check()
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)  # k0 and k1 are held again
