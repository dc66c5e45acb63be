"""The publisher: keeps this node's membership and its blocks in the global index up to date,
off the request path, on a thread of its own.

Every `flush_s` it files what changed in the store since its last pass (`Store.
inventory_changes`: commits, evictions, removals, demotions and promotions, each as held
now), so a change is in the index within `flush_s` plus one round trip while Redis answers.
Every `ttl_s / 4` it renews the node's record and every `refresh_s` it reads the others',
each on its own schedule: a long flush interval never delays a renewal.

Whenever what the index holds of this node can no longer be trusted (a publish failed,
the store's inventory overflowed, this node was fenced, Redis lost its record) it takes a
new generation, so every entry it filed before is dead to readers at once, and files all it
holds again, `slice_blocks` per pass. Every `sweep_s` it files all it holds again anyway,
which renews each entry's expiry. While Redis is away the node serves what it holds; it
reports the degraded state (`status`) and rebuilds its part of the index when Redis is back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from redis import RedisError

from kvstore.cluster.global_index import GlobalIndex
from kvstore.cluster.membership import Membership, new_generation
from kvstore.store import Store

log = logging.getLogger("kvstore.cluster")


@dataclass(frozen=True)
class PublisherStatus:
    """The publisher's part of `PoolReport`."""

    redis_ok: bool
    fenced: bool
    num_published: int  # blocks filed since start
    num_pending: int  # blocks still to file again (after a new generation, or a sweep)
    last_error: str
    rebuild_seconds: float  # how long the last full republish took (0: none yet)


class Publisher:
    """Publishes `store`'s blocks as `membership.me` into `index`."""

    def __init__(
        self,
        store: Store,
        membership: Membership,
        index: GlobalIndex,
        flush_s: float = 0.05,
        refresh_s: float = 0.5,
        sweep_s: float = 1800.0,
        slice_blocks: int = 4096,
    ) -> None:
        self.store = store
        self.membership = membership
        self.index = index
        self.flush_s = flush_s
        self.refresh_s = refresh_s
        self.sweep_s = sweep_s
        self.slice_blocks = slice_blocks
        self.num_published = 0
        self._redis_ok = False
        self._last_error = ""
        self._pending: list[bytes] = []  # block ids to file again, in slices
        self._rebuild_started: float | None = None
        self._rebuild_seconds = 0.0
        self._must_rebuild = True  # everything the store holds, at start
        self._has_filed = False  # whether anything was filed (or tried) under this node
        self._next_renew = self._next_refresh = 0.0
        self._next_sweep = time.monotonic() + sweep_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        store.watch_inventory()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvstore-publisher", daemon=True)
        self._thread.start()

    def stop(self, leave: bool = True) -> None:
        """Stops publishing; with `leave`, takes the node's record out of the pool."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if leave:
            try:
                self.membership.leave()
            except RedisError as exc:
                log.info("event=cluster_leave_failed error=%s", exc)

    def status(self) -> PublisherStatus:
        return PublisherStatus(
            self._redis_ok,
            self.membership.is_fenced,
            self.num_published,
            len(self._pending),
            self._last_error,
            self._rebuild_seconds,
        )

    def _run(self) -> None:
        tick = min(self.flush_s, self.refresh_s, self.membership.ttl_s / 4)
        next_flush = time.monotonic() + self.flush_s  # `Pool` made the first pass
        while not self._stop.wait(tick):
            now = time.monotonic()
            flush = now >= next_flush
            if flush:
                next_flush = now + self.flush_s
            try:
                self.run_once(flush)
            except Exception:  # a bug must not end publishing: log it, file all again
                log.exception("event=cluster_publisher_error")
                self._must_rebuild = True

    def run_once(self, flush: bool = True) -> None:
        """One pass: renew and read the others where due; with `flush`, file what changed
        and the next slice."""
        now = time.monotonic()
        try:
            if now >= self._next_renew:
                held = {t.name: t.used_bytes for t in self.store.stats().tiers}
                self.membership.me = replace(self.membership.me, held=held)
                if self.membership.renew():
                    self._must_rebuild = True
                self._next_renew = now + self.membership.ttl_s / 4
            if now >= self._next_refresh:
                self.membership.refresh()
                self._next_refresh = now + self.refresh_s
            if self.membership.is_fenced:
                return
            if flush:
                self._publish(now)
            self._redis_ok, self._last_error = True, ""
        except RedisError as exc:
            if self._redis_ok or not self._last_error:
                log.warning("event=cluster_redis_error error=%s", exc)
            self._redis_ok, self._last_error = False, str(exc) or type(exc).__name__
            self._must_rebuild = True  # what was taken from the store was not filed

    def _publish(self, now: float) -> None:
        changes, overflowed = self.store.inventory_changes()
        if overflowed or self._must_rebuild:
            self._rebuild(now)
            changes = []  # the rebuild files every block as held now
        elif not self._pending and now >= self._next_sweep:
            self._pending = self.store.held_ids()
            self._next_sweep = now + self.sweep_s
        batch = self._pending[: self.slice_blocks]
        holdings = [*changes, *self.store.holdings(batch)]
        me = self.membership.me
        self.num_published += self.index.publish(me, holdings) if holdings else 0
        del self._pending[: len(batch)]
        if not self._pending and self._rebuild_started is not None:
            self._rebuild_seconds = time.monotonic() - self._rebuild_started
            self._rebuild_started = None
            log.info("event=cluster_rebuilt seconds=%.3f", self._rebuild_seconds)

    def _rebuild(self, now: float) -> None:
        """A new generation (what was filed under the last one is dead at once), renewed,
        and everything held to file again."""
        self._must_rebuild = False
        if self._has_filed:  # entries of ours may be in the index: make them dead
            self.membership.me = replace(self.membership.me, generation=new_generation())
            self.membership.renew()
        self._has_filed = True
        self._pending = self.store.held_ids()
        self._rebuild_started = now
        self._next_sweep = now + self.sweep_s
        log.info(
            "event=cluster_rebuild generation=%s blocks=%d",
            self.membership.me.generation,
            len(self._pending),
        )
