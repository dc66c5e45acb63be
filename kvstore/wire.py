"""Conversions between protobuf messages and the store's own types, for server and client.

Protobuf types go no further than this module, `server.py` and `client.py`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstore._proto import kvstore_pb2 as pb
from kvstore.keys import ChainPosition, KVLayout, Namespace
from kvstore.limits import LAYOUT_FIELDS, NamespaceLimits
from kvstore.results import (
    Located,
    MatchResult,
    PoolNode,
    PoolReport,
    PutStatus,
    ReserveResult,
    StoreStats,
    TierUsage,
)

SERVICE_NAME = "kvstore.v1.KVStore"
TIER_TO_PB = {"hbm": pb.TIER_HBM, "dram": pb.TIER_DRAM, "ssd": pb.TIER_SSD}
TIER_FROM_PB = {v: k for k, v in TIER_TO_PB.items()}
STATUS_TO_PB = {
    PutStatus.RESERVED: pb.PUT_STATUS_RESERVED,
    PutStatus.PRESENT: pb.PUT_STATUS_PRESENT,
    PutStatus.IN_FLIGHT: pb.PUT_STATUS_IN_FLIGHT,
}
STATUS_FROM_PB = {v: k for k, v in STATUS_TO_PB.items()}


def namespace_to_pb(ns: Namespace) -> pb.Namespace:
    lay = ns.layout
    return pb.Namespace(
        model_id=ns.model_id,
        dtype=lay.dtype,
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        block_tokens=lay.block_tokens,
        tenant_salt=ns.tenant_salt,
    )


def namespace_from_pb(msg: pb.Namespace, limits: NamespaceLimits | None = None) -> Namespace:
    """Raises InvalidArgumentError for an invalid layout or empty model id, and, with
    `limits`, FieldTooLargeError for a field over them (checked first)."""
    if limits is not None:
        layout_fields = {name: getattr(msg, name) for name in LAYOUT_FIELDS}
        limits.check(msg.model_id, msg.dtype, msg.tenant_salt, layout_fields)
    layout = KVLayout(msg.dtype, msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_tokens)
    return Namespace(msg.model_id, layout, msg.tenant_salt)


def match_to_pb(result: MatchResult) -> pb.MatchResponse:
    return pb.MatchResponse(
        num_matched=result.num_matched, tiers=[TIER_TO_PB[t] for t in result.tiers]
    )


def match_from_pb(msg: pb.MatchResponse) -> MatchResult:
    return MatchResult(msg.num_matched, tuple(TIER_FROM_PB[t] for t in msg.tiers))


def parents_from_pb(parent_keys: Sequence[bytes]) -> list[bytes | None] | None:
    return [p or None for p in parent_keys] if parent_keys else None


def position_from_pb(request: pb.ReserveRequest | pb.LocateRequest) -> ChainPosition | None:
    """The first key's stated place in its chain; None where none is stated."""
    if not request.chain_depth:
        return None
    return ChainPosition(request.chain_depth, request.chain_group)


def parents_to_pb(parents: Sequence[bytes | None] | None) -> list[bytes]:
    return [p or b"" for p in parents] if parents is not None else []


def reserve_to_pb(result: ReserveResult) -> pb.ReserveResponse:
    return pb.ReserveResponse(
        reservation_id=result.reservation_id,
        statuses=[STATUS_TO_PB[s] for s in result.statuses],
    )


def reserve_from_pb(msg: pb.ReserveResponse) -> ReserveResult:
    return ReserveResult(msg.reservation_id, tuple(STATUS_FROM_PB[s] for s in msg.statuses))


def write_chunks(
    reservation_id: int, blocks: Sequence[tuple[int, memoryview]], chunk_bytes: int
) -> Iterator[pb.WriteChunk]:
    """The Write stream for `(index, payload)` pairs, each cut into `chunk_bytes` pieces."""
    for index, payload in blocks:
        for offset in range(0, max(len(payload), 1), chunk_bytes):
            data = bytes(payload[offset : offset + chunk_bytes])
            yield pb.WriteChunk(
                reservation_id=reservation_id, index=index, offset=offset, data=data
            )


def _tier_to_pb(usage: TierUsage) -> pb.TierUsage:
    fields = usage._asdict()
    return pb.TierUsage(tier=TIER_TO_PB[fields.pop("name")], **fields)


def _tier_from_pb(msg: pb.TierUsage) -> TierUsage:
    fields = {name: getattr(msg, name) for name in TierUsage._fields[1:]}
    return TierUsage(TIER_FROM_PB[msg.tier], **fields)


def stats_to_pb(stats: StoreStats) -> pb.StatsResponse:
    fields = {k: v for k, v in stats._asdict().items() if k != "tiers"}
    return pb.StatsResponse(**fields, tiers=[_tier_to_pb(t) for t in stats.tiers])


def stats_from_pb(msg: pb.StatsResponse) -> StoreStats:
    fields = {name: getattr(msg, name) for name in StoreStats._fields if name != "tiers"}
    return StoreStats(**fields, tiers=tuple(_tier_from_pb(t) for t in msg.tiers))


def pool_node_to_pb(node: PoolNode) -> pb.PoolNode:
    return pb.PoolNode(
        node_id=node.node_id, addresses=node.addresses, capacity=node.capacity, held=dict(node.held)
    )


def pool_node_from_pb(msg: pb.PoolNode) -> PoolNode:
    return PoolNode(msg.node_id, dict(msg.addresses), dict(msg.capacity), dict(msg.held))


def located_to_pb(located: Located) -> pb.LocateResponse:
    blocks = [
        pb.BlockHolders(nodes=[n for n, _ in holders], tiers=[TIER_TO_PB[t] for _, t in holders])
        for holders in located.blocks
    ]
    nodes = [pool_node_to_pb(n) for n in located.nodes]
    return pb.LocateResponse(nodes=nodes, blocks=blocks, degraded=located.degraded)


def located_from_pb(msg: pb.LocateResponse, num_keys: int) -> Located:
    """What a node answered about `num_keys` keys; a holder naming no node or no tier is
    left out, the prefix ends at the first block left with none, and blocks past the keys
    asked about are dropped."""
    nodes = tuple(pool_node_from_pb(n) for n in msg.nodes)
    blocks = []
    for block in msg.blocks[:num_keys]:
        pairs = zip(block.nodes, block.tiers, strict=False)
        holders = tuple(
            (n, TIER_FROM_PB[t]) for n, t in pairs if n < len(nodes) and t in TIER_FROM_PB
        )
        if not holders:
            break
        blocks.append(holders)
    return Located(nodes, tuple(blocks), msg.degraded)


def pool_report_to_pb(report: PoolReport) -> pb.PoolStatusResponse:
    fields = report._asdict()
    fields["members"] = [pool_node_to_pb(m) for m in report.members]
    fields["holders_sampled"] = dict(report.holders_sampled)
    return pb.PoolStatusResponse(**fields)


def pool_report_from_pb(msg: pb.PoolStatusResponse) -> PoolReport:
    members = tuple(pool_node_from_pb(m) for m in msg.members)
    apart = ("members", "holders_sampled")
    fields = {f: getattr(msg, f) for f in PoolReport._fields if f not in apart}
    return PoolReport(**fields, members=members, holders_sampled=dict(msg.holders_sampled))
