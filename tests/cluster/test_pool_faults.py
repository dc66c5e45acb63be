"""Faults of a pool over real nodes and a real Redis: a writer that dies mid-put is never in
the index and its reservation is reclaimed; a frozen Redis (SIGSTOP) leaves every node
serving its own blocks, each lookup answered degraded within a bounded time, and the index
back once Redis thaws; a malformed cluster setting stops `serve` with a typed error."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from kvstore.client import Client
from tests.cluster.test_pool_nodes import NS, _chain, _located, _serve
from tests.conftest import wait_until


def test_a_writer_dead_mid_put_is_never_located_and_its_space_comes_back(
    store_factory, redis_single
):
    n1 = _serve(store_factory, redis_single.url, "n1", "--reservation-timeout-s", "1")
    n2 = _serve(store_factory, redis_single.url, "n2")
    keys = _chain(8)
    writer = Client(n1.address, transport="grpc")
    ns_id = writer.register_namespace(NS).namespace_id
    reserved = writer.reserve(ns_id, keys, [None, *keys[:-1]])
    writer.write(reserved.reservation_id, [(0, np.ones(NS.block_bytes, np.uint8))])
    writer.close()  # gone without a commit or an abort, as a killed writer is
    with Client(n1.address, transport="grpc") as c:
        wait_until(lambda: c.stats().num_reservations == 0, 10.0, "the reservation reclaimed")
        assert c.stats().num_blocks == 0
    assert _located(n2.address, keys).num_located == 0
    assert _located(n1.address, keys).num_located == 0


def test_a_frozen_redis_leaves_every_node_serving_its_own(store_factory, redis_single):
    n1 = _serve(store_factory, redis_single.url, "n1")
    keys = _chain(6)
    with Client(n1.address, transport="grpc", timeout_s=5.0) as c:
        ns_id = c.register_namespace(NS).namespace_id
        c.put_chain(ns_id, keys, [np.full(NS.block_bytes, i, np.uint8) for i in range(6)])
        wait_until(lambda: not c.locate(ns_id, keys).degraded, 5.0, "in the index")
        redis_single.freeze()
        try:
            for _ in range(5):
                started = time.monotonic()
                located = c.locate(ns_id, keys)
                assert time.monotonic() - started < 1.0  # one Redis timeout (0.2 s) at most
                assert located.degraded and located.num_located == 6
            assert c.get(ns_id, keys).num_found == 6
            report = wait_until(
                lambda: (lambda r: r if r.fenced else None)(c.pool_status()), 5.0, "fenced"
            )
            assert not report.redis_ok
        finally:
            redis_single.thaw()
        wait_until(
            lambda: (lambda found: not found.degraded and found.num_located == 6)(
                c.locate(ns_id, keys)
            ),
            10.0,
            "filed again once Redis is back",
        )


def test_a_malformed_cluster_setting_stops_serve_with_a_typed_error():
    for url, said in [("http://x:1", "not a Redis URL"), ("redis+cluster://a,b", "HOST:PORT")]:
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--cluster", url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert "InvalidArgumentError: " in done.stderr and said in done.stderr
