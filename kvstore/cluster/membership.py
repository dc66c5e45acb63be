"""Membership: which nodes are in the pool now, each under the generation it started with.

Every node keeps a record in one Redis hash (`PREFIX:{members}`, one slot: the record set
is small): its id, generation, addresses, capacity and what it held at its last renewal,
and a deadline on Redis's own
clock, `ttl_s` past its last renewal. Deadlines are set and read by scripts that take
Redis's `TIME`, so no two machines' clocks are compared. A node renews every `ttl_s / 4`;
a reader takes a member as live until its deadline, counted on the reader's clock from
when the reader last read the records (`refresh`), and never after. So a node that dies,
freezes or is cut off stops being live to every reader within `ttl_s` of its last renewal,
with no scan and no cleaning up by anyone (a record past its deadline for an hour is
removed by the next reader).

Self-fencing: a node that could not renew for `ttl_s` (measured from when it sent its last
renewal that succeeded, so before its record's deadline) takes itself as out of the pool
(`is_fenced`) and publishes nothing; once a renewal succeeds again its publisher files all
it holds under a new generation, and what it filed under the old one is dead to readers. A
renewal that finds its record gone before its deadline (Redis restarted empty) says so, and
the node republishes what it holds.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvstore.cluster.redis_link import Redis

log = logging.getLogger("kvstore.cluster")
PREFIX = "kv1"  # the index format's version: a node of another format files elsewhere
MEMBERS_KEY = f"{PREFIX}:{{members}}".encode()
Clock = Callable[[], float]

# Sets a member's record and deadline on Redis's clock; 1 if the record was not there.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local absent = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], ARGV[1] .. ':until', now + tonumber(ARGV[3]))
return absent
"""
# Every record and deadline, and Redis's clock now (ms); forgets records whose deadline
# passed more than ARGV[1] ms ago (nodes gone for good), or is no deadline.
_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do
  local name = flat[i]
  if string.sub(name, -6) == ':until' then
    local deadline = tonumber(flat[i + 1])
    if deadline == nil or deadline + tonumber(ARGV[1]) < now then
      redis.call('HDEL', KEYS[1], name, string.sub(name, 1, -7))
    end
  end
end
return {now, flat}
"""
FORGET_AFTER_S = 3600.0  # a record past its deadline this long is removed by the next reader


def new_generation() -> str:
    """A generation no earlier start of any node had (random, 64 bits)."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Member:
    """One node as the pool knows it."""

    node_id: str
    generation: str
    addresses: dict[str, str] = field(default_factory=dict)  # "grpc", "tcp", "ucx" -> where
    capacity: dict[str, int] = field(default_factory=dict)  # tier -> bytes
    held: dict[str, int] = field(default_factory=dict)  # tier -> bytes held at its renewal

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, text: bytes | str) -> Member | None:
        """The member a record names; None for one that is not well formed."""
        try:
            fields = json.loads(text)
            member = cls(
                str(fields["node_id"]),
                str(fields["generation"]),
                {str(k): str(v) for k, v in fields["addresses"].items()},
                {str(k): int(v) for k, v in fields["capacity"].items()},
                {str(k): int(v) for k, v in fields.get("held", {}).items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return member


class Membership:
    """This node's record (`me`) in the pool on `redis`, and the pool as last read."""

    def __init__(
        self, redis: Redis, me: Member, ttl_s: float = 2.0, clock: Clock = time.monotonic
    ) -> None:
        assert ttl_s > 0
        self.redis = redis
        self.me = me
        self.ttl_s = ttl_s
        self.clock = clock
        self.key = MEMBERS_KEY.decode()
        self._renew = redis.register_script(_RENEW)
        self._read = redis.register_script(_READ)
        self._renewed_at: float | None = None  # when the last renewal that succeeded was sent
        self._live: dict[str, tuple[Member, float]] = {}  # id -> member, deadline (my clock)

    @property
    def is_fenced(self) -> bool:
        """Whether this node must take itself as out of the pool: no renewal succeeded
        within `ttl_s` (or none yet)."""
        renewed = self._renewed_at
        return renewed is None or self.clock() - renewed >= self.ttl_s

    def renew(self) -> bool:
        """Renews this node's record; True if Redis had lost it (restarted empty) while this
        node was live, or this node was fenced: what the index holds of it cannot be trusted
        (the publisher files it all again under a new generation). Raises
        `redis.RedisError` where Redis fails."""
        sent = self.clock()
        was_fenced = self._renewed_at is not None and self.is_fenced
        if was_fenced:
            log.warning("event=cluster_unfenced node=%s generation=%s", *self._who())
        ttl_ms = str(round(self.ttl_s * 1000))
        absent = self._renew(keys=[self.key], args=[self.me.node_id, self.me.encode(), ttl_ms])
        lost = bool(absent) and self._renewed_at is not None and not was_fenced
        if lost:
            log.warning("event=cluster_record_lost node=%s generation=%s", *self._who())
        first = self._renewed_at is None
        self._renewed_at = sent
        self._live[self.me.node_id] = (self.me, sent + self.ttl_s)  # itself, as just filed
        if first:
            log.info("event=cluster_joined node=%s generation=%s", *self._who())
        return lost or was_fenced

    def leave(self) -> None:
        """Takes this node's record out (a clean stop); readers drop it at once."""
        self.redis.hdel(self.key, self.me.node_id, f"{self.me.node_id}:until")
        self._renewed_at = None

    def refresh(self) -> dict[str, Member]:
        """Reads every record; returns the live members. Raises `redis.RedisError`."""
        read_at = self.clock()
        forget_ms = str(round(FORGET_AFTER_S * 1000))
        now_ms, flat = self._read(keys=[self.key], args=[forget_ms])
        fields = {bytes(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat), 2)}
        live: dict[str, tuple[Member, float]] = {}
        for name, value in fields.items():
            if name.endswith(b":until"):
                continue
            member = Member.decode(value)
            until = fields.get(name + b":until", b"")
            if member is None or not until.isdigit():
                continue
            left_s = (int(until) - int(now_ms)) / 1000
            if left_s > 0:
                live[member.node_id] = (member, read_at + left_s)
        self._live = live
        return self.live()

    def live(self) -> dict[str, Member]:
        """The members live now, as last read (a deadline passed since drops its member)."""
        now = self.clock()
        return {nid: m for nid, (m, until) in self._live.items() if until > now}

    def _who(self) -> tuple[str, str]:
        return self.me.node_id, self.me.generation
