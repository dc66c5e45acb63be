"""Faults and concurrency on the data planes (UCX, TCP, and shared memory on one host), with
real processes on both ends."""

from __future__ import annotations

import multiprocessing as mp
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import require_extra, start_store, wait_no_leases, wait_until

require_extra("ucxx")

NS = Namespace("llama-faults", KVLayout("float16", 8, 8, 128, 16))  # 512 KiB blocks
NUM_PROCS = 8


def _chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _block(seed: int, i: int) -> np.ndarray:
    return np.full(NS.block_bytes, (seed * 31 + i) % 251, np.uint8)


def _worker(address: str, seed: int, rounds: int) -> None:
    """One of many client processes: puts its own chain, reads it back byte for byte."""
    with Client(address, timeout_s=30.0, transport="ucx") as client:
        client.register_namespace(NS)
        keys = _chain(8, seed)
        client.put_chain(NS.id, keys, [_block(seed, i) for i in range(8)])
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        for _ in range(rounds):
            assert client.get_into(NS.id, keys, out) == (True,) * 8
            assert all((o == _block(seed, i)).all() for i, o in enumerate(out))


def test_eight_client_processes_at_once(store_factory):
    store = store_factory("--dram-bytes", "256MiB", "--slab-bytes", "1MiB")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(store.address, s, 4)) for s in range(NUM_PROCS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * NUM_PROCS
    with Client(store.address, timeout_s=10.0) as client:
        assert client.stats().num_blocks == 8 * NUM_PROCS
        wait_no_leases(client)


_HAMMER = """
import sys, time, numpy as np
from kvstore.client import Client
from tests.dataplane.test_faults import NS, _chain, _block
client = Client(sys.argv[1], timeout_s=30.0, transport=sys.argv[3])
client.register_namespace(NS)
keys = _chain(32, 50)
client.put_chain(NS.id, keys, [_block(50, i) for i in range(32)])
out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
print("ready", flush=True)
n = 0
deadline = time.monotonic() + 300  # the test kills it long before; an orphan stops here
while time.monotonic() < deadline:
    n += 1
    if sys.argv[2] == "get":
        client.get_into(NS.id, keys, out)
    else:
        client.put(NS.id, _chain(32, 1000 + n), [_block(n, i) for i in range(32)])
"""


@pytest.mark.parametrize("transport", ["ucx", "shm", "tcp"])
@pytest.mark.parametrize("op", ["get", "put"])
def test_client_killed_mid_transfer_leaves_nothing_behind(store_factory, op, transport):
    store = store_factory(
        "--dram-bytes", "512MiB", "--slab-bytes", "1MiB", "--lease-timeout-s", "2",
        "--reservation-timeout-s", "2", "--transfer-timeout-s", "2",
        "--expire-interval-s", "0.2",
    )  # fmt: skip
    cmd = [sys.executable, "-c", _HAMMER, store.address, op, transport]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    lines = iter(child.stdout.readline, "")
    assert any(line.strip() == "ready" for line in lines), "hammer client did not start"
    with Client(store.address, timeout_s=10.0) as client:
        wait_until(
            lambda: client.stats().bytes_read + client.stats().bytes_written > 64 << 20,
            30.0,
            "the hammer client moved 64 MiB",
        )
        child.send_signal(signal.SIGKILL)
        child.wait()
        wait_until(
            lambda: client.stats().num_leases + client.stats().num_reservations == 0,
            30.0,
            "the dead client's leases and reservations ended",
        )
        client.register_namespace(NS)
        keys = _chain(2, 77)
        assert client.put_chain(NS.id, keys, [_block(77, 0), _block(77, 1)]).num_stored == 2
    with Client(store.address, timeout_s=10.0, transport=transport) as fresh:
        out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
        assert fresh.get_into(NS.id, keys, out) == (True, True)
        assert (out[1] == _block(77, 1)).all()


@pytest.mark.parametrize("transport", ["ucx", "shm", "tcp"])
def test_server_killed_mid_get_gives_typed_error(tmp_path, transport):
    store = start_store(tmp_path, "--dram-bytes", "256MiB", "--slab-bytes", "1MiB")
    client = Client(store.address, timeout_s=3.0, transport=transport)
    client.register_namespace(NS)
    keys = _chain(32, 9)
    client.put_chain(NS.id, keys, [_block(9, i) for i in range(32)])
    out = [np.zeros(NS.block_bytes, np.uint8) for _ in keys]
    failures: list[BaseException] = []
    started = threading.Event()

    def hammer() -> None:
        deadline = time.monotonic() + 60.0  # the server dies long before
        try:
            while time.monotonic() < deadline:
                client.get_into(NS.id, keys, out)
                started.set()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    assert started.wait(timeout=30)
    store.proc.send_signal(signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive(), "get_into hung after the server died"
    assert len(failures) == 1
    assert isinstance(failures[0], errors.DeadlineExceededError | errors.UnavailableError)
    client.close()
    store.proc.wait()


@pytest.mark.parametrize("transport", ["ucx", "shm", "tcp"])
def test_a_client_of_a_killed_node_closes_without_raising(store_factory, transport):
    """The CLOSE of a client whose node was SIGKILLed finds the connection reset: closing
    still succeeds (it used to raise UCX's own ConnectionResetError) and frees the client."""
    require_extra("ucxx")
    store = store_factory("--dram-bytes", "16MiB", "--slab-bytes", "1MiB")
    client = Client(store.address, timeout_s=2.0, transport=transport)
    dataplane = client.data_plane()
    assert dataplane is not None and dataplane.is_open
    store.kill()
    client.close()
    assert not dataplane.is_open
