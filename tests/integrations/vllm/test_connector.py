"""KVStoreConnector in real vLLM processes (CPU) against a real store.

Needs vLLM: `make test` runs this file in .venv-vllm with KVSTORE_REQUIRE_VLLM=1, where a
missing vLLM fails; elsewhere it is skipped.
"""

from __future__ import annotations

import os
import re

import pytest

if not os.environ.get("KVSTORE_REQUIRE_VLLM"):
    pytest.importorskip("vllm")

from kvstore.bench.vllm_model import SIZES, build_model
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store import StoreConfig
from tests.conftest import free_port
from tests.integrations.vllm.vllm_fixtures import corrupt_ssd_blocks, prompt_tokens, run_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
PROMPT = prompt_tokens(seed=1, length=10 * BLOCK + 5)  # 10 full blocks and a tail
LOADABLE = 10 * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_model(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture(scope="module")
def reference(model: str, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """Greedy output without any connector."""
    run = run_vllm(
        tmp_path_factory.mktemp("ref"),
        "ref",
        model=model,
        connector="recompute",
        sessions=[{"turns": [PROMPT]}],
    )
    return run.outputs[0]


def _namespace(model: str) -> Namespace:
    """The namespace the connector names the tiny model's blocks by (`namespace_for`)."""
    shape = SIZES["tiny"]
    layout = KVLayout("float32", shape.layers, shape.kv_heads, shape.hidden // shape.heads, BLOCK)
    return Namespace(f"vllm/cpu/{model}", layout)


def _kvstore(model: str, address: str, *sessions: dict) -> dict:
    return {"model": model, "connector": "kvstore", "store": address, "sessions": list(sessions)}


def test_fresh_process_loads_prefix_another_stored_and_recomputes_corrupt_blocks(
    model, reference, store_factory, tmp_path
):
    """One writer process, then two fresh readers: one loads (layer by layer, straight into
    vLLM's pages), one (staged, through the load pool) finds the blocks corrupt.

    The store's DRAM holds the prefix's 10 blocks, and watermarks near zero demote them all
    to SSD, so the loads come from SSD and a restart keeps them.
    """
    ssd = tmp_path / "ssd"
    flags = ("--dram-bytes", "320KiB", "--slab-bytes", "32KiB", "--ssd-path", str(ssd))
    flags += ("--ssd-bytes", "64MiB")
    demote = ("--dram-high-watermark", "0.05", "--dram-low-watermark", "0.01")
    store = store_factory(*flags, *demote, "--background-demotion", "false")
    first = run_vllm(tmp_path, "first", **_kvstore(model, store.address, {"turns": [PROMPT]}))
    assert first.cached_tokens == [0]
    assert first.outputs == [reference]
    assert "event=publish_stats published=10 dropped=0 failed=0" in first.log
    spec = _kvstore(model, store.address, {"turns": [PROMPT]}, {"turns": [PROMPT], "salt": "b"})
    spec["connector_extra"] = {"kvstore.load_buffers": 4, "kvstore.log_level": "DEBUG"}
    second = run_vllm(tmp_path, "second", **spec)
    assert second.cached_tokens == [LOADABLE, 0]  # another tenant's salt never hits
    assert second.outputs == [reference, reference]
    assert "event=load_incomplete" not in second.log
    warm_up = r"event=load_warm_up connect_ms=\S+ share_ms=\S+ stage_ms=\S+ .* shared_bytes=(\d+)"
    found = re.search(warm_up, second.log)
    assert found and int(found.group(1)) > 0  # vLLM's pages shared with the node
    load = r"event=load_phases req=s0t0\S* mode=by_layer connect_ms=.* transfer_ms=.* blocks=10 "
    assert re.search(load, second.log)
    assert "scatter_ms" not in second.log  # no staging: straight into the pages
    assert re.search(r"event=load_stats loads=1 .* blocks=10 ", second.log)

    assert store.stop() == 0
    assert corrupt_ssd_blocks(ssd) > 0
    store = store_factory(*flags)
    # Four staging blocks: the blocks land in chunks of 2, pipelined with the copies.
    spec = _kvstore(model, store.address, {"turns": [PROMPT]})
    extra = {"kvstore.load_by_layer": False, "kvstore.share_pages": False}
    spec["connector_extra"] = extra | {"kvstore.load_buffers": 4}
    third = run_vllm(tmp_path, "third", **spec)
    assert third.outputs == [reference]
    assert "event=load_incomplete" in third.log


@pytest.mark.parametrize("transport", ["ucx", "tcp", "shm"])
def test_a_block_failing_its_checksum_after_the_forward_read_it_never_yields_a_token(
    model, reference, tmp_path, transport
):
    """Layer by layer over UCX or TCP, a block's CRC32C is known only once its last layer is in,
    after the forward pass has read its first layers: the connector reports it failed after
    the step, vLLM drops that step's output and recomputes from the block, and the output is
    the reference. Over shared memory (same host) a call's layers land together, checked,
    and the connector reports the same. The node is in this process, to flip a byte of a
    block's last layer."""
    store_config = StoreConfig(dram_bytes=64 << 20, slab_bytes=1 << 20)
    node = EmbeddedServer(store_config, ServerConfig(port=0))
    with node:
        writer = run_vllm(tmp_path, "writer", **_kvstore(model, node.address, {"turns": [PROMPT]}))
        assert writer.outputs == [reference]
        ns = _namespace(model)
        keys = block_keys(ns, PROMPT)[:10]
        assert all(node.store.has_key(ns.id, k) for k in keys), "the writer published them"
        lease = node.store.acquire(ns.id, [keys[5]])
        lease.views[0][-1] ^= 0xFF  # block 5's last layer, behind the store's back
        lease.release()
        spec = _kvstore(model, node.address, {"turns": [PROMPT]})
        spec["connector_extra"] = {"kvstore.transport": transport}
        reader = run_vllm(tmp_path, "reader", **spec)
    assert reader.outputs == [reference]
    assert f"event={transport}_checksum_failure" in reader.log
    assert re.search(r"event=load_incomplete req=s0t0\S* loaded=5 failed=5", reader.log)
    assert "Recovered from KV load failure: 1 request(s) rescheduled" in reader.log


def test_store_down_recomputes_and_says_so(model, reference, tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens here
    run = run_vllm(tmp_path, "down", **_kvstore(model, address, {"turns": [PROMPT]}))
    assert run.outputs == [reference]
    assert run.cached_tokens == [0]
    assert "event=register_failed" in run.log


def test_full_staging_drops_blocks_counts_them_and_never_continues_the_cut_chain(
    model, reference, store, tmp_path
):
    """Two staging blocks, prefill in chunks of 8 blocks: the first chunk publishes 2 blocks
    and drops 6, the second continues the cut chain and is dropped whole; outputs stay."""
    spec = _kvstore(model, store.address, {"turns": [PROMPT]})
    spec |= {"connector_extra": {"kvstore.publish_buffers": 2}, "max_num_batched_tokens": 8 * BLOCK}
    run = run_vllm(tmp_path, "drops", **spec)
    assert run.outputs == [reference]
    drops = re.findall(r"event=save_dropped req=\S+ blocks=(\d+) staged=(\d+)", run.log)
    assert drops == [("8", "2"), ("2", "0")]
    assert "event=publish_stats published=2 dropped=8 failed=0" in run.log
    with Client(store.address) as client:
        assert client.stats().num_blocks == 2  # the published prefix, nothing past the cut
