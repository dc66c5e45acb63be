"""Nodes as separate hosts: each `kvstore serve --cluster` runs in a network namespace this
test creates, joined to this one by a veth pair, so every byte between the client and a node
crosses a real network stack between distinct addresses (no shared memory, no loopback).
Redis runs here, on the veths' near ends. Every address is checked to route through the
test's own veth before anything connects to it.

A chain held by one host is read from another host's lookup over the TCP plane, byte for
byte; then that host is partitioned (its link set down, the process alive): within its TTL
its blocks are misses, reads of it end within the read deadline, and the seconds to miss
are measured."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench.redis_servers import redis_server
from kvstore.client import Client
from kvstore.client.pool_client import PoolClient
from tests.cluster.test_pool_nodes import NS, _chain
from tests.conftest import wait_until

TTL_S = 1.0
DEADLINE_S = 1.0
SUBNET = f"10.{200 + os.getpid() % 50}"  # 10.2xx.H.0/30 per host H


@dataclass
class Host:
    name: str  # its network namespace
    near: str  # this namespace's end of the veth
    far: str  # the host's address
    veth: str  # the near end's device


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _routes_through(address: str, device: str) -> None:
    """Refuses to go on unless `address` routes through our own veth `device`: an unrouted
    private address would leave the machine."""
    out = subprocess.run(["ip", "route", "get", address], capture_output=True, text=True).stdout
    assert f"dev {device}" in out, f"{address} does not route through {device}: {out}"


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    made: list[Host] = []
    try:
        for h in (1, 2):
            host = Host(f"kvh{h}-{os.getpid()}", f"{SUBNET}.{h}.1", f"{SUBNET}.{h}.2", f"kvv{h}")
            _ip("netns", "add", host.name)
            made.append(host)
            _ip(
                "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.name
            )
            _ip("addr", "add", f"{host.near}/30", "dev", host.veth)
            _ip("link", "set", host.veth, "up")
            inside = ("netns", "exec", host.name, "ip")
            _ip(*inside, "addr", "add", f"{host.far}/30", "dev", "eth0")
            _ip(*inside, "link", "set", "eth0", "up")
            _ip(*inside, "link", "set", "lo", "up")
            _routes_through(host.far, host.veth)
        yield made
    finally:
        for host in made:
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)


@dataclass
class HostNode:
    proc: subprocess.Popen
    address: str
    log: Path


def _serve_on(host: Host, redis_port: int, tmp_path: Path) -> HostNode:
    log = tmp_path / f"{host.name}.log"
    cmd = [
        "ip", "netns", "exec", host.name, sys.executable, "-m", "kvstore.cli", "serve",
        "--host", host.far, "--port", "0", "--dataplane", "tcp", "--dram-bytes", "16MiB",
        "--slab-bytes", "1MiB", "--cluster", f"redis://{host.near}:{redis_port}/0",
        "--node-id", host.name, "--cluster-ttl-s", str(TTL_S), "--cluster-timeout-s", "0.2",
        "--insecure",  # its address exists only inside this test
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=os.getcwd())

    def port() -> str | None:
        assert proc.poll() is None, log.read_text()
        found = re.search(r"event=serving address=\S+:(\d+)", log.read_text())
        return found.group(1) if found else None

    return HostNode(proc, f"{host.far}:{wait_until(port, 30.0, 'the node serves')}", log)


def test_a_partitioned_host_s_blocks_are_misses_within_its_ttl(hosts, tmp_path):
    bind = ("--bind", "127.0.0.1", *(h.near for h in hosts), "--protected-mode", "no")
    nodes: list[HostNode] = []
    with redis_server(*bind) as redis:
        try:
            nodes = [_serve_on(host, redis.port, tmp_path) for host in hosts]
            keys = _chain(64)
            blocks = [np.full(NS.block_bytes, i % 251, np.uint8) for i in range(len(keys))]
            with Client(nodes[0].address, transport="tcp") as writer:
                ns_id = writer.register_namespace(NS).namespace_id
                writer.put_chain(ns_id, keys, blocks)
                assert writer.plane == "tcp"
            with PoolClient([nodes[1].address], read_deadline_s=DEADLINE_S) as pool:
                pool.register_namespace(NS)
                wait_until(
                    lambda: pool.locate(ns_id, keys).num_located == 64, 5.0, "host 1's blocks"
                )
                got = pool.get(ns_id, keys).blocks  # from host 1, found through host 2
                assert [bytes(b or b"") for b in got] == [b.tobytes() for b in blocks]
                _ip("link", "set", hosts[0].veth, "down")  # host 1 alive, cut off
                cut = time.monotonic()
                while pool.locate(ns_id, keys).num_located:
                    assert time.monotonic() - cut < 3 * TTL_S + 1, "still located"
                seconds_to_miss = time.monotonic() - cut
                print(f"partitioned host: misses after {seconds_to_miss:.2f} s")
                assert seconds_to_miss <= TTL_S + 0.5
                started = time.monotonic()
                assert pool.get(ns_id, keys).num_found == 0
                assert time.monotonic() - started < DEADLINE_S
        finally:
            for node in nodes:
                node.proc.kill()
                node.proc.wait(timeout=30)
