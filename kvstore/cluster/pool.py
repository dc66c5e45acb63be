"""This node's part in the global pool: its membership, its publisher, and the lookups it
answers for its clients (`locate`). Only nodes talk to Redis: an engine asks a node, which
maps the caller's namespace through its tenancy first, so engines need no Redis
credentials and see nothing of another tenant's blocks.

A lookup that fails (Redis away, slow or refusing) answers None, and the caller answers from
this node's own blocks; after a failure the pool does not ask Redis again for
`backoff_s`, so a Redis that hangs costs one timeout per `backoff_s`, not one per request.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from redis import RedisError

from kvstore.cluster.global_index import GlobalIndex
from kvstore.cluster.membership import Member, Membership, new_generation
from kvstore.cluster.publisher import Publisher
from kvstore.cluster.redis_link import open_redis
from kvstore.cluster.settings import PoolSettings
from kvstore.keys import ChainPosition
from kvstore.results import Located, MatchResult, PoolNode, PoolReport
from kvstore.store import Store

log = logging.getLogger("kvstore.cluster")
BACKOFF_S = 1.0
MAX_SAMPLE_BLOCKS = 10_000  # index entries one status call may read


def advertised_host(settings: PoolSettings, host: str) -> str:
    """Where others reach this node: `advertise_host`, else the listening host unless it is
    a wildcard, else this machine's name."""
    if settings.advertise_host:
        return settings.advertise_host
    return socket.gethostname() if host in ("", "0.0.0.0", "::", "[::]") else host


class Pool:
    """This node, of `capacity` by tier, in the pool `settings.cluster`, once started with
    its addresses."""

    def __init__(self, store: Store, settings: PoolSettings, capacity: Mapping[str, int]) -> None:
        self.store = store
        self.settings = settings
        self.capacity = dict(capacity)
        self.redis = open_redis(settings.cluster, settings.cluster_timeout_s)
        self.index = GlobalIndex(self.redis)
        self.membership: Membership | None = None  # once started
        self.publisher: Publisher | None = None
        self._quiet_until = 0.0  # no lookups in Redis before then (it just failed)

    def start(self, addresses: Mapping[str, str]) -> Pool:
        """Joins as the node at `addresses` ("grpc": HOST:PORT, and any plane's), now where
        Redis answers, else as soon as it does."""
        node_id = self.settings.node_id or addresses["grpc"]
        me = Member(node_id, new_generation(), dict(addresses), self.capacity)
        self.membership = Membership(self.redis, me, self.settings.cluster_ttl_s)
        flush_s = self.settings.cluster_flush_s
        self.publisher = Publisher(self.store, self.membership, self.index, flush_s)
        self.publisher.run_once()
        self.publisher.start()
        return self

    def stop(self) -> None:
        if self.publisher is not None:
            self.publisher.stop(leave=True)
        self.redis.close()

    def locate(
        self, namespace_id: bytes, keys: Sequence[bytes], position: ChainPosition | None = None
    ) -> Located | None:
        """Where each block of the longest prefix of `keys` (in the store's own namespace
        `namespace_id`, the first at `position` in its chain) is held in the pool; None
        where the index cannot be read now."""
        membership = self.membership
        if membership is None or membership.is_fenced or time.monotonic() < self._quiet_until:
            return None
        try:
            found = self.index.locate(namespace_id, keys, membership.live(), position)
        except RedisError as exc:
            self._quiet_until = time.monotonic() + BACKOFF_S
            log.info("event=cluster_locate_failed error=%s", exc)
            return None
        nodes: dict[str, int] = {}
        blocks = []
        for holders in found:
            ids = (nodes.setdefault(h.member.node_id, len(nodes)) for h in holders)
            blocks.append(tuple(zip(ids, (h.tier for h in holders), strict=True)))
        members = {h.member.node_id: h.member for holders in found for h in holders}
        return Located(tuple(_node(members[n]) for n in nodes), tuple(blocks))

    def alone(self, match: MatchResult) -> Located:
        """This node's own prefix of a chain, as a location (the index could not be read)."""
        me = _node(self.membership.me) if self.membership else PoolNode("", {}, {})
        return Located.on_one_node(match, me, degraded=True)

    def report(self, sees_node: bool = True, sample_blocks: int = 0) -> PoolReport:
        """The pool as this node sees it; what members hold only for a caller that
        `sees_node`, and for it how many live nodes hold each of `sample_blocks` blocks of
        the index (empty where Redis fails)."""
        if self.membership is None or self.publisher is None:
            return PoolReport(in_pool=True, last_error="not joined yet")
        me, status = self.membership.me, self.publisher.status()
        live = self.membership.live()
        members = sorted(live.values(), key=lambda m: m.node_id)
        if not sees_node:
            members = [replace(m, held={}) for m in members]
        sampled: dict[int, int] = {}
        if sees_node and sample_blocks > 0:
            try:
                sampled = self.index.sample(live, min(sample_blocks, MAX_SAMPLE_BLOCKS))
            except RedisError as exc:
                log.info("event=cluster_sample_failed error=%s", exc)
        return PoolReport(
            True,
            me.node_id,
            me.generation,
            status.redis_ok,
            status.fenced,
            tuple(_node(m) for m in members),
            status.num_published,
            status.num_pending,
            status.last_error,
            status.rebuild_seconds,
            self.index.locates,
            self.index.locate_rounds,
            sampled,
        )


def _node(member: Member) -> PoolNode:
    return PoolNode(
        member.node_id, dict(member.addresses), dict(member.capacity), dict(member.held)
    )
