"""The engine's side of its `KVConnector`: every call to it, and the loads and publishes in
flight.

Each connector call goes through `KVTransfer._checked`, the one place that catches what a
connector raises and checks the count it reports (``0 <= n <= len(keys)``); anything else
counts as 0 blocks, logged, so a broken connector costs recomputation and nothing more.
A load runs on the loader thread (or inline, without `async_load`) and always ends as a
`LoadResult`, collected by the scheduler with `finished_loads`; a load never raises. A
publish (a prefill engine's finished request) runs the same way on its own thread, so a
slow store never holds up a load, and ends as a `PublishResult` (`finished_publishes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import NamedTuple

from gpu_engine.block_manager import Uncached
from gpu_engine.connector_base import BlockPages, ConnectorRequest, KVConnector
from gpu_engine.request import Request
from kvstore.keys import ChainPosition

logger = logging.getLogger(__name__)


class LoadResult(NamedTuple):
    """A finished load: of `blocks` (keys `keys`), the first `num_loaded` hold the store's
    bytes; the rest hold anything and are recomputed."""

    request: Request
    first_block: int  # block index in the request of keys[0]
    keys: list[bytes]
    blocks: list[BlockPages]
    num_loaded: int  # checked: 0 <= num_loaded <= len(keys)


class PublishResult(NamedTuple):
    """A finished publish: of the request's full prompt blocks `keys`, the first
    `num_published` are committed in the store."""

    request: Request
    keys: list[bytes]
    num_published: int  # checked: 0 <= num_published <= len(keys)


class _PendingPublish(NamedTuple):
    request: Request
    keys: list[bytes]
    num_published: Future[int]  # never raises, as a load's


class _PendingLoad(NamedTuple):
    request: Request
    uncached: Uncached
    blocks: list[BlockPages]
    num_loaded: Future[int]  # never raises: `_checked` maps failures to 0


class KVTransfer:
    """Looks up, loads and saves blocks through `connector`; see the module docstring.

    Args:
        connector: the store seam, already bound to the engine's cache.
        async_load: receive on the loader thread (True) or inside `start_load` (False).
    """

    def __init__(self, connector: KVConnector, async_load: bool) -> None:
        self.connector = connector
        self.async_load = async_load
        self._loads: list[_PendingLoad] = []
        self._publishes: list[_PendingPublish] = []
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        self._publish_waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-publish")

    @property
    def num_loading(self) -> int:
        """Loads started and not yet returned by `finished_loads`."""
        return len(self._loads)

    @property
    def num_publishing(self) -> int:
        """Publishes started and not yet returned by `finished_publishes`."""
        return len(self._publishes)

    def lookup(self, req: Request, uncached: Uncached) -> int:
        """How many leading blocks of `uncached` the store holds: 0 on any failure."""
        info = _info(req, uncached.parent_key, uncached.position)
        keys = uncached.keys
        return self._checked("lookup", info, len(keys), self.connector.lookup, info, keys)

    def start_load(self, req: Request, uncached: Uncached, blocks: list[BlockPages]) -> None:
        """Starts receiving blocks `uncached.keys` into `blocks` (their pages are the
        connector's until the load is collected)."""
        info = _info(req, uncached.parent_key, uncached.position)
        args = ("load", info, len(blocks), self.connector.load, info, uncached.keys, blocks)
        num_loaded = self._run(self._loader, *args)
        self._loads.append(_PendingLoad(req, uncached, blocks, num_loaded))

    def start_publish(self, req: Request, keys: list[bytes], blocks: list[BlockPages]) -> None:
        """Starts committing `req`'s full prompt blocks (key `keys[i]` in `blocks[i]`, from
        the first) in the store; their pages are the connector's until it is collected."""
        info = _info(req, None, None)
        args = ("publish", info, len(keys), self.connector.publish, info, keys, blocks)
        num_published = self._run(self._publish_waiter, *args)
        self._publishes.append(_PendingPublish(req, keys, num_published))

    def finished_loads(self) -> list[LoadResult]:
        """The loads that are over since the last call, in the order they were started."""
        if not self._loads:
            return []
        finished, pending = [], []
        for load in self._loads:
            if load.num_loaded.done():
                req, uncached, blocks, num_loaded = load
                keys, first = uncached.keys, uncached.first_block
                finished.append(LoadResult(req, first, keys, blocks, num_loaded.result()))
            else:
                pending.append(load)
        self._loads = pending
        return finished

    def finished_publishes(self) -> list[PublishResult]:
        """The publishes that are over since the last call, in the order they were started."""
        is_done = [p.num_published.done() for p in self._publishes]  # once: they finish meanwhile
        finished = [p for p, done in zip(self._publishes, is_done, strict=True) if done]
        self._publishes = [p for p, done in zip(self._publishes, is_done, strict=True) if not done]
        return [PublishResult(p.request, p.keys, p.num_published.result()) for p in finished]

    def wait_for_transfer(self, timeout_s: float | None = None) -> None:
        """Blocks until a load or a publish in flight is over (at once when none is)."""
        futures = [load.num_loaded for load in self._loads]
        futures += [publish.num_published for publish in self._publishes]
        if futures:
            wait(futures, timeout_s, FIRST_COMPLETED)

    def save(
        self,
        req: Request,
        parent_key: bytes | None,
        position: ChainPosition | None,
        keys: list[bytes],
        blocks: list[BlockPages],
    ) -> None:
        """Offers blocks just computed (block i is `keys[i]` in `blocks[i]`; the first at
        `position` in its chain, after `parent_key`) to the store."""
        info = _info(req, parent_key, position)
        self._checked("save", info, len(keys), self._save, info, keys, blocks)

    def close(self) -> None:
        """Waits for the load and publish in flight, if any, and stops their threads."""
        self._loader.shutdown(wait=True)
        self._publish_waiter.shutdown(wait=True)

    def _run(self, executor: ThreadPoolExecutor, *args: object) -> Future[int]:
        """`_checked(*args)` on `executor`, or inline without `async_load`."""
        if self.async_load:
            return executor.submit(self._checked, *args)  # type: ignore[arg-type]
        done: Future[int] = Future()
        done.set_result(self._checked(*args))  # type: ignore[arg-type]
        return done

    def _save(self, info: ConnectorRequest, keys: list[bytes], blocks: list[BlockPages]) -> int:
        self.connector.save(info, keys, blocks)
        return len(keys)

    def _checked(
        self,
        op: str,
        info: ConnectorRequest,
        limit: int,
        call: Callable[..., object],
        *args: object,
    ) -> int:
        """`call(*args)`'s count of blocks if it is an int in [0, limit]; otherwise 0, logged.
        The engine's only handler of connector failures."""
        try:
            count = call(*args)
        except Exception:
            logger.exception("event=connector_failed op=%s request_id=%d", op, info.request_id)
            return 0
        if not isinstance(count, int) or not 0 <= count <= limit:
            logger.error(
                "event=connector_bad_count op=%s request_id=%d count=%r limit=%d",
                op,
                info.request_id,
                count,
                limit,
            )
            return 0
        return count


def _info(
    req: Request, parent_key: bytes | None, position: ChainPosition | None
) -> ConnectorRequest:
    return ConnectorRequest(req.request_id, req.num_prompt_tokens, parent_key, position)
