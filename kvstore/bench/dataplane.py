"""Suite `dataplane`: put and get throughput and latency, kvstore against its limits and peers.

One run, one machine, every peer in its own process: memcpy (the limit: one copy of every
block, by as many threads as kvstore's shared-memory plane copies that batch with, the
`copy_threads` column), a raw TCP socket, raw ucxx (the transport limit; also restricted to
TCP), kvstore over shared memory (what a client on the node's host uses), over UCX, over UCX
restricted to TCP (`UCX_TLS=tcp`, as across hosts without RDMA), over its own TCP plane and
over gRPC, Redis (redis-py pipeline, how LMCache's Redis backend moves KV), and Mooncake
Store (the `peers` extra) over TCP and through its real client's shared memory.
Each row times `reps` batches of `batch` blocks; the targets are ratios within the run, per
block size, stated first like for like (the same transport and placement of buffers:
kvstore's shm plane against Mooncake Store's dummy client on its real client's shared
memory, kvstore's TCP plane against Mooncake's TCP transport), then against the limits
(memcpy, a raw TCP socket); `dataplane_ratios` says what each ratio compares.

Two more rows measure what those limits leave once the checks kvstore must make are made,
with nothing else (no store, no protocol): `shm-ceiling` (`dataplane_ceilings`: a copy into
shared memory and a CRC32C of every block, in two processes, pipelined block by block) and
`tcp-socket-crc32c` (the raw socket, its receiver summing every block). kvstore's ratio to
them says how much of a missed target is the hardware's and how much is kvstore's.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from kvstore.bench import dataplane_ceilings as ceilings
from kvstore.bench import dataplane_peers as peers
from kvstore.bench import hosts, verdict
from kvstore.bench.dataplane_ratios import BLOCK_BYTES, failures, legend, median_ratios, ratios
from kvstore.bench.hosts import ONE_HOST, Hosts
from kvstore.bench.options import extra_of
from kvstore.bench.report import Row, print_table, progress_bar
from kvstore.bench.suites import SuiteOptions

BATCHES = (1, 64)
OPS = ("put", "get")
SYSTEMS = (
    "memcpy", "crc32c", "shm-ceiling", "tcp-socket", "tcp-socket-crc32c", "ucxx-raw",
    "ucxx-raw-tcp", "kvstore-shm", "kvstore-ucx", "kvstore-ucx-tcp", "kvstore-tcp", "kvstore-grpc",
    "redis", "mooncake", "mooncake-shm",
)  # fmt: skip
# UCX over TCP, tuned: bigger segments and more rendezvous lanes than the defaults.
UCX_TCP_ENV = {"UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}


def _cells() -> list[peers.Cell]:
    return [(op, size, batch) for size in BLOCK_BYTES for batch in BATCHES for op in OPS]


def _reps(size: int, batch: int, quick: bool) -> int:
    """Enough batches for ~256 MiB (quick: ~48 MiB) per row, at least 5 (quick: 3)."""
    budget = (48 << 20) if quick else (256 << 20)
    floor, cap = (3, 20) if quick else (5, 100)
    return int(min(cap, max(floor, budget // (size * batch))))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _env(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spawn(
    target: Callable[..., Any], *args: Any, env: dict[str, str] | None = None, ns: str | None = None
) -> Any:
    """A spawned process running `target(*args)` (in network namespace `ns`, if any)."""
    with _env(env or {}):
        call = (ns, target, *args)
        proc = mp.get_context("spawn").Process(target=hosts.call_in, args=call, daemon=True)
        proc.start()
    return proc


def _drive(
    fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None, ns: str | None = None
) -> Any:
    """Runs a driver in a fresh spawned process (its own UCX settings; in network namespace
    `ns`, if any) and returns its result."""
    with _env(env or {}), mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(hosts.call_in, (ns, fn, *args))


def _wait_port(where: Hosts, port: int) -> None:
    """Until the node side listens on `port`, seen from the client side."""
    hosts.call_from(where.client_ns, peers.wait_port, where.node_addr, port)


def _times_by_cell(fn: Callable[[list[peers.Cell], int], Any], quick: bool) -> dict:
    out: dict = {}
    for cell in _cells():
        out.update(fn([cell], _reps(cell[1], cell[2], quick)))
    return out


# -- systems -------------------------------------------------------------------------------


def _run_memcpy(quick: bool, where: Hosts) -> dict:
    return _times_by_cell(lambda cells, reps: _drive(peers.drive_memcpy, cells, reps), quick)


def _run_crc32c(quick: bool, where: Hosts) -> dict:
    return _times_by_cell(lambda cells, reps: _drive(peers.drive_crc32c, cells, reps), quick)


def _run_shm_ceiling(quick: bool, where: Hosts) -> dict:
    name_q = mp.get_context("spawn").Queue()
    node = _spawn(ceilings.serve_node, name_q)
    try:
        name = name_q.get(timeout=30)
        return _drive(ceilings.drive, name, {c: _reps(c[1], c[2], quick) for c in _cells()})
    finally:
        node.kill()


def _run_tcp(quick: bool, where: Hosts, summed: bool = False) -> dict:
    port_q = mp.get_context("spawn").Queue()
    server = _spawn(peers.serve_tcp, port_q, where.node_addr, ns=where.node_ns)
    port = port_q.get(timeout=30)
    try:
        reps = {c: _reps(c[1], c[2], quick) for c in _cells()}
        kind = "tcp-crc32c" if summed else "tcp"
        return _drive(_drive_cells, kind, (where.node_addr, port), reps, ns=where.client_ns)
    finally:
        server.kill()


def _run_ucxx(quick: bool, where: Hosts, env: dict[str, str]) -> dict:
    addr_q = mp.get_context("spawn").Queue()
    server = _spawn(peers.serve_ucxx, addr_q, env=env)
    address = addr_q.get(timeout=60)
    try:
        reps = {c: _reps(c[1], c[2], quick) for c in _cells()}
        return _drive(_drive_cells, "ucxx", address, reps, env=env)
    finally:
        server.kill()


def _drive_cells(kind: str, target: Any, reps: dict) -> dict:
    """In one driver process, times every cell against one peer."""
    if kind.startswith("tcp"):
        return _per_cell_tcp(target, reps, kind == "tcp-crc32c")
    return _per_cell_ucxx(target, reps)


def _per_cell_tcp(address: tuple[str, int], reps: dict, summed: bool) -> dict:
    out = {}
    for cell, n in reps.items():
        out.update(peers.drive_tcp(address, [cell], n, summed))
    return out


def _per_cell_ucxx(address: bytes, reps: dict) -> dict:
    # One connection for all cells: the raw server serves one client.
    cells = list(reps)
    times = peers.drive_ucxx(address, cells, max(reps.values()))
    return {c: times[c][: reps[c]] for c in cells}


@contextlib.contextmanager
def _kvstore_server(
    env: dict[str, str], dataplane: str, where: Hosts = ONE_HOST
) -> Iterator[tuple[str, int]]:
    """A kvstore node serving `dataplane` on the node side; yields its address and pid once
    the client side sees it ready."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "kvstore.cli", "--log-level", "WARNING", "serve",
        "--host", where.node_addr, "--port", str(port), "--dram-bytes", "3GiB",
        "--slab-bytes", "16MiB", "--max-message-bytes", "64MiB", "--dataplane", dataplane,
    ]  # fmt: skip
    if where.node_ns is not None:  # no auth, as its peers: no one but the client side sees it
        cmd.append("--insecure")
    with _env(env):
        proc = subprocess.Popen(
            where.node_command(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    try:
        address = f"{where.node_addr}:{port}"
        hosts.call_from(where.client_ns, peers.wait_ready, address)
        yield address, proc.pid
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        proc.kill()


def _run_kvstore(quick: bool, where: Hosts, transport: str, env: dict[str, str]) -> dict:
    plane = transport if transport in ("shm", "ucx", "tcp") else "none"
    with _kvstore_server(env, plane, where) as (address, _):
        reps = {c: _reps(c[1], c[2], quick) for c in _cells()}
        return _drive(_kvstore_cells, address, transport, reps, env=env, ns=where.client_ns)


def _kvstore_cells(address: str, transport: str, reps: dict) -> dict:
    out = {}
    for cell, n in reps.items():
        out.update(peers.drive_kvstore(address, transport, [cell], n))
    return out


def _run_redis(quick: bool, where: Hosts) -> dict:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("Redis needs redis-server: apt-get install redis-server")
    port = _free_port()
    cmd = [binary, "--port", str(port), "--bind", where.node_addr]
    cmd += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
    proc = subprocess.Popen(
        where.node_command(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_port(where, port)
        reps = {c: _reps(c[1], c[2], quick) for c in _cells()}
        return _drive(_redis_cells, (where.node_addr, port), reps, ns=where.client_ns)
    finally:
        proc.kill()


def _redis_cells(address: tuple[str, int], reps: dict) -> dict:
    out = {}
    for cell, n in reps.items():
        out.update(peers.drive_redis(address, [cell], n))
    return out


@contextlib.contextmanager
def _mooncake_master(where: Hosts) -> Iterator[tuple[str, str]]:
    """A Mooncake master with its HTTP metadata server on the node side; yields both
    addresses."""
    if (missing := peers.mooncake_missing()) is not None:
        raise RuntimeError(missing)
    rpc, http = _free_port(), _free_port()
    cmd = [
        peers.mooncake_master(), f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={http}", f"--http_metadata_server_host={where.node_addr}",
        f"--metrics_port={_free_port()}",
    ]  # fmt: skip
    master = subprocess.Popen(
        where.node_command(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_port(where, rpc)
        _wait_port(where, http)
        yield f"{where.node_addr}:{rpc}", f"http://{where.node_addr}:{http}/metadata"
    finally:
        master.kill()


def _run_mooncake(quick: bool, where: Hosts) -> dict:
    with _mooncake_master(where) as (master, metadata):
        ready = mp.get_context("spawn").Queue()
        serving = (master, metadata, ready, where.node_addr)
        store = _spawn(peers.serve_mooncake, *serving, ns=where.node_ns)
        try:
            ready.get(timeout=60)
            reps = {c: _reps(c[1], c[2], quick) for c in _cells()}
            driving = (master, metadata, where.client_addr, reps)
            return _drive(_mooncake_cells, *driving, ns=where.client_ns)
        finally:
            store.kill()


def _mooncake_cells(master: str, metadata: str, hostname: str, reps: dict) -> dict:
    cells = list(reps)
    times = peers.drive_mooncake(master, metadata, hostname, cells, max(reps.values()))
    return {c: times[c][: reps[c]] for c in cells}


def _run_mooncake_shm(quick: bool, where: Hosts) -> dict:
    with _mooncake_master(where) as (master, metadata):
        port = _free_port()
        cmd = [
            peers.mooncake_client(), "--host=127.0.0.1", f"--port={port}",
            "--global_segment_size=3GB", f"--master_server_address={master}",
            f"--metadata_server={metadata}", "--protocol=tcp",
            f"--threads={os.cpu_count() or 1}",
        ]  # fmt: skip
        real = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_port(where, port)
            reps = {c: _reps(c[1], c[2], quick) for c in _cells()}
            return _drive(_mooncake_shm_cells, f"127.0.0.1:{port}", reps)
        finally:
            real.kill()


def _mooncake_shm_cells(real_client: str, reps: dict) -> dict:
    cells = list(reps)
    times = peers.drive_mooncake_shm(real_client, cells, max(reps.values()))
    return {c: times[c][: reps[c]] for c in cells}


RUNNERS: dict[str, Callable[[bool, Hosts], dict]] = {
    "memcpy": _run_memcpy,
    "crc32c": _run_crc32c,
    "shm-ceiling": _run_shm_ceiling,
    "tcp-socket": _run_tcp,
    "tcp-socket-crc32c": lambda q, w: _run_tcp(q, w, summed=True),
    "ucxx-raw": lambda q, w: _run_ucxx(q, w, {}),
    "ucxx-raw-tcp": lambda q, w: _run_ucxx(q, w, UCX_TCP_ENV),
    "kvstore-shm": lambda q, w: _run_kvstore(q, w, "shm", {}),
    "kvstore-ucx": lambda q, w: _run_kvstore(q, w, "ucx", {}),
    "kvstore-ucx-tcp": lambda q, w: _run_kvstore(q, w, "ucx", UCX_TCP_ENV),
    "kvstore-tcp": lambda q, w: _run_kvstore(q, w, "tcp", {}),
    "kvstore-grpc": lambda q, w: _run_kvstore(q, w, "grpc", {}),
    "redis": _run_redis,
    "mooncake": _run_mooncake,
    "mooncake-shm": _run_mooncake_shm,
}
# Across two hosts (`--hosts netns`): the systems that move bytes over a network stack.
NETNS_SYSTEMS = (
    "tcp-socket",
    "tcp-socket-crc32c",
    "kvstore-ucx-tcp",
    "kvstore-tcp",
    "redis",
    "mooncake",
)


# -- rows ----------------------------------------------------------------------------------


def _row(system: str, cell: peers.Cell, times: list[float] | None, note: str = "") -> Row:
    op, size, batch = cell
    row: Row = {"system": system, "op": op, "block_bytes": size, "batch": batch}
    if system in ("memcpy", "kvstore-shm"):  # the limit copies with kvstore's copy threads
        row["copy_threads"] = peers.copy_threads(op, size * batch)
    if times:
        row |= {
            "gbps": size * batch * len(times) / sum(times) / 1e9,
            "p50_ms": statistics.median(times) * 1e3,
            "p99_ms": float(np.percentile(times, 99)) * 1e3,
        }
    else:
        row |= {"gbps": None, "p50_ms": None, "p99_ms": None}
    if note:
        row["note"] = note
    return row


def _times_of(system: str, quick: bool, where: Hosts = ONE_HOST) -> dict | str:
    """Every cell's times of one system, or why it could not run."""
    try:
        return RUNNERS[system](quick, where)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:120]


def _rows_of(system: str, runs: list[dict | str], where: Hosts = ONE_HOST) -> list[Row]:
    """One row per cell, over the times of every run of `system` (a failed run adds none);
    across hosts, each says so (`hosts`)."""
    timed = [run for run in runs if isinstance(run, dict)]
    if not timed:
        note = next((run for run in runs if isinstance(run, str)), "")
        rows = [_row(system, cell, None, note) for cell in _cells()]
    else:
        times = [[t for run in timed for t in run.get(cell, [])] for cell in _cells()]
        rows = [_row(system, cell, t) for cell, t in zip(_cells(), times, strict=True)]
    return rows if where is ONE_HOST else [{"hosts": where.name, **row} for row in rows]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's own flags."""
    parser.add_argument(
        "--systems",
        default=None,
        help=f"measure only these, comma-separated (default: all of {','.join(SYSTEMS)}); "
        "a ratio needs both of its systems",
    )
    parser.add_argument(
        "--hosts",
        choices=("one", "netns"),
        default="one",
        help="one: node and clients on this host, over loopback; netns: in two network "
        "namespaces the bench creates, joined by a veth pair (root; the systems that cross a "
        f"network: {','.join(NETNS_SYSTEMS)})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every system this many times, in alternating order; ratios are the "
        "median of each round's (on a noisy host, more rounds, steadier ratios)",
    )


def _systems(wanted: object, known: tuple[str, ...] = SYSTEMS) -> list[str]:
    """The systems `--systems` names, in table order; every one `known` without it."""
    if not wanted:
        return list(known)
    names = str(wanted).split(",")
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown systems {unknown} here; known: {','.join(known)}")
    return [s for s in known if s in names]


def _judged(rows: list[Row]) -> tuple[str, ...] | None:
    """The systems whose ratios have targets here: across hosts, those that cross a
    network; on one host, every one (None)."""
    return NETNS_SYSTEMS if any(r.get("hosts") == "netns" for r in rows) else None


def exit_status(rows: list[Row]) -> int:
    """1 where a target is missed or unmeasured (a system absent or failed), on each
    ratio's median over the rounds (`rounds_gbps`: the table printed during the run);
    else 0."""
    judged = _judged(rows)
    num_rounds = max((len(cast(list, r.get("rounds_gbps") or [])) for r in rows), default=0)
    if num_rounds < 2:
        return verdict.exit_status(failures(ratios(rows, judged)))
    rounds = [
        [{**row, "gbps": cast(list, row["rounds_gbps"])[i]} for row in rows]
        for i in range(num_rounds)
    ]
    return verdict.exit_status(failures(median_ratios(rounds, judged)))


def run(options: SuiteOptions) -> list[Row]:
    """Measures every system asked for, `--rounds` times (the order reversed every other
    round, so a drift of the host favours no system); prints the target ratios, each the
    median of its rounds'; returns one row per measurement, over every round's times."""
    extra = extra_of(options)
    across = extra.get("hosts") == "netns"
    systems = _systems(extra.get("systems"), NETNS_SYSTEMS if across else SYSTEMS)
    num_rounds = int(cast("int | None", extra.get("rounds")) or 1)
    if num_rounds < 1:
        raise SystemExit("kvstore-bench dataplane: --rounds must be >= 1")
    if across and (why := hosts.missing()) is not None:
        raise SystemExit(f"kvstore-bench dataplane: {why}")
    runs: dict[str, list[dict | str]] = {system: [] for system in systems}
    with (
        hosts.netns_pair() if across else contextlib.nullcontext(ONE_HOST) as where,
        progress_bar("dataplane", total=len(systems) * num_rounds) as advance,
    ):
        for r in range(num_rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                runs[system].append(_times_of(system, options.quick, where))
                advance(1)
    rounds = [
        [row for system in systems for row in _rows_of(system, [runs[system][r]], where)]
        for r in range(num_rounds)
    ]
    judged = NETNS_SYSTEMS if across else None
    place = f"across two hosts ({where.node_addr} <- {where.client_addr})" if across else "one host"
    title = (
        f"dataplane, {place}, batches of 64: ratios within this run (median of {num_rounds} rounds)"
    )
    print_table(legend(judged), title="dataplane: what each ratio compares, and its target")
    print_table(median_ratios(rounds, judged), title=title)
    pooled = [row for system in systems for row in _rows_of(system, runs[system], where)]
    # Each row's GB/s in every round too (a list: in the JSON, not the table).
    return [{**row, "rounds_gbps": [r[i]["gbps"] for r in rounds]} for i, row in enumerate(pooled)]
