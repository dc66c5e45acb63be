"""KVStoreConnector on a global pool (`kvstore.pool`) in real vLLM processes (CPU): two nodes
on one real Redis, and a third that joins later.

Needs vLLM: `make test` runs this file in .venv-vllm with KVSTORE_REQUIRE_VLLM=1, where a
missing vLLM fails; elsewhere it is skipped.
"""

from __future__ import annotations

import os
import re

import pytest

if not os.environ.get("KVSTORE_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

from kvstore.bench.redis_servers import redis_server
from kvstore.bench.vllm_model import build_model
from kvstore.client import Client
from kvstore.client.pool_client import PoolClient
from kvstore.keys import CHAIN_GROUP_BLOCKS, Namespace, block_keys
from tests.conftest import wait_until
from tests.integrations.vllm.test_connector import BLOCK, _namespace
from tests.integrations.vllm.vllm_fixtures import prompt_tokens, run_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

HEAD = CHAIN_GROUP_BLOCKS + 8  # blocks of the first prompt: two chain groups, two pieces
PROMPT = prompt_tokens(seed=3, length=HEAD * BLOCK + 5)
LONGER = PROMPT[: HEAD * BLOCK] + prompt_tokens(seed=4, length=6 * BLOCK + 5)  # 6 blocks more


def _serve(store_factory, redis_url: str, node_id: str):
    return store_factory(
        "--dram-bytes", "64MiB", "--slab-bytes", "1MiB", "--cluster", redis_url,
        "--node-id", node_id, "--cluster-ttl-s", "2", "--cluster-timeout-s", "0.2",
    )  # fmt: skip


def _pool_spec(model: str, seeds: list[str], *turns: list[int]) -> dict:
    return {
        "model": model,
        "connector": "kvstore",
        "store": ",".join(seeds),
        "connector_extra": {"kvstore.pool": True, "kvstore.log_level": "DEBUG"},
        "sessions": [{"turns": [turn]} for turn in turns],
    }


def _located(seed: str, ns: Namespace, keys: list[bytes]) -> int:
    with PoolClient([seed]) as pool:
        return pool.locate(pool.register_namespace(ns).namespace_id, keys).num_located


def test_a_fresh_engine_beside_a_node_that_holds_nothing_loads_a_prefix_from_the_pool(
    store_factory, tmp_path
):
    """An engine beside n1 computes a prompt of two chain groups; its blocks are placed over
    n1 and n2. An engine beside n0, a node that joined after and holds none of them, loads
    all of them from the pool (staged, from every holder at once) with the writer's output,
    computes 6 more blocks of a longer prompt and publishes them after the loaded head (a
    stated chain position): any node then finds the whole longer chain in one lookup."""
    model = str(build_model(tmp_path / "tiny"))
    ns = _namespace(model)
    with redis_server() as redis:
        n1, n2 = (_serve(store_factory, redis.url, name) for name in ("n1", "n2"))
        writer = run_vllm(tmp_path, "writer", **_pool_spec(model, [n1.address, n2.address], PROMPT))
        assert writer.cached_tokens == [0]
        assert f"event=publish_stats published={HEAD} dropped=0 failed=0" in writer.log
        keys = block_keys(ns, PROMPT)[:HEAD]
        wait_until(
            lambda: _located(n2.address, ns, keys) == HEAD, 10.0, "the pool filed the prompt"
        )

        n0 = _serve(store_factory, redis.url, "n0")  # holds nothing: every block is remote
        with Client(n0.address, transport="grpc") as c:
            assert c.register_namespace(ns) and c.match(ns.id, keys).num_matched == 0
        spec = _pool_spec(model, [n0.address], PROMPT, LONGER)
        reader = run_vllm(tmp_path, "reader", **spec)
        assert reader.cached_tokens == [HEAD * BLOCK, HEAD * BLOCK]
        assert reader.outputs[0] == writer.outputs[0]
        assert "event=load_incomplete" not in reader.log
        loads = re.findall(r"event=load_phases req=\S+ mode=(\w+) .* blocks=(\d+) ", reader.log)
        assert ("remote", str(HEAD)) in loads
        assert re.search(r"event=publish_stats published=6 dropped=0 failed=0", reader.log)

        longer = block_keys(ns, LONGER)[: HEAD + 6]
        for seed in (n0.address, n1.address, n2.address):
            wait_until(lambda s=seed: _located(s, ns, longer) == HEAD + 6, 10.0, "the whole chain")
