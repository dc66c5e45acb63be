"""Fixtures that start real store processes on free loopback ports and stop them."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.client.common import GetAssembler

T = TypeVar("T")
# The pip extra that brings each optional module (pyproject.toml).
EXTRAS = {"ucxx": "ucx", "torch": "engine", "safetensors": "engine", "matplotlib": "bench"}


def require_extra(module: str) -> ModuleType:
    """Imports an optional extra's `module`: without it the test is skipped, or fails when
    KVSTORE_REQUIRE_EXTRAS is set (`make test` sets it, so CI never skips for a missing
    extra)."""
    if not os.environ.get("KVSTORE_REQUIRE_EXTRAS"):
        return pytest.importorskip(module)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module, "?")
        pytest.fail(f"{module} is required here (extra {extra!r}): {exc}", pytrace=False)


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    """Polls `predicate` until it returns something true, and returns that; fails the test
    with `what` if it has not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)
    return value


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
    is_killed: bool = False

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        """SIGKILL, as a crash would; waits until the process is gone."""
        self.is_killed = True
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def start_store(
    tmp_path: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    client: Mapping[str, str] | None = None,
) -> StoreProcess:
    """Starts `kvstore serve ARGS` on a port it picks itself (no race with other processes
    for a free one) and waits until it answers health checks.

    `env`: variables to set for the process, over this one's environment. `client`: the
    `Client` arguments the health check needs (e.g. `tls_ca` for a TLS node).
    """
    fd, log_name = tempfile.mkstemp(prefix="store-", suffix=".log", dir=tmp_path)
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", *args]
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    store = StoreProcess(proc, "", Path(log_name))
    try:
        port = wait_until(lambda: _serving_port(store), 30.0, "the store serves")
        store.address = f"127.0.0.1:{port}"
        with Client(store.address, timeout_s=5.0, **(client or {})) as checker:
            assert checker.health()
    except Exception:
        proc.kill()
        raise RuntimeError(f"store did not start:\n{store.log()}") from None
    return store


def _serving_port(store: StoreProcess) -> str | None:
    assert store.proc.poll() is None, "the store exited"
    found = re.search(r"event=serving address=\S+:(\d+)", store.log())
    return found.group(1) if found else None


@pytest.fixture
def store_factory(tmp_path: Path) -> Iterator[Callable[..., StoreProcess]]:
    """Starts stores with the given `kvstore serve` flags (and `env=`); stops them all at
    teardown, where each must exit 0 unless the test killed it."""
    started: list[StoreProcess] = []

    def factory(
        *args: str, env: Mapping[str, str] | None = None, client: Mapping[str, str] | None = None
    ) -> StoreProcess:
        started.append(start_store(tmp_path, *args, env=env, client=client))
        return started[-1]

    yield factory
    for store in started:
        code = store.stop()
        assert store.is_killed or code == 0, f"store exited {code}:\n{store.log()}"


def cli_stats(address: str) -> dict[str, str]:
    """The counters `kvstore stats` prints (`name=value` lines; the per-tier lines are keyed
    `tier.<name>.<field>`)."""
    cmd = [sys.executable, "-m", "kvstore.cli", "stats", "--address", address]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout
    counters: dict[str, str] = {}
    for line in out.splitlines():
        fields = dict(field.split("=", 1) for field in line.split())
        tier = fields.pop("tier", None)
        counters.update({f"tier.{tier}.{k}" if tier else k: v for k, v in fields.items()})
    return counters


@pytest.fixture
def store(store_factory) -> StoreProcess:
    """A store with 64 MiB of DRAM and a batch limit of 64 keys."""
    return store_factory("--dram-bytes", "64MiB", "--slab-bytes", "4MiB", "--max-batch-keys", "64")


def open_get_stream(
    address: str, namespace_id: bytes, keys: list[bytes]
) -> tuple[Iterator[pb.GetResponse], GetAssembler]:
    """A gRPC Get stream read up to its header, and an assembler fed with it: the server
    holds the lease, and once the stream is past gRPC's flow-control window, waits for the
    reader. The channel never grows its window (no BDP probe): grown, it can take a whole
    stream, which then ends instead of stalling (seen once in CI, as a lease that never
    expired). Feed the assembler the rest of the stream to read the blocks."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.http2.bdp_probe", 0)]
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(address, options=options))
    stream = stub.Get(pb.GetRequest(namespace_id=namespace_id, keys=keys), timeout=120.0)
    assembler = GetAssembler()
    assembler.feed(next(stream))
    return stream, assembler


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted at `path` (made if missing), unmounted afterwards;
    skips the test where mounting is refused (it needs root)."""
    path.mkdir(exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)]
    mounted = subprocess.run(cmd, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def engine_factory(tmp_path: Path) -> Iterator[Callable[..., object]]:
    """Starts `kvstore engine --port P ARGS...` processes on free ports; each call returns a
    ready `EngineClient` (its `address` names the engine). Stopped with SIGTERM after the
    test, which fails if one did not exit cleanly."""
    from gpu_engine.engine_client import EngineClient  # torch: only for tests that ask

    started: list[tuple[subprocess.Popen, Path]] = []

    def factory(*args: str) -> EngineClient:
        port = free_port()
        log_path = tmp_path / f"engine-{port}.log"
        cmd = [sys.executable, "-m", "kvstore.cli", "engine", "--port", str(port), *args]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        started.append((proc, log_path))
        client = EngineClient(f"127.0.0.1:{port}", timeout_s=60.0)
        client.wait_ready(timeout_s=60.0)
        return client

    yield factory
    for proc, log_path in started:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()


def wait_no_leases(client: Client, timeout_s: float = 10.0) -> None:
    """Waits until the node holds no reservation and no lease. A get's lease ends once the
    node has seen its sends (or its stream) finish, which can come a moment after the
    reader has every byte."""

    def clean() -> bool:
        stats = client.stats()
        return (stats.num_reservations, stats.num_leases) == (0, 0)

    wait_until(clean, timeout_s, "no reservation or lease left on the node")
