"""Fixtures that start real store processes on free loopback ports and stop them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.client import Client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class StoreProcess:
    """A `kvstore serve` child process."""

    proc: subprocess.Popen
    address: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def start_store(tmp_path: Path, *args: str) -> StoreProcess:
    """Starts `kvstore serve ARGS` on a free port and waits until it answers health checks."""
    port = free_port()
    log_path = tmp_path / f"store-{port}.log"
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    store = StoreProcess(proc, f"127.0.0.1:{port}", log_path)
    with Client(store.address, timeout_s=5.0) as client:
        try:
            client.wait_ready(timeout_s=30.0)
            assert client.health()
        except Exception:
            proc.kill()
            raise RuntimeError(f"store did not start:\n{store.log()}") from None
    return store


@pytest.fixture
def store_factory(tmp_path: Path) -> Iterator[Callable[..., StoreProcess]]:
    """Starts stores with the given `kvstore serve` flags; stops them all at teardown."""
    started: list[StoreProcess] = []

    def factory(*args: str) -> StoreProcess:
        started.append(start_store(tmp_path, *args))
        return started[-1]

    yield factory
    for store in started:
        code = store.stop()
        assert code == 0, f"store exited {code}:\n{store.log()}"


@pytest.fixture
def store(store_factory) -> StoreProcess:
    """A store with 64 MiB of DRAM and a batch limit of 64 keys."""
    return store_factory("--dram-bytes", "64MiB", "--slab-bytes", "4MiB", "--max-batch-keys", "64")
