"""Real Redis servers on free loopback ports, for the cluster tests and `kvstore-bench
cluster`: one server, or a Redis Cluster of primaries (each with a replica if asked). Each
keeps nothing on disk and is stopped when its block ends.

Both need Debian's `redis-server` and `redis-cli` (`make redis` installs them); where they
are missing, or a server does not answer in time, `RedisUnavailableError` says why.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 20.0
CLUSTER_BUS_OFFSET = 10_000  # a cluster node's bus listens this far above its port


class RedisUnavailableError(RuntimeError):
    """A Redis server could not be started here."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (10,000 above it) is free too."""
    for _ in range(100):
        port = _free_port()
        if port + CLUSTER_BUS_OFFSET > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RedisUnavailableError("no free port pair for a Redis Cluster node")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RedisUnavailableError(f"{name} is not installed (make redis installs it)")
    return path


@dataclass
class RedisServer:
    """One `redis-server` process on `port` (stopped, frozen and restarted by the tests)."""

    port: int
    workdir: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            _binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir), *self.extra,
        ]  # fmt: skip
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (the process keeps it)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.cli("ping", check=False) != "PONG":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RedisUnavailableError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGKILL: what it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def cli(self, *args: str, check: bool = True) -> str:
        """`redis-cli -p PORT ARGS...`'s answer, stripped."""
        done = subprocess.run(
            [_binary("redis-cli"), "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if check and done.returncode != 0:
            raise RedisUnavailableError(f"redis-cli {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout.strip()


@contextlib.contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    """A fresh Redis on a free port for the block's length."""
    with tempfile.TemporaryDirectory(prefix="kvstore-redis-") as tmp:
        server = RedisServer(_free_port(), Path(tmp), extra)
        try:
            server.start()
            yield server
        finally:
            server.stop()


@dataclass
class RedisCluster:
    """A Redis Cluster's servers: `primaries` first, then their replicas."""

    servers: list[RedisServer]
    primaries: int

    @property
    def url(self) -> str:
        """A seed list, as `kvstore serve --cluster` takes it."""
        seeds = ",".join(f"127.0.0.1:{s.port}" for s in self.servers[: self.primaries])
        return f"redis+cluster://{seeds}"

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        alive = [s for s in self.servers if s.proc is not None and s.proc.poll() is None]
        for server in alive:  # each node converges on its own
            while "cluster_state:ok" not in server.cli("cluster", "info", check=False):
                if time.monotonic() > deadline:
                    raise RedisUnavailableError(f"Redis Cluster node {server.port} is not ok")
                time.sleep(0.05)
        for server in alive[self.primaries :]:  # a replica that never synced never takes over
            while "master_link_status:up" not in server.cli("info", "replication", check=False):
                if time.monotonic() > deadline:
                    raise RedisUnavailableError(f"Redis Cluster replica {server.port} never synced")
                time.sleep(0.05)

    def wait_replicated(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Waits until every live replica has every write its primary had when called:
        replication is asynchronous, and a primary killed before that takes the rest with
        it (its replica takes over without them)."""
        deadline = time.monotonic() + timeout_s
        alive = [s for s in self.servers if s.proc is not None and s.proc.poll() is None]
        offsets = {
            s.port: int(_info_field(s.cli("info", "replication"), "master_repl_offset"))
            for s in alive
        }
        for server in alive:
            info = server.cli("info", "replication")
            if "role:slave" not in info:
                continue
            primary = int(_info_field(info, "master_port"))
            while int(_info_field(info, "slave_repl_offset") or -1) < offsets.get(primary, 0):
                if time.monotonic() > deadline:
                    raise RedisUnavailableError(f"Redis Cluster replica {server.port} lags")
                time.sleep(0.05)
                info = server.cli("info", "replication", check=False)


def _info_field(info: str, name: str) -> str:
    """The value of `name` in an INFO answer ("" where it is not there)."""
    prefix = f"{name}:"
    return next((line[len(prefix) :] for line in info.splitlines() if line.startswith(prefix)), "")


@contextlib.contextmanager
def redis_cluster(primaries: int = 3, replicas: int = 0) -> Iterator[RedisCluster]:
    """A Redis Cluster of `primaries` primaries with `replicas` replicas each, on free ports;
    a killed primary's replica takes over within about two seconds."""
    with tempfile.TemporaryDirectory(prefix="kvstore-redis-cluster-") as tmp:
        count = primaries * (1 + replicas)
        flags = ("--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                 "--cluster-config-file", "nodes.conf")  # fmt: skip
        servers = [
            RedisServer(_free_cluster_port(), Path(tmp) / str(i), flags) for i in range(count)
        ]
        try:
            for server in servers:
                server.start()
            addresses = [f"127.0.0.1:{s.port}" for s in servers]
            servers[0].cli(
                "--cluster", "create", *addresses,
                "--cluster-replicas", str(replicas), "--cluster-yes",
            )  # fmt: skip
            cluster = RedisCluster(servers, primaries)
            cluster.wait_healthy()
            yield cluster
        finally:
            for server in servers:
                server.stop()
