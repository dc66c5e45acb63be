"""Prometheus metrics: a real `kvstore serve --metrics-port` scraped after a known workload."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.metrics import StoreCollector
from kvstore.node.server import EmbeddedServer, ServerConfig
from kvstore.store import Store, StoreConfig
from tests.conftest import free_port, require_extra, wait_until

DASHBOARD = Path(__file__).parents[2] / "deploy/grafana/kvstore-dashboard.json"

NS = Namespace("metrics-model", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
UNKNOWN_NS = Namespace("never-registered", KVLayout("float16", 4, 2, 64, 16))


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _blocks(keys: list[bytes]) -> list[np.ndarray]:
    return [np.full(NS.block_bytes, i, np.uint8) for i in range(len(keys))]


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def served(store_factory):
    """A store on gRPC only (its bytes are the gRPC plane's), metrics on a free port."""
    port = free_port()
    store = store_factory(
        "--dram-bytes", "64MiB", "--dataplane", "none", "--metrics-port", str(port)
    )
    return store, port


def test_a_scrape_counts_what_the_workload_did(served):
    store, port = served
    keys, missing = _chain(8), _chain(2, seed=5)
    with Client(store.address, timeout_s=10.0) as client:
        client.register_namespace(NS)
        assert client.put_chain(NS.id, keys, _blocks(keys)).num_stored == 8
        assert client.put_chain(NS.id, keys, _blocks(keys)).num_present == 8
        assert client.get(NS.id, [*keys, *missing]).found == (True,) * 8 + (False,) * 2
        with pytest.raises(errors.UnknownNamespaceError):
            client.match(UNKNOWN_NS.id, keys)
        assert client.remove(NS.id, keys[6:]) == 2
    with grpc.insecure_channel(store.address) as channel:  # bytes that are no MatchRequest
        match = channel.unary_unary("/kvstore.v1.KVStore/Match")
        with pytest.raises(grpc.RpcError):
            match(b"\xff\xff\xff", timeout=10)
    rejected = "kvstore_rejected_requests_total"
    malformed = {"plane": "grpc", "method": "Match", "error": "InvalidArgumentError"}
    # gRPC's abort sends the status before the handler's timing ends: the caller may see its
    # error a moment before the node has counted it.
    what = "the node counts the malformed call"

    def counted() -> dict | None:
        samples = _scrape(port)
        return samples if _value(samples, rejected, **malformed) else None

    m = wait_until(counted, 10.0, what)
    block_tokens = NS.block_tokens
    assert _value(m, "kvstore_committed_blocks_total") == 8
    assert _value(m, "kvstore_committed_bytes_total") == 8 * NS.block_bytes
    assert _value(m, "kvstore_hit_blocks_total", tier="dram") == 8
    assert _value(m, "kvstore_hit_tokens_total", tier="dram") == 8 * block_tokens
    assert _value(m, "kvstore_miss_blocks_total") == 2
    assert _value(m, "kvstore_miss_tokens_total") == 2 * block_tokens
    assert _value(m, "kvstore_blocks") == 6
    assert _value(m, "kvstore_tier_blocks", tier="dram") == 6
    assert _value(m, "kvstore_tier_capacity_bytes", tier="dram") == 64 << 20
    assert _value(m, "kvstore_reservations") == _value(m, "kvstore_leases") == 0
    assert _value(m, rejected, plane="grpc", method="Match", error="UnknownNamespaceError") == 1
    assert _value(m, rejected, **malformed) == 1
    assert _value(m, rejected, plane="grpc", method="Get", error="UnknownNamespaceError") == 0
    calls = "kvstore_request_duration_seconds_count"
    assert _value(m, calls, plane="grpc", method="Get") == 1
    assert _value(m, calls, plane="grpc", method="Match") == 2
    assert _value(m, calls, plane="grpc", method="Remove") == 1
    sent = _value(m, "kvstore_sent_bytes_total", plane="grpc", method="Get")
    assert 8 * NS.block_bytes < sent < 8 * NS.block_bytes + 4096  # the blocks, and framing
    received = _value(m, "kvstore_received_bytes_total", plane="grpc", method="Write")
    assert 8 * NS.block_bytes < received < 8 * NS.block_bytes + 4096  # written once: dedup


def test_metrics_are_off_unless_asked_for(store_factory):
    store = store_factory("--dram-bytes", "16MiB")
    assert "event=metrics_on" not in store.log()


def test_the_collector_reads_one_stats_snapshot_per_scrape():
    with Store(StoreConfig(dram_bytes=16 * NS.block_bytes, slab_bytes=4 * NS.block_bytes)) as st:
        st.register_namespace(NS)
        keys = _chain(3)
        res = st.reserve(NS.id, keys)
        for i, block in enumerate(_blocks(keys)):
            res.write(i, 0, block.tobytes())
        res.commit()
        st.read(NS.id, keys[:2])
        samples = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in StoreCollector(st.stats).collect()
            for s in family.samples
        }
    assert _value(samples, "kvstore_blocks") == 3
    assert _value(samples, "kvstore_hit_blocks_total", tier="dram") == 2
    assert _value(samples, "kvstore_tier_used_bytes", tier="dram") == st.stats().tiers[0].used_bytes


def test_stats_watch_shows_tiers_and_rates_in_80_columns(store_factory):
    store = store_factory("--dram-bytes", "64MiB")
    keys = _chain(4)
    with Client(store.address, timeout_s=10.0) as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, keys, _blocks(keys))
    cmd = [sys.executable, "-m", "kvstore.cli", "stats", "--address", store.address]
    cmd += ["--watch", "--count", "2", "--interval-s", "0.1"]
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True, env=env)
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert any(line.split()[:1] == ["4"] for line in lines)  # the node row: 4 blocks
    dram = next(line.split() for line in lines if line.split()[:1] == ["dram"])
    assert dram[1:3] == [f"{4 * NS.block_bytes / 2**20:.1f}", "64.0"]  # used and capacity MiB


def test_the_grafana_dashboard_queries_only_what_a_server_exports(served):
    store, port = served
    keys = _chain(2)
    with Client(store.address, timeout_s=10.0) as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, keys, _blocks(keys))
        client.get(NS.id, keys)
        with pytest.raises(errors.UnknownNamespaceError):
            client.match(UNKNOWN_NS.id, keys)
    exported = {name for name, _ in _scrape(port)}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"\bkvstore_\w+", expr)}
    assert len(queried) >= 20
    assert queried <= exported, queried - exported


def test_the_data_plane_counts_its_calls_bytes_and_refusals(store_factory):
    require_extra("ucxx")
    port = free_port()
    store = store_factory("--dram-bytes", "64MiB", "--metrics-port", str(port))
    keys = _chain(4)
    into = [np.empty(NS.block_bytes, np.uint8) for _ in keys]
    with Client(store.address, timeout_s=10.0, transport="ucx") as client:
        client.register_namespace(NS)
        assert client.put_chain(NS.id, keys, _blocks(keys)).num_stored == 4
        assert client.get_into(NS.id, keys, into) == (True,) * 4
        with pytest.raises(errors.UnknownNamespaceError):
            client.get_into(UNKNOWN_NS.id, keys[:1], into[:1])
    # A call is timed once its last reply is sent: the client may have it a moment before.
    calls = "kvstore_request_duration_seconds_count"
    wait_until(lambda: _value(_scrape(port), calls, plane="ucx", method="get") == 2, 10.0, "timed")
    m = _scrape(port)
    assert (
        _value(m, "kvstore_received_bytes_total", plane="ucx", method="put") == 4 * NS.block_bytes
    )
    assert _value(m, "kvstore_sent_bytes_total", plane="ucx", method="get") == 4 * NS.block_bytes
    assert _value(m, "kvstore_request_duration_seconds_count", plane="ucx", method="get") == 2
    assert _value(m, "kvstore_request_duration_seconds_count", plane="ucx", method="put") >= 1
    rejected = "kvstore_rejected_requests_total"
    assert _value(m, rejected, plane="ucx", method="get", error="UnknownNamespaceError") == 1
    assert _value(m, "kvstore_sent_bytes_total", plane="grpc", method="Get") == 0  # none via gRPC


def test_an_embedded_node_exports_its_bounds_from_the_start():
    """Stream slots and every socket-accepting plane's unproven sockets are on /metrics
    before anything is open (an empty pool is still a pool)."""
    config = ServerConfig(port=0, dataplane="tcp", metrics_port=free_port())
    with EmbeddedServer(StoreConfig(dram_bytes=16 << 20, slab_bytes=1 << 20), config) as node:
        samples = _scrape(node.metrics_port)
    names = {name for name, _ in samples}
    assert ("kvstore_unproven_sockets", frozenset({("plane", "tcp")})) in samples
    assert ("kvstore_open_streams", frozenset({("service", "kvstore")})) in samples
    assert {"kvstore_shed_sockets_total", "kvstore_refused_streams_total"} <= names
