"""`kvstore-bench cluster --simulate 10,100,300`: the pool at hundreds of nodes, in
simulation.

A Mooncake-format trace is served round robin by N nodes (`PoolModel`: placement and reads
as the pool client does them), each able to hold `--capacity` of the trace's distinct
blocks (so past 1/capacity nodes the pool holds the whole trace and evicts nothing), every
node at the trace's own request rate (so the pool serves N times it). Each request's Redis
work is counted as the nodes do it: a lookup where the serving node does not hold the
whole prefix (one round, one command per chain group), two commands per block put
(`HSET`, `EXPIRE`), one per block evicted (`HDEL`); membership adds a renewal every
`ttl / 4` and a read every 0.5 s per node. From those: Redis commands a second, and the
Redis Cluster primaries that takes at `COMMANDS_PER_PRIMARY` each (half of what one
primary's core served here, `docs/cluster.md`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from kvstore.bench.pool_model import PoolModel
from kvstore.bench.report import Row
from kvstore.bench.trace_file import TraceLine, hit_ratio

COMMANDS_PER_PRIMARY = 200_000  # a second: half of one primary core's measured lookups
TTL_S = 2.0  # `--cluster-ttl-s` default
MEMBERSHIP_READ_S = 0.5  # how often a node reads the members


def simulate(requests: Sequence[TraceLine], counts: Sequence[int], fraction: float) -> list[Row]:
    """One row per node count in `counts`."""
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    rate = len(requests) / max(span_s, 1e-9)  # requests a second, at one node
    distinct = len({h for r in requests for h in r.hash_ids})
    per_node = max(1, int(distinct * fraction))
    rows = []
    for n in counts:
        model = PoolModel(n, per_node)
        served = [model.serve(r.hash_ids) for r in requests]
        hits = hit_ratio(requests, [s.num_hit for s in served], "tokens")
        per_request = statistics.fmean(
            s.groups_looked_up + 2 * s.num_stored + s.num_evicted for s in served
        )
        membership_per_s = n * (4 / TTL_S + 1 / MEMBERSHIP_READ_S)
        commands_per_s = per_request * rate * n + membership_per_s
        fan_out = sorted(s.nodes_read for s in served if s.num_hit)
        row: Row = {
            "nodes": n,
            "simulated": True,
            "requests_per_s": rate * n,
            "hit_ratio": hits,
            "evictions_per_request": statistics.fmean(s.num_evicted for s in served),
            "lookups_per_request": statistics.fmean(s.looked_up for s in served),
            "redis_commands_per_request": per_request,
            "redis_commands_per_s": commands_per_s,
            "membership_commands_per_s": membership_per_s,
            "fan_out_mean": statistics.fmean(fan_out) if fan_out else 0.0,
            "fan_out_p99": fan_out[int(0.99 * (len(fan_out) - 1))] if fan_out else 0,
            "redis_primaries": math.ceil(commands_per_s / COMMANDS_PER_PRIMARY),
        }
        rows.append(row)
    return rows
