"""Nodes of one pool as real `kvstore serve --cluster` processes on a real Redis: a chain one
node holds is located through any node, with the holder's address; a SIGKILLed node's blocks
are misses within its TTL (the seconds measured) and never errors; a node restarted on its
SSD is found again under a new generation, with nothing of the old one answered; tenants
learn nothing of each other's blocks through the index; and a node whose Redis is gone
answers from its own blocks, degraded."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import wait_until

NS = Namespace("pool-model", KVLayout("float16", 2, 2, 16, 4))  # 1 KiB blocks
TTL_S = 1.0


def _serve(store_factory, redis_url: str, node_id: str, *extra: str, client=None):
    return store_factory(
        "--dram-bytes", "16MiB", "--slab-bytes", "1MiB", "--cluster", redis_url,
        "--node-id", node_id, "--cluster-ttl-s", str(TTL_S), "--cluster-timeout-s", "0.2",
        *extra, client=client,
    )  # fmt: skip


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, [seed * 10_000 + t for t in range(n * NS.block_tokens)])


def _put(address: str, keys: list[bytes], **client) -> None:
    with Client(address, transport="grpc", **client) as c:
        ns_id = c.register_namespace(NS).namespace_id
        c.put_chain(
            ns_id, keys, [np.full(NS.block_bytes, i % 251, np.uint8) for i in range(len(keys))]
        )


def _located(address: str, keys: list[bytes], **client):
    with Client(address, transport="grpc", timeout_s=5.0, **client) as c:
        return c.locate(c.register_namespace(NS).namespace_id, keys)


def _holders(located) -> list[list[str]]:
    return [[located.nodes[n].node_id for n, _ in block] for block in located.blocks]


def test_a_chain_is_located_through_any_node(store_factory, redis_single):
    n1 = _serve(store_factory, redis_single.url, "n1")
    n2 = _serve(store_factory, redis_single.url, "n2")
    keys = _chain(40)
    _put(n1.address, keys)
    located = wait_until(
        lambda: (lambda found: found if found.num_located == 40 else None)(
            _located(n2.address, keys)
        ),
        5.0,
        "n1's blocks in the index",
    )
    assert _holders(located) == [["n1"]] * 40
    assert located.nodes[0].addresses["grpc"] == n1.address
    assert not located.degraded
    with Client(n2.address, transport="grpc") as c:
        report = c.pool_status()
        wait_until(
            lambda: any(m.held.get("dram") for m in c.pool_status().members), 5.0, "n1's held"
        )
    assert report.in_pool and report.redis_ok and report.node_id == "n2"
    assert report.num_locates >= 1 and report.num_locate_rounds == report.num_locates  # one each
    assert {m.node_id for m in report.members} == {"n1", "n2"}
    cmd = [sys.executable, "-m", "kvstore.cli", "stats", "--cluster", "--address", n2.address]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout
    assert "in_pool=True" in out and "redis_ok=True" in out
    n1_line = next(line for line in out.splitlines() if line.startswith("member=n1 "))
    assert n1_line.startswith(f"member=n1 grpc={n1.address} dram_bytes={16 << 20} ssd_bytes=0")
    assert int(n1_line.split("held_dram_bytes=")[1].split()[0]) >= 40 * NS.block_bytes
    assert "sampled_blocks=40 holders_1=40" in out  # every block, one live holder each


def test_a_killed_nodes_blocks_are_misses_within_its_ttl(store_factory, redis_single):
    n1 = _serve(store_factory, redis_single.url, "n1")
    n2 = _serve(store_factory, redis_single.url, "n2")
    keys = _chain(8)
    _put(n1.address, keys)
    wait_until(lambda: _located(n2.address, keys).num_located == 8, 5.0, "published")
    with Client(n2.address, transport="grpc", timeout_s=5.0) as c:
        ns_id = c.register_namespace(NS).namespace_id
        n1.kill()
        killed = time.monotonic()
        while c.locate(ns_id, keys).num_located:  # every answer a hit or a miss, no error
            assert time.monotonic() - killed < 3 * TTL_S, "still located"
        seconds_to_miss = time.monotonic() - killed
    assert seconds_to_miss <= TTL_S + 0.5


def test_a_restarted_node_is_found_again_under_a_new_generation(
    store_factory, redis_single, tmp_path
):
    small = ("--ssd-path", str(tmp_path / "ssd"), "--ssd-bytes", "64MiB")
    # 128 blocks of DRAM: a put of 64 new ones finds room while a demotion pass pins some
    small += ("--dram-bytes", "128KiB", "--slab-bytes", "64KiB")
    n1 = _serve(store_factory, redis_single.url, "n1", *small)
    n2 = _serve(store_factory, redis_single.url, "n2")
    keys, later = _chain(512), _chain(256, seed=1)
    for chain in (keys, later):  # `later` pushes all of `keys` out of DRAM, onto SSD
        for i in range(0, len(chain), 64):
            _put(n1.address, chain[: i + 64])
    with Client(n1.address, transport="grpc") as c:
        before = c.pool_status().generation
        wait_until(lambda: _ssd_blocks(c) >= 512 + 256 - 128, 10.0, "blocks written to SSD")
    n1.kill()
    n1 = _serve(store_factory, redis_single.url, "n1", *small)
    with Client(n1.address, transport="grpc") as c:
        survived = c.match(c.register_namespace(NS).namespace_id, keys).num_matched
        assert c.pool_status().generation != before
    assert survived == 512  # what was on SSD; what was in DRAM only is gone
    wait_until(lambda: _located(n2.address, keys).num_located == survived, 5.0, "republished")


def _ssd_blocks(client: Client) -> int:
    return next(t.num_blocks for t in client.stats().tiers if t.name == "ssd")


def test_tenants_learn_nothing_of_each_others_blocks(store_factory, redis_single, tmp_path):
    tokens, secret = tmp_path / "tokens", tmp_path / "secret"
    tokens.write_text(f"alice {'a' * 24}\nbob {'b' * 24}\n")
    secret.write_text("ab" * 32)
    auth = ("--auth-token-file", str(tokens), "--tenant-secret-file", str(secret))
    alice, bob = {"auth_token": "a" * 24}, {"auth_token": "b" * 24}
    n1 = _serve(store_factory, redis_single.url, "n1", *auth, client=alice)
    n2 = _serve(store_factory, redis_single.url, "n2", *auth, client=alice)
    keys = _chain(6)
    _put(n1.address, keys, **alice)
    wait_until(lambda: _located(n2.address, keys, **alice).num_located == 6, 5.0, "alice's")
    assert _located(n2.address, keys, **bob).num_located == 0
    assert _located(n1.address, keys, **bob).num_located == 0
    with Client(n2.address, transport="grpc", **bob) as c:
        report = c.pool_status(sample_blocks=100)  # what nodes hold is not a tenant's to see
    assert report.holders_sampled == {} and all(not m.held for m in report.members)


def test_a_cluster_node_with_tokens_needs_the_shared_tenant_secret(tmp_path, redis_single):
    from tests.conftest import start_store

    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {'a' * 24}\n")
    with pytest.raises(RuntimeError, match="tenant-secret-file"):
        start_store(tmp_path, "--cluster", redis_single.url, "--auth-token-file", str(tokens))


def test_without_redis_a_node_answers_its_own_blocks_degraded(store_factory, redis_single):
    n1 = _serve(store_factory, redis_single.url, "n1")
    keys = _chain(5)
    _put(n1.address, keys)
    redis_single.stop()
    located = _located(n1.address, keys)
    assert located.degraded and located.num_located == 5
    with Client(n1.address, transport="grpc") as c:
        ns_id = c.register_namespace(NS).namespace_id
        assert c.get(ns_id, keys).num_found == 5  # it serves what it holds
        report = wait_until(
            lambda: (lambda r: r if not r.redis_ok else None)(c.pool_status()), 5.0, "degraded"
        )
    assert report.last_error
