"""Two `kvstore engine` processes on two nodes of one pool (`--store-pool`): what the first
computes and publishes to its node, the second loads from that node through its own node's
lookup, with the same output; and with that node SIGKILLed the second engine still answers
the same tokens, recomputing (a node's failure never raises in an engine). An engine whose
own cache holds a prompt's head loads the rest from the pool, put on another node than the
head's at its stated place in the chain. `kvstore demo --store-pool` runs on a pool as on
one node."""

from __future__ import annotations

import subprocess
import sys

from gpu_engine.sampling import SamplingParams
from kvstore.client import Client
from tests.cluster.test_pool_nodes import _serve
from tests.conftest import wait_until
from tests.engine.test_engine_service import BLOCK, ENGINE_FLAGS, _prompt

GREEDY = SamplingParams(max_tokens=5)


def test_an_engine_loads_what_another_published_on_another_node(
    store_factory, engine_factory, redis_single
):
    n1, n2 = (_serve(store_factory, redis_single.url, name) for name in ("n1", "n2"))
    first = engine_factory("--store", n1.address, "--store-pool", *ENGINE_FLAGS)
    second = engine_factory("--store", n2.address, "--store-pool", *ENGINE_FLAGS)
    prompt = _prompt(7, 6 * BLOCK + 3)

    out = first.generate(prompt, GREEDY)
    wait_until(lambda: first.load().num_pending_blocks == 0, 30.0, "blocks published")
    with Client(n1.address, transport="grpc") as c:
        assert c.stats().num_blocks >= 6  # on the first engine's node
        wait_until(lambda: c.pool_status().num_published >= 6, 5.0, "filed in the index")
    with Client(n2.address, transport="grpc") as c:
        assert c.stats().num_blocks == 0  # none on the second's

    loaded = second.generate(prompt, GREEDY)
    assert loaded.usage.store_cached_tokens == 6 * BLOCK  # read from n1
    assert loaded.output_token_ids == out.output_token_ids

    n1.kill()
    again = second.generate(prompt, GREEDY)  # its blocks located on a dead node, or not
    assert again.output_token_ids == out.output_token_ids
    assert second.load().num_running == 0


def test_an_engine_loads_the_rest_of_a_prompt_whose_head_it_holds(
    store_factory, engine_factory, redis_single
):
    n1, n2 = (_serve(store_factory, redis_single.url, name) for name in ("n1", "n2"))
    first = engine_factory("--store", n1.address, "--store-pool", *ENGINE_FLAGS)
    second = engine_factory("--store", n2.address, "--store-pool", *ENGINE_FLAGS)
    head = _prompt(8, 3 * BLOCK)
    prompt = head + _prompt(9, 3 * BLOCK + 3)

    second.generate(head + _prompt(10, BLOCK + 1), GREEDY)  # its own cache holds the head
    wait_until(lambda: second.load().num_pending_blocks == 0, 30.0, "the head published")
    with Client(n2.address, transport="grpc") as c:
        wait_until(lambda: c.pool_status().num_published >= 4, 5.0, "the head filed")
    out = first.generate(prompt, GREEDY)  # the head from n2; the rest computed, put on n1
    assert out.usage.store_cached_tokens == 3 * BLOCK
    wait_until(lambda: first.load().num_pending_blocks == 0, 30.0, "the rest published")
    with Client(n1.address, transport="grpc") as c:
        wait_until(lambda: c.pool_status().num_published >= 3, 5.0, "the rest filed")
        assert c.stats().num_blocks == 3  # its parent is on n2: put at its stated place

    loaded = second.generate(prompt, GREEDY)  # the head from its cache, the rest from n1
    assert loaded.usage.store_cached_tokens == 3 * BLOCK
    assert loaded.output_token_ids == out.output_token_ids


def test_the_demo_runs_on_a_pool(store_factory, redis_single):
    n1, n2 = (_serve(store_factory, redis_single.url, name) for name in ("n1", "n2"))
    with Client(n1.address, transport="grpc") as c:
        wait_until(lambda: len(c.pool_status().members) == 2, 10.0, "both nodes members")
    seeds = f"{n1.address},{n2.address}"
    cmd = [sys.executable, "-m", "kvstore.cli", "demo", "--store", seeds, "--store-pool"]
    out = subprocess.run([*cmd, "--users", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "hit blocks 106/162" in text  # as on one node (tests/test_demo.py)
    assert "all loaded blocks intact: True" in text
    held = []
    for node in (n1, n2):
        with Client(node.address, transport="grpc") as c:
            held.append(c.stats().num_blocks)
    assert sum(held) == 162 - 106  # every block computed was put once, on one node or other
