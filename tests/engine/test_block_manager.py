"""The block manager: admission reuses cached full prompt blocks (never the last token's),
holds nothing when the pool is short, grows requests a page at a time and caches what they
computed; the pool's state table holds after every call."""

from __future__ import annotations

import pytest
import torch

from gpu_engine.block_manager import BlockManager, Uncached
from gpu_engine.config import EngineConfig
from gpu_engine.page_pool import PagePool
from gpu_engine.request import Request
from gpu_engine.sampling import SamplingParams
from kvstore.keys import ChainPosition, block_keys

BLOCK, PAGE = 8, 4
NAMESPACE = EngineConfig(block_tokens=BLOCK, page_tokens=PAGE).namespace


def _make(num_pages: int = 16, enable_prefix_cache: bool = True) -> BlockManager:
    pool = PagePool(num_pages, BLOCK // PAGE)
    return BlockManager(pool, NAMESPACE, BLOCK, PAGE, enable_prefix_cache)


def _request(tokens: list[int], request_id: int = 0) -> Request:
    return Request(request_id, list(tokens), len(tokens), SamplingParams(), torch.Generator(), 0.0)


def _computed(manager: BlockManager, req: Request, num_tokens: int) -> None:
    """`req` computed its first `num_tokens` tokens: its full blocks are cached."""
    manager.computed_blocks(req, req.num_computed // BLOCK, num_tokens // BLOCK)
    req.num_computed = num_tokens


def test_admission_allocates_every_token_and_offers_the_uncached_blocks() -> None:
    manager = _make()
    tokens = list(range(3 * BLOCK + 1))
    req = _request(tokens)
    uncached = manager.allocate(req)
    keys = block_keys(NAMESPACE, tokens[: 3 * BLOCK])
    assert uncached == Uncached(0, None, keys)
    assert len(req.pages) == 7 and req.num_computed == 0
    assert manager.pool.num_available == 16 - 7
    manager.pool.check()


def test_the_blocks_offered_after_a_cached_prefix_say_where_they_sit_in_their_chain() -> None:
    manager = _make()
    head = list(range(2 * BLOCK))
    first = _request([*head, 7])
    manager.allocate(first)
    _computed(manager, first, len(head) + 1)
    tokens = head + list(range(500, 500 + 2 * BLOCK + 1))
    uncached = manager.allocate(_request(tokens, request_id=1))
    keys = block_keys(NAMESPACE, tokens[: 4 * BLOCK])
    assert uncached == Uncached(2, keys[1], keys[2:], ChainPosition(2, keys[0]))


def test_a_cached_prefix_is_reused_but_never_the_block_of_the_last_token() -> None:
    manager = _make()
    tokens = list(range(4 * BLOCK))  # whole blocks: the 4th is computed again
    first = _request(tokens)
    manager.allocate(first)
    _computed(manager, first, len(tokens))
    second = _request(tokens, request_id=1)
    uncached = manager.allocate(second)
    keys = block_keys(NAMESPACE, tokens)
    assert uncached == Uncached(3, keys[2], [])
    assert second.num_computed == 3 * BLOCK
    assert second.pages[: 3 * 2] == first.pages[: 3 * 2]  # shared, not copied
    assert all(manager.pool.refcount(p) == 2 for p in first.pages[:6])
    manager.free(first)
    manager.free(second)
    manager.pool.check()
    assert manager.pool.num_available == 16 and manager.pool.num_cached_blocks == 4


def test_a_request_the_pool_cannot_hold_now_holds_nothing() -> None:
    manager = _make(num_pages=8)
    tokens = list(range(2 * BLOCK + 1))
    holder = _request(tokens)
    manager.allocate(holder)
    _computed(manager, holder, 2 * BLOCK)
    again = _request(tokens + list(range(2 * BLOCK)), request_id=1)  # 4 cached pages + 5
    assert manager.allocate(again) is None
    assert again.pages == [] and again.num_computed == 0
    assert [manager.pool.refcount(p) for p in holder.pages[:4]] == [1, 1, 1, 1]
    manager.pool.check()


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_grow_adds_pages_only_when_they_fit(enable_prefix_cache: bool) -> None:
    manager = _make(num_pages=4, enable_prefix_cache=enable_prefix_cache)
    req = _request(list(range(PAGE)))
    assert manager.allocate(req) == Uncached(0, None, [])
    assert manager.grow(req, 3 * PAGE) and len(req.pages) == 3
    assert manager.grow(req, 3 * PAGE) and len(req.pages) == 3  # already held
    assert not manager.grow(req, 5 * PAGE) and len(req.pages) == 3
    manager.free(req)
    assert req.pages == [] and manager.pool.num_available == 4
    manager.pool.check()


def test_computed_blocks_are_cached_with_their_parent_only_when_enabled() -> None:
    tokens = list(range(3 * BLOCK))
    keys = block_keys(NAMESPACE, tokens)
    for enabled, num_cached in ((True, 2), (False, 0)):
        manager = _make(enable_prefix_cache=enabled)
        req = _request(tokens)
        manager.allocate(req)
        parent, position, got_keys, blocks = manager.computed_blocks(req, 1, 3)
        assert (parent, position, got_keys) == (keys[0], ChainPosition(1, keys[0]), keys[1:3])
        assert blocks == [tuple(req.pages[2:4]), tuple(req.pages[4:6])]
        assert manager.pool.num_cached_blocks == num_cached
        manager.free(req)
        manager.pool.check()
