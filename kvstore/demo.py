"""A short prefix-reuse demo against a live store: users sharing a system prompt, two rounds.

Each request hashes its prompt into block keys, matches them, loads the hit blocks (over
the data plane the client picked: shared memory on the node's host, else TCP or UCX, else
gRPC) straight into arrays, and
"computes" the rest (synthetic KV bytes derived from the key, standing in for prefill),
then publishes the new blocks. Every loaded block is checked against the bytes that were
stored for its key. Against a global pool (`pool=True`) the same goes through
`PoolClient`: matched and loaded from wherever the pool holds the blocks, put as it places
them.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from rich import box
from rich.console import Console
from rich.progress import track
from rich.table import Table

from kvstore.client import Client
from kvstore.client.pool_client import PoolClient
from kvstore.keys import ChainPosition, KVLayout, Namespace, block_keys

DEMO_NAMESPACE = Namespace("demo-llama-tiny", KVLayout("float16", 4, 2, 64, 64))


@dataclass(frozen=True)
class DemoConfig:
    num_users: int = 8
    num_rounds: int = 2
    system_prompt_len: int = 2048
    question_len: int = 320
    answer_len: int = 128
    seed: int = 0


class RequestReport(NamedTuple):
    name: str
    prompt_len: int
    num_blocks: int
    num_hit_blocks: int
    bytes_loaded: int
    bytes_stored: int
    match_ms: float
    load_ms: float
    store_ms: float
    is_intact: bool
    plane: str  # the path the loaded blocks took ("shm", "ucx", "tcp", "grpc"); "" if none


def synthetic_block(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic stand-in for a block's KV bytes: the key's hash stretched to `nbytes`."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _prompts(config: DemoConfig) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(config.seed)
    system = rng.integers(0, 32000, config.system_prompt_len).tolist()
    history = {u: list(system) for u in range(config.num_users)}
    prompts = []
    for r in range(config.num_rounds):
        for u in range(config.num_users):
            history[u] += rng.integers(0, 32000, config.question_len).tolist()
            prompts.append((f"u{u}/r{r}", list(history[u])))
            history[u] += rng.integers(0, 32000, config.answer_len).tolist()
    return prompts


def _serve_request(client: Client | PoolClient, name: str, tokens: list[int]) -> RequestReport:
    ns = DEMO_NAMESPACE
    keys = block_keys(ns, tokens)
    t0 = time.perf_counter()
    num_hit = client.match(ns.id, keys).num_matched
    t1 = time.perf_counter()
    loaded = [np.empty(ns.block_bytes, np.uint8) for _ in range(num_hit)]
    found = client.get_into(ns.id, keys[:num_hit], loaded) if num_hit else ()
    t2 = time.perf_counter()
    plane = "" if not num_hit else client.plane if isinstance(client, Client) else "the pool"
    is_intact = all(found) and all(
        np.array_equal(b, synthetic_block(k, ns.block_bytes))
        for k, b in zip(keys, loaded, strict=False)
    )
    new_keys = keys[num_hit:]
    blocks = [synthetic_block(k, ns.block_bytes) for k in new_keys]
    parent = keys[num_hit - 1] if num_hit else None
    stored = 0
    if new_keys and isinstance(client, PoolClient):
        position = ChainPosition.of(keys, num_hit)
        stored = client.put_chain(ns.id, new_keys, blocks, parent, position).num_stored
    elif new_keys:
        stored = client.put_chain(ns.id, new_keys, blocks, parent).num_stored
    t3 = time.perf_counter()
    return RequestReport(
        name,
        len(tokens),
        len(keys),
        num_hit,
        sum(b.nbytes for b, f in zip(loaded, found, strict=True) if f),
        stored * ns.block_bytes,
        (t1 - t0) * 1e3,
        (t2 - t1) * 1e3,
        (t3 - t2) * 1e3,
        is_intact,
        plane,
    )


def run_demo(
    address: str, config: DemoConfig, console: Console, pool: bool = False
) -> list[RequestReport]:
    """Runs the demo against the store at `address` (with `pool`: the global pool that the
    comma-separated nodes `address` are of) and prints what each request did."""
    seeds = address.split(",")
    with Client(seeds[0]) as home, contextlib.ExitStack() as stack:
        home.wait_ready()
        client = stack.enter_context(PoolClient(seeds)) if pool else home
        client.register_namespace(DEMO_NAMESPACE)
        prompts = _prompts(config)
        reports = [
            _serve_request(client, name, tokens)
            for name, tokens in track(prompts, description="requests", console=console)
        ]
        stats = home.stats()
    planes = ", ".join(sorted({r.plane for r in reports if r.plane})) or "none"
    console.print(_table(reports))
    total_blocks = sum(r.num_blocks for r in reports)
    hit_blocks = sum(r.num_hit_blocks for r in reports)
    loaded = sum(r.bytes_loaded for r in reports)
    load_s = sum(r.load_ms for r in reports) / 1e3
    console.print(
        f"hit blocks {hit_blocks}/{total_blocks} ({hit_blocks / total_blocks:.1%}); "
        f"loaded {loaded / 2**20:.1f} MiB in {load_s * 1e3:.1f} ms "
        f"({loaded / max(load_s, 1e-9) / 1e9:.2f} GB/s over {planes})\n"
        f"stored {sum(r.bytes_stored for r in reports) / 2**20:.1f} MiB; "
        f"{'the first node' if pool else 'store'} holds {stats.num_blocks} blocks, "
        f"{stats.evictions} evictions\n"
        f"all loaded blocks intact: {all(r.is_intact for r in reports)}"
    )
    return reports


def _table(reports: list[RequestReport]) -> Table:
    """Fits an 80-column terminal: short headers, no vertical rules."""
    kib = DEMO_NAMESPACE.block_bytes // 1024
    title = f"prefix reuse, {kib} KiB blocks, times in ms"
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("request", "tokens", "blocks", "hits", "in MiB", "out MiB"):
        table.add_column(col, justify="right")
    for col in ("match", "load", "put", "intact"):
        table.add_column(col, justify="right")
    for r in reports:
        table.add_row(
            r.name,
            str(r.prompt_len),
            str(r.num_blocks),
            str(r.num_hit_blocks),
            f"{r.bytes_loaded / 2**20:.1f}",
            f"{r.bytes_stored / 2**20:.1f}",
            f"{r.match_ms:.1f}",
            f"{r.load_ms:.1f}",
            f"{r.store_ms:.1f}",
            "yes" if r.is_intact else "NO",
        )
    return table
