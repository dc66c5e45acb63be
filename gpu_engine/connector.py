"""`StoreConnector`: the engine's KV blocks to and from a kvstore node.

Load (on admission): `lookup` matches the blocks' keys in the store (one control-plane
call, in the step loop), then `load`, on the engine's loader thread, receives the hits over
UCX straight into the engine's pages (`KVCache.block_view`, no intermediate
copy when ``page_tokens == block_tokens``; otherwise through one staging block), in batches
of `load_batch_blocks`. Only a prefix of fully received blocks is ever reported loaded: a
failed batch counts for nothing, and the engine recomputes from there.

Save (after the forward pass that completed blocks): one copy of each block into a staging
buffer, then a background thread puts them (`BlockPublisher`); the step loop never waits on
the network. Under pressure the publisher drops blocks (counted): fine for a prefix cache.

Publish (a prefill engine's finished request, on the engine's publish thread): waits, at
most `publish_timeout_s`, until the request's offers are settled (`OfferTracker`), matches
its full prompt blocks in the store and puts the ones missing (dropped, failed, or cached
locally but gone from the store) straight from the request's pages, then reports how many
leading blocks the store has committed. Nothing is dropped on this path.

A store that errors or is unreachable is skipped for `retry_after_s`, so a dead store costs
the engine one failed call per interval, not one per request.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from gpu_engine.connector_base import BlockPages, ConnectorRequest, KVConnector
from gpu_engine.kv_cache import KVCache
from gpu_engine.offer_tracker import OfferTracker
from kvstore.auth import read_token_file
from kvstore.client import TRANSPORT_CHOICES, Client
from kvstore.client.pool_client import PoolClient
from kvstore.client.publishing import BlockPublisher, PublishStats
from kvstore.config import option
from kvstore.errors import InvalidArgumentError, KVStoreError
from kvstore.integrations.loaded_prefix import loaded_prefix_len
from kvstore.integrations.vllm.blocks import PagedBlocks  # host staging as uint8 numpy
from kvstore.keys import ChainPosition, Namespace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConnectorConfig:
    """Where the store is and how the engine talks to it."""

    store: str = option(
        "",
        "store node host:port (with --store-pool, any nodes of a pool: host:port,host:port); "
        "empty: no store (local prefix cache only)",
    )
    store_pool: bool = option(
        False, "the store is a global pool (kvstore serve --cluster): read from every holder"
    )
    transport: str = option("auto", f"bytes path to the store, one of {TRANSPORT_CHOICES}")
    timeout_s: float = option(5.0, "deadline of every store call")
    load_batch_blocks: int = option(64, "blocks per get; a failed batch loses only itself")
    publish_buffers: int = option(512, "staging blocks for publishing; beyond them, dropped")
    retry_after_s: float = option(2.0, "after a store error, skip the store this long")
    publish_timeout_s: float = option(
        10.0, "prefill role: the longest a finished request waits for its offered blocks"
    )
    store_token_file: str = option("", "file holding the token the store knows this engine by")
    store_tls_ca: str = option("", "PEM CA of the store's certificate: reach it over TLS")

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORT_CHOICES:
            raise InvalidArgumentError(f"transport must be one of {TRANSPORT_CHOICES}")
        if self.timeout_s <= 0 or self.retry_after_s < 0 or self.publish_timeout_s <= 0:
            raise InvalidArgumentError(
                "timeout_s and publish_timeout_s must be > 0 and retry_after_s >= 0"
            )
        if self.load_batch_blocks <= 0 or self.publish_buffers <= 0:
            raise InvalidArgumentError("load_batch_blocks and publish_buffers must be > 0")


class ConnectorStats(NamedTuple):
    num_loaded_blocks: int
    bytes_loaded: int
    num_load_errors: int
    publish: PublishStats


class StoreConnector(KVConnector):
    """A `KVConnector` over `kvstore.client.Client` (a `PoolClient` with `store_pool`); see
    the module docstring.

    Args:
        config: store address and limits.
        clock: monotonic seconds, for the retry interval.
    """

    def __init__(
        self, config: StoreConnectorConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        token = read_token_file(config.store_token_file) if config.store_token_file else ""
        settings: dict[str, Any] = {
            "transport": config.transport,
            "auth_token": token,
            "tls_ca": config.store_tls_ca,
        }
        self._client: Client | PoolClient = (
            PoolClient(config.store.split(","), read_deadline_s=config.timeout_s, **settings)
            if config.store_pool
            else Client(config.store, timeout_s=config.timeout_s, **settings)
        )
        self._namespace_id: bytes | None = None
        self._skip_until = 0.0
        self._num_loaded = 0
        self._num_load_errors = 0
        self._publisher: BlockPublisher | None = None
        self._staging: torch.Tensor | None = None
        self._offers = OfferTracker()

    def bind(self, cache: KVCache, namespace: Namespace) -> None:
        super().bind(cache, namespace)
        is_device = cache.pages.device.type != "cpu"
        if cache.pages_per_block != 1:  # blocks are strided over pages: receive, then copy
            self._staging = torch.empty(
                cache.block_shape, dtype=cache.pages.dtype, device=cache.pages.device
            )
        self._publisher = BlockPublisher(
            self._put_chain,
            cache.block_shape,
            cache.pages.dtype,
            self.config.publish_buffers,
            pin_memory=is_device and torch.cuda.is_available(),
        )
        self._ensure_registered()

    @property
    def is_connected(self) -> bool:
        """Registered with the store and not pausing after an error; calls nothing."""
        return self._namespace_id is not None and self._clock() >= self._skip_until

    def lookup(self, request: ConnectorRequest, keys: Sequence[bytes]) -> int:
        if not keys or not self._ensure_registered():
            return 0
        assert self._namespace_id is not None
        try:
            if isinstance(self._client, PoolClient):
                return self._client.match(self._namespace_id, keys, request.position).num_matched
            return self._client.match(self._namespace_id, keys).num_matched
        except KVStoreError as exc:
            self._on_error("match", request, exc)
            return 0

    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        if not keys or not self._ensure_registered():
            return 0
        start_s = self._clock()
        num_loaded = self._load_hits(request, keys, pages)
        self._num_loaded += num_loaded
        logger.info(
            "event=store_load request_id=%d blocks=%d loaded=%d elapsed_ms=%.1f",
            request.request_id,
            len(keys),
            num_loaded,
            (self._clock() - start_s) * 1000,
        )
        return num_loaded

    def save(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> None:
        if not keys or self._publisher is None or not self._ensure_registered():
            return
        put = self._offers.track(
            request.request_id, functools.partial(self._put_chain, position=request.position)
        )
        try:
            num_staged = self._publisher.offer(
                keys,
                lambda i, out: self.cache.read_block(pages[i], out=out),
                request.parent_key,
                put,
            )
        except BaseException:  # the copy failed: the publisher counts it failed, never puts
            self._offers.settle(request.request_id, failed=True)
            raise
        if num_staged == 0:  # all dropped: nothing will call `put`
            self._offers.settle(request.request_id)

    def publish(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        if not keys:
            return 0
        if not self._offers.wait(request.request_id, self.config.publish_timeout_s):
            logger.warning("event=publish_wait_timeout request_id=%d", request.request_id)
        if not self._ensure_registered():
            return 0
        num_committed = 0
        try:
            num_committed = self._num_committed(keys)
            if num_committed < len(keys):
                self._put_from_pages(keys, pages, num_committed)
                num_committed = self._num_committed(keys)
        except KVStoreError as exc:
            self._on_error("publish", request, exc)
        logger.info(
            "event=prefill_published request_id=%d blocks=%d committed=%d",
            request.request_id,
            len(keys),
            num_committed,
        )
        return num_committed

    def drain(self, timeout_s: float | None = None) -> bool:
        """Waits until every offered block was put; False on timeout."""
        return self._publisher.drain(timeout_s) if self._publisher is not None else True

    def stats(self) -> ConnectorStats:
        publish = self._publisher.stats() if self._publisher else PublishStats(0, 0, 0, 0)
        block_bytes = self.namespace.block_bytes if hasattr(self, "namespace") else 0
        return ConnectorStats(
            self._num_loaded, self._num_loaded * block_bytes, self._num_load_errors, publish
        )

    def close(self) -> None:
        """Finishes queued publishes, then closes the store connection."""
        if self._publisher is not None:
            self._publisher.close()
        try:  # the data plane's goodbye to a dead store raises; there is no one to tell
            self._client.close()
        except Exception as exc:
            logger.warning("event=store_close_failed error=%r", exc)

    # -- internals ------------------------------------------------------------------------

    def _load_hits(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        """Receives blocks batch by batch; returns the length of the fully received prefix."""
        assert self._namespace_id is not None
        step = self.config.load_batch_blocks
        for start in range(0, len(keys), step):
            end = min(start + step, len(keys))
            position = ChainPosition.of(keys, start, request.position)
            try:
                found = self._get_into(keys[start:end], pages[start:end], position)
            except KVStoreError as exc:
                self._on_error("get", request, exc)
                return start
            num_found = loaded_prefix_len(found)
            if num_found < len(found):  # evicted since the match: stop at the gap
                return start + num_found
        return len(keys)

    def _get_into(
        self,
        keys: Sequence[bytes],
        pages: Sequence[BlockPages],
        position: ChainPosition | None,
    ) -> tuple[bool, ...]:
        """Reads `keys` (the first at `position` in its chain) into their pages."""
        if self._staging is None:
            views: list[Any] = [self.cache.block_view(p[0]) for p in pages]
            return self._read(keys, views, position)
        found = []
        for i, block_pages in enumerate(pages):
            at = ChainPosition.of(keys, i, position)
            hit = self._read(keys[i : i + 1], [self._staging], at)[0]
            if hit:
                self.cache.write_block(block_pages, self._staging)
            found.append(hit)
            if not hit:
                break
        return tuple(found)

    def _num_committed(self, keys: Sequence[bytes]) -> int:
        assert self._namespace_id is not None
        return self._client.match(self._namespace_id, keys).num_matched

    def _put_from_pages(
        self, keys: Sequence[bytes], pages: Sequence[BlockPages], first: int
    ) -> None:
        """Puts blocks ``first...`` of a chain from the root, copied out of `pages` (the
        caller's until it returns) into one host buffer."""
        staging = torch.empty(
            (len(keys) - first, *self.cache.block_shape), dtype=self.cache.pages.dtype
        )
        for out, block_pages in zip(staging, pages[first:], strict=True):
            self.cache.read_block(block_pages, out=out)
        parent = keys[first - 1] if first else None
        self._put_chain(keys[first:], staging, parent, ChainPosition.of(keys, first))

    def _read(
        self, keys: Sequence[bytes], views: list[Any], position: ChainPosition | None
    ) -> tuple[bool, ...]:
        assert self._namespace_id is not None
        if isinstance(self._client, PoolClient):
            return self._client.get_into(self._namespace_id, keys, views, position)
        return self._client.get_into(self._namespace_id, keys, views)

    def _put_chain(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[torch.Tensor] | torch.Tensor,
        parent: bytes | None,
        position: ChainPosition | None = None,
    ) -> object:
        """Puts host `blocks` (the first at `position` in its chain): one tensor of a block
        per row (checked once for the call: `buffers.checked_buffers`) or a sequence of
        blocks."""
        assert self._namespace_id is not None
        views: Any
        if isinstance(blocks, torch.Tensor):
            views = PagedBlocks.as_rows(blocks)
        else:
            views = [PagedBlocks.as_buffer(b) for b in blocks]
        if isinstance(self._client, PoolClient):
            return self._client.put_chain(self._namespace_id, keys, views, parent, position)
        return self._client.put_chain(self._namespace_id, keys, views, parent)

    def _ensure_registered(self) -> bool:
        if self._namespace_id is not None and self._clock() >= self._skip_until:
            return True
        if self._clock() < self._skip_until:
            return False
        try:
            self._namespace_id = self._client.register_namespace(self.namespace).namespace_id
        except KVStoreError as exc:
            self._on_error("register", None, exc)
            return False
        try:  # connect the data plane now, not inside the first request's TTFT
            self._client.data_plane()
        except KVStoreError as exc:
            logger.warning("event=store_dataplane_unavailable error=%s", exc)
        logger.info("event=store_bound store=%s namespace=%s", self.config.store, self.namespace)
        return True

    def _on_error(self, op: str, request: ConnectorRequest | None, exc: KVStoreError) -> None:
        self._num_load_errors += op in ("match", "get")
        self._skip_until = self._clock() + self.config.retry_after_s
        logger.warning(
            "event=store_error op=%s request_id=%s error=%s retry_after_s=%s",
            op,
            request.request_id if request else "-",
            exc,
            self.config.retry_after_s,
        )
