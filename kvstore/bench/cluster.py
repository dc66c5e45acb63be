"""Suite `cluster`: the global pool on one machine (overhead and correctness, not scaling).

For each node count N (`--nodes 1,2,3`) it starts a real Redis and N `kvstore serve
--cluster` nodes, and beside them one node without the cluster layer:

- puts: chains of `--chain-blocks` blocks of `--block-bytes`, each put through a pool
  client whose home is the next node, round robin, and placed as it places puts
  (`put_gbps`), and the Redis commands they cost (`redis_ops_per_put`, one put call per
  chain);
- gets: each chain read through one pool client whose home is the first node (what the
  home holds read from it, the rest located in one lookup and read from every holder at
  once, each over its best plane): `get_gbps`, `get_p99_ms`; the same chains read from the
  node without the cluster layer by a plain client in the same run, the two taking turns
  chain by chain (`plain_get_gbps`);
- matches: the Redis round trips (`redis_rounds_per_match`, from the nodes' own counts) and
  commands (`redis_ops_per_match`) per chain lookup;
- a replay of the Mooncake-format trace (`--trace`) with requests spread round robin over
  N prefill nodes of C/N blocks each: the hit ratio of the global pool (a block any node
  holds is a hit; what missed is placed as the pool client places puts), of per-node
  caches (each request stores at its node), and of one node of all C blocks
  (`--capacity`, a fraction of the trace's distinct blocks), token-weighted with prefix
  semantics;
- `errors`: calls that raised, and blocks read back wrong.

`--simulate 10,100,300`: the pool at that many nodes in simulation instead
(`kvstore.bench.cluster_scale`: Redis commands a second, lookups and fan-out per request,
the primaries that takes).

`--kill`: the failure run instead. Two nodes; a chain on the first; the first SIGKILLed;
`seconds_to_miss` is how long until the second node's lookups miss it, and `max_call_s`
the longest any client call waited meanwhile (the read deadline bounds it).

Targets (the suite fails where one is missed or could not be measured): 0 errors; one
Redis round trip per match; the global hit ratio at least 0.95x one node with all the
capacity, and above per-node caches; a one-node pool's get at least 0.9x the plain node's;
a killed node's blocks missed within 3 s, no call past its read deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import numpy as np

from kvstore.bench import cluster_scale, trace_file, verdict
from kvstore.bench.load_server import ServerProcess, serve
from kvstore.bench.options import extra_of
from kvstore.bench.pool_model import PoolModel
from kvstore.bench.redis_servers import RedisServer, redis_server
from kvstore.bench.report import Row, progress_bar
from kvstore.bench.suites import SuiteOptions
from kvstore.bench.trace_file import TraceLine, hit_ratio
from kvstore.client import Client
from kvstore.client.pool_client import PoolClient
from kvstore.config import parse_bytes
from kvstore.keys import KVLayout, Namespace, block_keys

TTL_S = 1.0
READ_DEADLINE_S = 2.0
BYTES_PER_TOKEN = 4096  # the layout below: 2 (K, V) x 2 layers x 8 heads x 64 x 2 bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", default="1,2,3", help="node counts, comma-separated")
    parser.add_argument("--chains", type=int, default=16, help="chains put and read")
    parser.add_argument("--chain-blocks", type=int, default=32, help="blocks per chain")
    parser.add_argument("--block-bytes", type=parse_bytes, default=256 << 10)
    parser.add_argument("--rounds", type=int, default=5, help="reads of every chain")
    parser.add_argument("--trace", type=Path, default=trace_file.DEFAULT_TRACE)
    parser.add_argument("--capacity", type=float, default=0.1, help="of the distinct blocks")
    parser.add_argument("--kill", action="store_true", help="the failure run instead")
    parser.add_argument(
        "--simulate", default="", help="node counts to simulate instead (e.g. 10,100,300)"
    )


def run(options: SuiteOptions) -> list[Row]:
    extra = {k: v for k, v in extra_of(options).items() if v is not None}
    if extra.get("kill"):
        return [_kill_run()]
    trace = cast(Path, extra.get("trace", trace_file.DEFAULT_TRACE))
    capacity = cast(float, extra.get("capacity", 0.1))
    if extra.get("simulate"):
        counts = [int(n) for n in str(extra["simulate"]).split(",")]
        return cluster_scale.simulate(trace_file.load_trace(trace), counts, capacity)
    counts = [int(n) for n in str(extra.get("nodes", "1,2,3")).split(",")]
    chains = cast(int, extra.get("chains", 16)) // (4 if options.quick else 1)
    blocks = cast(int, extra.get("chain_blocks", 32))
    shape = (max(chains, 2), blocks, cast(int, extra.get("block_bytes", 256 << 10)))
    rounds = 1 if options.quick else cast(int, extra.get("rounds", 5))
    requests = trace_file.load_trace(trace, 2000 if options.quick else None)
    rows = []
    with progress_bar("cluster", total=len(counts)) as advance:
        for n in counts:
            row = _run_nodes(n, shape, rounds)
            row.update(_hit_ratios(requests, n, capacity))
            rows.append(row)
            advance(1)
    return rows


# -- one node count ------------------------------------------------------------------------


def _namespace(block_bytes: int) -> Namespace:
    return Namespace("cluster-bench", KVLayout("float16", 2, 8, 64, block_bytes // BYTES_PER_TOKEN))


def _chains(ns: Namespace, count: int, blocks: int) -> list[list[bytes]]:
    tokens = blocks * ns.block_tokens
    return [block_keys(ns, list(range(c * tokens, (c + 1) * tokens))) for c in range(count)]


def _payload(chain: int, block: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes, (chain * 131 + block * 7 + 1) % 251, np.uint8)


@contextlib.contextmanager
def _pool(n: int, redis: RedisServer, log_dir: Path) -> Iterator[list[ServerProcess]]:
    flags = ["--dram-bytes", "1GiB", "--cluster", redis.url, "--cluster-ttl-s", str(TTL_S)]
    flags += ["--cluster-timeout-s", "0.2"]
    with contextlib.ExitStack() as stack:
        nodes = [
            stack.enter_context(serve([*flags, "--node-id", f"n{i}"], log_dir)) for i in range(n)
        ]
        yield nodes


def _run_nodes(n: int, shape: tuple[int, int, int], rounds: int) -> Row:
    num_chains, num_blocks, block_bytes = shape
    ns = _namespace(block_bytes)
    chains = _chains(ns, num_chains, num_blocks)
    total = num_chains * num_blocks * block_bytes
    errors = 0
    with tempfile.TemporaryDirectory() as tmp, redis_server() as redis:
        log_dir = Path(tmp)
        with _pool(n, redis, log_dir) as nodes, serve(["--dram-bytes", "1GiB"], log_dir) as plain:
            commands = _commands(redis)
            started = time.perf_counter()
            for c, keys in enumerate(chains):
                seeds = [x.address for x in nodes[c % n :] + nodes[: c % n]]
                with PoolClient(seeds, read_deadline_s=READ_DEADLINE_S) as writer:
                    ns_id = writer.register_namespace(ns).namespace_id
                    blocks = [_payload(c, b, block_bytes) for b in range(num_blocks)]
                    writer.put_chain(ns_id, keys, blocks)
            put_s = time.perf_counter() - started
            _settle(nodes, ns, chains)
            put_ops = _commands(redis) - commands
            with Client(plain.address) as writer:
                plain_id = writer.register_namespace(ns).namespace_id
                for c, keys in enumerate(chains):
                    blocks = [_payload(c, b, block_bytes) for b in range(num_blocks)]
                    writer.put_chain(plain_id, keys, blocks)
            seeds = [x.address for x in nodes]
            pool_s, plain_s, latencies, wrong = _read_both(seeds, plain.address, ns, chains, rounds)
            errors += wrong
            match_ops, rounds_per_match = _matches(redis, nodes, ns, chains)
    read_bytes = total * rounds
    return {
        "nodes": n,
        "get_gbps": read_bytes / pool_s / 1e9,
        "put_gbps": total / put_s / 1e9,
        "get_p50_ms": statistics.median(latencies) * 1e3,
        "get_p99_ms": _p99(latencies) * 1e3,
        "plain_get_gbps": read_bytes / plain_s / 1e9,
        "get_vs_plain": plain_s / pool_s,
        "redis_rounds_per_match": rounds_per_match,
        "redis_ops_per_match": match_ops,
        "redis_ops_per_put": put_ops / num_chains,
        "errors": errors,
    }


def _commands(redis: RedisServer) -> int:
    info = redis.cli("info", "stats")
    return int(
        next(
            line.split(":")[1]
            for line in info.splitlines()
            if line.startswith("total_commands_processed")
        )
    )


def _settle(nodes: Sequence[ServerProcess], ns: Namespace, chains: list[list[bytes]]) -> None:
    """Waits (bounded) until the last chain is in the index: the puts' filing is counted."""
    deadline = time.monotonic() + 10.0
    with Client(nodes[-1].address) as client:
        ns_id = client.register_namespace(ns).namespace_id
        while client.locate(ns_id, chains[-1]).num_located < len(chains[-1]):
            if time.monotonic() > deadline:
                raise RuntimeError("the pool never filed the chains put")
            time.sleep(0.05)


def _read_both(
    seeds: list[str], plain: str, ns: Namespace, chains: list[list[bytes]], rounds: int
) -> tuple[float, float, list[float], int]:
    """Every chain read `rounds` times through a pool client and from the plain node, the
    two taking turns chain by chain (the machine is shared: both see the same moments of
    it); (pool seconds, plain seconds, pool latencies, blocks wrong)."""
    wrong = 0
    latencies = []
    plain_s = 0.0
    with (
        PoolClient(seeds, read_deadline_s=READ_DEADLINE_S) as pool,
        Client(plain) as client,
    ):
        ns_id = pool.register_namespace(ns).namespace_id
        plain_id = client.register_namespace(ns).namespace_id
        buffers = [np.empty(ns.block_bytes, np.uint8) for _ in chains[0]]
        for _ in range(rounds):
            for c, keys in enumerate(chains):
                t = time.perf_counter()
                found = pool.get_into(ns_id, keys, buffers)
                latencies.append(time.perf_counter() - t)
                wrong += _wrong(c, found, buffers)
                t = time.perf_counter()
                found = client.get_into(plain_id, keys, buffers)
                plain_s += time.perf_counter() - t
                wrong += _wrong(c, found, buffers)
    return sum(latencies), plain_s, latencies, wrong


def _wrong(chain: int, found: Sequence[bool], buffers: Sequence[np.ndarray]) -> int:
    """Blocks missed or read back with other bytes."""
    bad = 0
    for b, (hit, buf) in enumerate(zip(found, buffers, strict=True)):
        bad += not hit or not np.array_equal(buf, _payload(chain, b, buf.nbytes))
    return bad


def _matches(
    redis: RedisServer, nodes: Sequence[ServerProcess], ns: Namespace, chains: list[list[bytes]]
) -> tuple[float, float]:
    """Redis commands and round trips per chain lookup."""
    with Client(nodes[0].address) as client:
        ns_id = client.register_namespace(ns).namespace_id
        before, reports = _commands(redis), client.pool_status()
        for keys in chains:
            client.locate(ns_id, keys)
        ops = (_commands(redis) - before) / len(chains)
        after = client.pool_status()
    num_locates = after.num_locates - reports.num_locates
    rounds = after.num_locate_rounds - reports.num_locate_rounds
    return ops, rounds / num_locates if num_locates else float("nan")


def _p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# -- the trace: hit ratios of a pool vs per-node caches vs one node --------------------------


def _hit_ratios(requests: Sequence[TraceLine], n: int, fraction: float) -> Row:
    distinct = len({h for r in requests for h in r.hash_ids})
    capacity = max(n, int(distinct * fraction))
    return {
        "global_hit_ratio": _replay(requests, n, capacity, shared=True),
        "local_hit_ratio": _replay(requests, n, capacity, shared=False),
        "single_node_hit_ratio": _replay(requests, 1, capacity, shared=True),
    }


def _replay(requests: Sequence[TraceLine], n: int, capacity: int, shared: bool) -> float:
    """The token hit ratio of `requests` served round robin by `n` nodes of capacity/n
    blocks each, a global pool (`shared`) or per-node caches (`PoolModel`)."""
    model = PoolModel(n, capacity // n, shared)
    return hit_ratio(requests, [model.serve(r.hash_ids).num_hit for r in requests], "tokens")


# -- the failure run -------------------------------------------------------------------------


def _kill_run() -> Row:
    ns = _namespace(64 << 10)
    keys = _chains(ns, 1, 32)[0]
    errors, waits = 0, []
    with (
        tempfile.TemporaryDirectory() as tmp,
        redis_server() as redis,
        _pool(2, redis, Path(tmp)) as (victim, survivor),
    ):
        if True:
            with Client(victim.address) as writer:
                ns_id = writer.register_namespace(ns).namespace_id
                writer.put_chain(ns_id, keys, [_payload(0, b, ns.block_bytes) for b in range(32)])
            _settle([survivor], ns, [keys])
            with PoolClient([survivor.address], read_deadline_s=READ_DEADLINE_S) as pool:
                pool.register_namespace(ns)
                buffers = [np.empty(ns.block_bytes, np.uint8) for _ in keys]
                victim.proc.kill()
                killed = time.monotonic()
                while True:
                    t = time.monotonic()
                    try:
                        located = pool.locate(ns_id, keys).num_located
                        pool.get_into(ns_id, keys, buffers)
                    except Exception:  # counted: the target is none
                        errors += 1
                        located = 1
                    waits.append(time.monotonic() - t)
                    if not located or time.monotonic() - killed > 30:
                        break
                seconds_to_miss = time.monotonic() - killed if not located else float("nan")
    return {
        "nodes": 2,
        "seconds_to_miss": seconds_to_miss,
        "max_call_s": max(waits),
        "read_deadline_s": READ_DEADLINE_S,
        "errors": errors,
    }


# -- verdict -----------------------------------------------------------------------------------


def failures(rows: Sequence[Row]) -> list[str]:
    """The targets missed or not measured, in words."""
    missed = []
    for row in rows:
        n, value = row.get("nodes"), _reader(row)
        if row.get("simulated"):  # an estimate: no targets
            continue
        if row.get("errors") != 0:
            missed.append(f"{n} nodes: {row.get('errors')} errors")
        if "seconds_to_miss" in row:
            if not value("seconds_to_miss") <= 3.0:
                missed.append(f"killed node missed after {value('seconds_to_miss'):.2f} s (> 3)")
            if not value("max_call_s") <= value("read_deadline_s") + 0.5:
                missed.append(f"a call waited {value('max_call_s'):.2f} s, past its deadline")
            continue
        if not value("redis_rounds_per_match") <= 1.0:
            missed.append(f"{n} nodes: {value('redis_rounds_per_match')} Redis rounds per match")
        single, local, pool = (
            value(k) for k in ("single_node_hit_ratio", "local_hit_ratio", "global_hit_ratio")
        )
        if not (pool >= 0.95 * single and (n == 1 or pool > local)):
            missed.append(
                f"{n} nodes: global hit ratio {pool:.3f} "
                f"(one node {single:.3f}, per-node caches {local:.3f})"
            )
        if n == 1 and not value("get_vs_plain") >= 0.9:
            missed.append(f"one-node pool's get {value('get_vs_plain'):.2f}x the plain node's")
    return missed


def _reader(row: Row):  # type: ignore[no-untyped-def]
    """`row[name]` as a float; NaN where it is missing (a NaN misses every target)."""

    def value(name: str) -> float:
        got = row.get(name)
        return float(got) if isinstance(got, int | float) else float("nan")

    return value


def exit_status(rows: list[Row]) -> int:
    """1 when a target is missed or unmeasured (listed on stderr), else 0."""
    return verdict.exit_status(failures(rows))
