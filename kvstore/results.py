"""Result types the store hands across its boundary (to the server, the client, the engine)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

NOTHING: Mapping = MappingProxyType({})  # an empty mapping default that nothing can change


class MatchResult(NamedTuple):
    """Longest present prefix: `num_matched` keys from the first, and the tier of each."""

    num_matched: int
    tiers: tuple[str, ...]


class PutStatus(enum.Enum):
    RESERVED = "reserved"  # a slot is yours to write, then commit
    PRESENT = "present"  # already committed: nothing to write
    IN_FLIGHT = "in_flight"  # another writer holds a reservation for it


NO_RESERVATION = 0  # the id of a reserve call that reserved nothing; commit and abort are no-ops


class ReserveResult(NamedTuple):
    """One status per key; `reservation_id` is `NO_RESERVATION` when none is RESERVED."""

    reservation_id: int
    statuses: tuple[PutStatus, ...]

    @property
    def num_reserved(self) -> int:
        return sum(s is PutStatus.RESERVED for s in self.statuses)


class NamespaceInfo(NamedTuple):
    namespace_id: bytes
    block_bytes: int


class PutResult(NamedTuple):
    """Outcome of a whole put: how many blocks were stored now and how many were there."""

    num_stored: int
    num_present: int
    num_in_flight: int


class TierUsage(NamedTuple):
    """One tier's space, and the traffic it served since start."""

    name: str
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int = 0  # reads served from this tier
    bytes_read: int = 0  # bytes read out of this tier (hits, promotions)
    bytes_written: int = 0  # bytes written into this tier (puts, demotions, promotions)
    hit_tokens: int = 0  # tokens of the reads served from this tier


class StoreStats(NamedTuple):
    num_blocks: int
    num_namespaces: int
    num_reservations: int
    num_leases: int
    hits: int
    misses: int
    miss_tokens: int  # tokens of the blocks asked for and not held
    evictions: int  # blocks that left DRAM to make room (demoted or dropped)
    demotions: int  # DRAM -> SSD copies
    promotions: int  # SSD -> DRAM copies on read
    drops: int  # blocks that left the store to make room
    blocks_committed: int
    bytes_written: int
    bytes_read: int
    checksum_failures: int
    ssd_write_failures: int  # SSD transactions that failed (and changed nothing)
    expired_reservations: int
    expired_leases: int
    tiers: tuple[TierUsage, ...]

    @property
    def capacity_bytes(self) -> int:
        return sum(t.capacity_bytes for t in self.tiers)

    @property
    def used_bytes(self) -> int:
        return sum(t.used_bytes for t in self.tiers)


class PoolNode(NamedTuple):
    """A node of the global pool: its id, where it listens ("grpc": HOST:PORT), its
    capacity by tier, and the bytes it holds by tier (empty for callers that see only
    their tenant)."""

    node_id: str
    addresses: dict[str, str]
    capacity: dict[str, int]
    held: Mapping[str, int] = NOTHING


class Located(NamedTuple):
    """Where the longest prefix of a chain that some live node holds lives in the pool:
    for each block, its holders as (index into `nodes`, tier), the fastest tier first.
    `degraded`: the pool's index could not be read, so only the asked node's own blocks."""

    nodes: tuple[PoolNode, ...]
    blocks: tuple[tuple[tuple[int, str], ...], ...]
    degraded: bool = False

    @property
    def num_located(self) -> int:
        return len(self.blocks)

    @classmethod
    def on_one_node(cls, match: MatchResult, node: PoolNode, degraded: bool = False) -> Located:
        """One node's own prefix of a chain as a location (a node id of "" is the node
        that was asked)."""
        blocks = tuple(((0, "dram" if tier == "hbm" else tier),) for tier in match.tiers)
        return cls((node,), blocks, degraded)


class PoolReport(NamedTuple):
    """The pool as one node sees it (`kvstore stats --cluster`)."""

    in_pool: bool  # False: a node alone
    node_id: str = ""
    generation: str = ""
    redis_ok: bool = False
    fenced: bool = False
    members: tuple[PoolNode, ...] = ()
    num_published: int = 0  # blocks filed in the index since start
    num_pending: int = 0  # blocks still to file again (a rebuild or sweep under way)
    last_error: str = ""
    rebuild_seconds: float = 0.0  # how long the last full republish took
    num_locates: int = 0  # chains looked up in the index since start
    num_locate_rounds: int = 0  # the Redis round trips they took
    holders_sampled: Mapping[int, int] = NOTHING  # live holders -> blocks, of a sample
