"""`kvstore-bench dataplane --hosts netns`: two network namespaces joined by a veth pair,
made and removed by the bench; a transfer between them crosses a real network stack
between distinct addresses; and only the ratios of systems that cross a network are judged."""

from __future__ import annotations

import socket
import subprocess

import pytest

from kvstore.bench import dataplane, hosts
from kvstore.bench import dataplane_peers as peers
from kvstore.bench import dataplane_ratios as ratios


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _ends(address: tuple[str, int]) -> tuple[str, str]:
    """This side's and the other side's address of one connection to `address`."""
    with socket.create_connection(address, timeout=5) as sock:
        return sock.getsockname()[0], sock.getpeername()[0]


def test_a_raw_transfer_crosses_from_one_namespace_to_the_other_and_both_go_after():
    with hosts.netns_pair() as where:
        assert where.node_ns in _namespaces() and where.client_ns in _namespaces()
        assert where.node_addr != where.client_addr
        port_q = dataplane.mp.get_context("spawn").Queue()
        server = dataplane._spawn(peers.serve_tcp, port_q, where.node_addr, ns=where.node_ns)
        try:
            address = (where.node_addr, port_q.get(timeout=30))
            ends = dataplane._drive(_ends, address, ns=where.client_ns)
            cell = ("get", 64 << 10, 4)
            times = dataplane._drive(peers.drive_tcp, address, [cell], 2, ns=where.client_ns)
        finally:
            server.kill()
    assert ends == (where.client_addr, where.node_addr)  # between the two, not over loopback
    assert len(times[cell]) >= 2 and all(t > 0 for t in times[cell])
    assert where.node_ns not in _namespaces() and where.client_ns not in _namespaces()


def test_across_hosts_only_the_systems_that_cross_a_network_run_and_are_judged():
    assert dataplane._systems(None, dataplane.NETNS_SYSTEMS) == list(dataplane.NETNS_SYSTEMS)
    with pytest.raises(SystemExit, match="unknown systems"):
        dataplane._systems("kvstore-shm", dataplane.NETNS_SYSTEMS)  # no shared memory there
    judged = {r["ratio"] for r in ratios.legend(dataplane.NETNS_SYSTEMS)}
    assert {"tcp put/mooncake", "tcp get/mooncake", "tcp put/tcp-socket"} <= judged
    assert not any("shm" in name or "memcpy" in name for name in judged)
    measured = {(s, op): 10.0 for s in dataplane.NETNS_SYSTEMS for op in ("put", "get")}
    rows = [
        {"hosts": "netns", "system": s, "op": op, "block_bytes": size, "batch": 64, "gbps": g}
        for size in dataplane.BLOCK_BYTES
        for (s, op), g in measured.items()
    ]
    assert dataplane.exit_status(rows) == 0  # kvstore-shm and memcpy are not missed here
    no_peer = [r for r in rows if r["system"] != "mooncake"]
    assert dataplane.exit_status(no_peer) == 1
    slow_put = [{**r, "gbps": 8.0} if r["system"] == "kvstore-tcp" else r for r in rows]
    missed = ratios.failures(ratios.ratios(slow_put, dataplane.NETNS_SYSTEMS))
    assert (
        missed[0] == f"{64 << 10} B: tcp put/mooncake<1 tcp get/mooncake<1 tcp get/tcp-socket<0.9"
    )
    assert missed[1].endswith(" tcp put/tcp-socket<0.9")  # from 256 KiB


def test_the_vllm_suites_node_serves_from_its_namespace_and_is_reached_from_the_other(tmp_path):
    """`kvstore-bench vllm --hosts netns`: the node listens on the node side's address,
    started under `ip netns exec`; the client side reads from it over the tcp plane."""
    from kvstore.bench.vllm import dataplane_get_gbps
    from kvstore.bench.vllm_systems import System

    node = System("kvstore", "kvstore", ".venv", is_shared=True)
    with hosts.netns_pair() as where, node.serve(tmp_path, where) as server:
        store = str(server["store"])
        assert store.startswith(f"{where.node_addr}:")
        ends = hosts.call_from(where.client_ns, _ends, (where.node_addr, int(store.split(":")[1])))
        gbps = dataplane_get_gbps(store, 64 << 10, where)
    assert ends == (where.client_addr, where.node_addr)
    assert gbps > 0


def test_a_command_runs_in_the_side_it_is_meant_for():
    where = hosts.Hosts("netns", "n", "c", "10.0.0.1", "10.0.0.2")
    assert where.client_command(["x"]) == ["ip", "netns", "exec", "c", "x"]
    assert where.node_command(["x"]) == ["ip", "netns", "exec", "n", "x"]
    assert hosts.ONE_HOST.client_command(["x"]) == ["x"]
