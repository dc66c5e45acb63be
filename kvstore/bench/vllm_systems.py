"""The systems `kvstore-bench vllm` compares, each a way to start what vLLM talks to.

Every system runs the same vLLM release and model, in a venv of its own where its pins
need one (LMCache pins an older grpcio/protobuf than kvstore).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.bench import dataplane_peers as peers
from kvstore.bench import hosts
from kvstore.bench.hosts import LOOPBACK, ONE_HOST, Hosts

ROOT = Path(__file__).resolve().parents[2]  # the repository, where the venvs are


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen, where: Hosts, timeout_s: float = 120.0) -> None:
    """Until the server listens on `port`, seen from the client side."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        with contextlib.suppress(OSError):
            return hosts.call_from(where.client_ns, peers.wait_port, where.node_addr, port, 1.0)
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on port {port}")


@contextlib.contextmanager
def _server(cmd: list[str], port: int, log: Path, where: Hosts) -> Iterator[None]:
    with open(log, "w") as out:
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
        cmd = where.node_command(cmd)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_port(port, proc, where)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass(frozen=True)
class System:
    """A compared system: its connector, the venv its vLLM runs in, whether it shares KV
    across processes (a writer process fills it before the measured one)."""

    name: str
    connector: str
    venv: str
    is_shared: bool
    needs_gpu: bool = False  # vLLM refuses it on CPU
    connector_extra: tuple[tuple[str, object], ...] = ()  # settings of its connector
    server_flags: tuple[str, ...] = ()  # settings of its server (LMCache's); `{port}` is its port
    one_host_flags: tuple[str, ...] = ()  # more, where the server is on vLLM's host
    by_default: bool = True  # in the sweep without --systems
    # Moves KV through /dev/shm, which a network namespace does not separate: across the
    # namespaces of `--hosts netns` it would cross no network, so it runs on one host only.
    one_host_only: bool = False

    @property
    def python(self) -> str:
        return str(ROOT / self.venv / "bin" / "python")

    def missing(self) -> str | None:
        """What to run to make this system's venv, or None when it is there."""
        if (ROOT / self.venv / "bin" / ".installed").exists():
            return None
        return f"{self.name} needs {self.venv}: run `make {self.venv}/bin/.installed` (minutes)"

    @contextlib.contextmanager
    def serve(self, workdir: Path, where: Hosts = ONE_HOST) -> Iterator[dict[str, object]]:
        """Starts the system's server (if any) on the node side; yields the spec keys vLLM
        needs."""
        port, log = _free_port(), workdir / f"{self.name}-server.log"
        host = where.node_addr
        if self.connector == "kvstore":
            cmd = [self.python, "-m", "kvstore.cli", "serve", "--host", host, "--port", str(port)]
            cmd += ["--dram-bytes", "8GiB"]
            if where.node_ns is not None:  # as LMCache's server: no one but vLLM's side sees it
                cmd.append("--insecure")
            with _server(cmd, port, log, where):
                yield {"store": f"{host}:{port}"}
        elif self.connector == "lmcache":
            cmd = self.lmcache_command(port, host, one_host=where.node_ns is None)
            with _server(cmd, port, log, where):
                yield {"lmcache_host": host, "lmcache_port": port}
        else:
            yield {}

    def lmcache_command(self, port: int, host: str = LOOPBACK, one_host: bool = True) -> list[str]:
        """LMCache's MP server on `host`:`port`, with this system's settings (and those for
        a server on vLLM's host, if `one_host`)."""
        lmcache = str(ROOT / self.venv / "bin" / "lmcache")
        cmd = [lmcache, "server", "--host", host, "--port", str(port)]
        flags = (*self.server_flags, *(self.one_host_flags if one_host else ()))
        cmd += ["--l1-size-gb", "8", "--eviction-policy", "LRU"]
        return [*cmd, *(flag.format(port=port) for flag in flags)]


# LMCache's MP server: vLLM on CPU registers its KV caches for engine-driven transfers only
# (a server left at its default, `lmcache_driven`, never answers that registration), so
# every variant supports them; the chunk size is LMCache's default, 256, which loaded
# faster here than 128 (docs/benchmarks/vllm.md, "LMCache's settings").
LMCACHE_FLAGS = ("--supported-transfer-mode", "engine_driven", "--chunk-size", "256")
# On vLLM's host, engine-driven transfers go through LMCache's shared-memory L1 pool; without
# both flags (or across hosts) they are pickled into ZMQ messages
# (lmcache/v1/multiprocess/engine_context.py, modules/server_transfer.py).
SHM_POOL_FLAGS = ("--shm-name", "kvbench-lmcache-{port}", "--no-l1-use-lazy")
SYSTEMS = (
    System("recompute", "recompute", ".venv-vllm", is_shared=False),
    System(
        "lmcache",
        "lmcache",
        ".venv-lmcache",
        is_shared=True,
        server_flags=LMCACHE_FLAGS,
        one_host_flags=SHM_POOL_FLAGS,
    ),
    # The settings tried beside it (`--systems lmcache,lmcache-pickle,...`), all pickling.
    System(
        "lmcache-pickle",
        "lmcache",
        ".venv-lmcache",
        is_shared=True,
        server_flags=LMCACHE_FLAGS,
        by_default=False,
    ),
    System(
        "lmcache-128",
        "lmcache",
        ".venv-lmcache",
        is_shared=True,
        server_flags=("--supported-transfer-mode", "engine_driven", "--chunk-size", "128"),
        by_default=False,
    ),
    System(
        "lmcache-auto",
        "lmcache",
        ".venv-lmcache",
        is_shared=True,
        server_flags=(
            "--supported-transfer-mode",
            "auto",
            "--chunk-size",
            "256",
            "--max-workers",
            "2",
        ),
        by_default=False,
    ),
    # The server maps vLLM's own KV pages (moved to POSIX shm) and copies them itself: asked
    # for on vLLM's side, since on CPU its `auto` picks engine-driven.
    System(
        "lmcache-zero-copy",
        "lmcache",
        ".venv-lmcache",
        is_shared=True,
        connector_extra=(("lmcache.mp.mp_transfer_mode", "lmcache_driven"),),
        server_flags=("--supported-transfer-mode", "auto", "--chunk-size", "256"),
        by_default=False,
        one_host_only=True,
    ),
    System("kvstore", "kvstore", ".venv-vllm", is_shared=True),
    # kvstore loading before the forward pass, through its staging pool (the GPU path today).
    System(
        "kvstore-staged",
        "kvstore",
        ".venv-vllm",
        is_shared=True,
        connector_extra=(("kvstore.load_by_layer", False),),
        by_default=False,
    ),
    # "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" (vLLM 0.32).
    System("vllm-offloading", "offloading", ".venv-vllm", is_shared=False, needs_gpu=True),
)
