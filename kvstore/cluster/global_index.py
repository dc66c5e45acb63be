"""The global block index: which nodes hold each block, and in which tier.

One Redis hash per block, named `PREFIX:{TAG}` and then the block's id on the nodes: the
namespace id the tenant secret derives, then the key. Those ids never leave a node (a
client names its namespace by the id it computes itself), so the index answers only a node
that mapped a caller's namespace through its tenancy: a tenant learns nothing, not even
existence, about another tenant's blocks. TAG is the hex of the first 8 bytes of the
namespace id and of the block's chain group (`CHAIN_GROUP_BLOCKS` blocks along a chain,
named by the first one's key): a group lands in one Redis Cluster slot, so a chain of N
blocks is read from about N / 32 slots in one pipelined round, and chains that part after a
shared prefix part in Redis too (no one tag for all).

A lookup reads each group with one script (its keys share a slot), all groups in one
pipelined round.

A field per holder: node id -> "GENERATION TIER". A restarted node overwrites its own
fields under its new generation; readers drop a field whose node is not live under that
generation (`Membership`), so a dead or restarted node's entries stop being answered within
the membership TTL with no scan. What is left of them is removed by readers that meet a
field of a generation its node has left (conditionally, so a newer write is never lost),
and by each key's expiry (`entry_ttl_s`, renewed by the holders' republishing).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.cluster.membership import MEMBERS_KEY, PREFIX, Member
from kvstore.cluster.redis_link import Redis
from kvstore.keys import CHAIN_GROUP_BLOCKS, ChainPosition, chain_groups
from kvstore.store.inventory import Holding

TAG_BYTES = 8  # of the namespace id and of the group key each
ENTRY_TTL_S = 3 * 3600  # a holder republishes well within it (`Publisher.sweep_s`)
MAX_STALE_FIELDS = 4096  # fields of left generations waiting to be removed
_TIERS = ("dram", "ssd")
# Every field of each of KEYS (one chain group: one slot), in one command.
_READ_GROUP = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGETALL', key) end
return out
"""
# Removes a field only if it still holds what the reader saw.
_DROP_IF = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


@dataclass(frozen=True)
class Holder:
    """A live node holding a block, and the block's fastest tier there."""

    member: Member
    tier: str


class GlobalIndex:
    """The index on `redis`: what nodes publish (`publish`) and what a chain's lookup finds
    (`locate`). Counts its lookups (`locates`) and the pipelined round trips they took
    (`locate_rounds`)."""

    def __init__(self, redis: Redis, entry_ttl_s: float = ENTRY_TTL_S) -> None:
        self.redis = redis
        self.entry_ttl_s = entry_ttl_s
        self.locates = 0
        self.locate_rounds = 0
        self._stale: deque[tuple[bytes, bytes, bytes]] = deque(maxlen=MAX_STALE_FIELDS)

    @staticmethod
    def block_key(namespace_id: bytes, group: bytes, key: bytes) -> bytes:
        tag = (namespace_id[:TAG_BYTES] + group[:TAG_BYTES]).hex().encode()
        return PREFIX.encode() + b":{" + tag + b"}" + namespace_id + key

    def publish(self, me: Member, holdings: Sequence[Holding]) -> int:
        """Files what `me` holds of each block (its field set or removed) in one pipelined
        round, with the stale fields readers met; returns how many blocks it filed (a block
        not placed in its chain cannot be filed). Raises `redis.RedisError`."""
        pipe = self.redis.pipeline(transaction=False)
        node = me.node_id.encode()
        num_filed = 0
        for h in holdings:
            if h.group is None:
                continue
            key = self.block_key(h.namespace_id, h.group, h.key)
            if h.tier is None:
                pipe.hdel(key, node)
            else:
                pipe.hset(key, node, f"{me.generation} {h.tier}")
                pipe.expire(key, round(self.entry_ttl_s))
            num_filed += 1
        while self._stale:
            key, field, value = self._stale.popleft()
            pipe.execute_command("EVAL", _DROP_IF, 1, key, field, value)  # no script cache
        if len(pipe):
            pipe.execute()
        return num_filed

    def locate(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        live: Mapping[str, Member],
        position: ChainPosition | None = None,
    ) -> list[list[Holder]]:
        """The live holders of each block of the longest prefix of `keys` (consecutive
        blocks of a chain, the first at `position`; None: from its root) that some live
        node holds, in one pipelined round. Raises `redis.RedisError`."""
        if not keys:
            self.locates += 1
            return []
        names = [
            self.block_key(namespace_id, group, key)
            for key, group in zip(keys, chain_groups(keys, position), strict=True)
        ]
        pipe = self.redis.pipeline(transaction=False)
        for run in _runs_of_groups(names, position):
            pipe.execute_command("EVAL", _READ_GROUP, len(run), *run)  # one slot
        self.locates += 1
        groups = pipe.execute()
        self.locate_rounds += 1
        answers = [_as_fields(flat) for group in groups for flat in group]
        found = [self._live_holders(names[i], f, live) for i, f in enumerate(answers)]
        gap = next((i for i, holders in enumerate(found) if not holders), len(found))
        return found[:gap]

    def sample(self, live: Mapping[str, Member], num_blocks: int) -> dict[int, int]:
        """How many live holders each of up to `num_blocks` blocks filed in the index has
        (live holders -> blocks): replication as it stands, from a SCAN, off the request
        path. Raises `redis.RedisError`."""
        names = []
        for name in self.redis.scan_iter(match=f"{PREFIX}:{{*", count=1000):
            if bytes(name) != MEMBERS_KEY:
                names.append(bytes(name))
            if len(names) >= num_blocks:
                break
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        counts = Counter(
            len(self._live_holders(name, fields, live))
            for name, fields in zip(names, pipe.execute() if names else [], strict=True)
        )
        return dict(counts)

    def _live_holders(
        self, name: bytes, fields: Mapping[bytes, bytes], live: Mapping[str, Member]
    ) -> list[Holder]:
        """The live holders among the fields of index key `name`; a field its node filed
        under an earlier generation is noted, to be removed at the next publish."""
        holders = []
        for node, value in fields.items():
            generation, _, tier = value.decode("ascii", "replace").partition(" ")
            member = live.get(node.decode("utf-8", "replace"))
            if member is not None and member.generation == generation and tier in _TIERS:
                holders.append(Holder(member, tier))
            elif member is not None:  # its node restarted since: this field is dead
                self._stale.append((name, node, value))
        holders.sort(key=lambda h: (_TIERS.index(h.tier), h.member.node_id))
        return holders


def _as_fields(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    """A hash's fields from HGETALL's flat reply inside a script."""
    return {bytes(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _runs_of_groups(names: list[bytes], position: ChainPosition | None) -> list[list[bytes]]:
    """`names` (one per block, in chain order) cut where a chain group ends."""
    depth = 0 if position is None else position.depth
    runs: list[list[bytes]] = []
    for i, name in enumerate(names):
        if i == 0 or (depth + i) % CHAIN_GROUP_BLOCKS == 0:
            runs.append([])
        runs[-1].append(name)
    return runs
