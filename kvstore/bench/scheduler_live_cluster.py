"""The processes of a live scheduler run: a store node and engine processes (roles prefill and
decode) on free loopback ports, started together and stopped together."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from gpu_engine.engine_client import EngineClient
from kvstore.client import Client

START_TIMEOUT_S = 120.0


class EngineSpec(NamedTuple):
    """How every engine of the run is started (`kvstore engine` flags)."""

    model: str
    num_pages: int
    max_num_seqs: int = 32
    max_prefill_tokens: int = 4096

    def flags(self) -> list[str]:
        return [
            "--model", self.model, "--num-pages", str(self.num_pages),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-prefill-tokens", str(self.max_prefill_tokens),
        ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveProcesses:
    """A store and one engine per role in `roles`; a context manager.

    Attributes (inside the block): `store` and `engines` ("host:port", in `roles` order).
    """

    def __init__(self, spec: EngineSpec, roles: Sequence[str], dram_bytes: str = "1GiB") -> None:
        self.spec, self.roles, self.dram_bytes = spec, list(roles), dram_bytes
        self._dir = Path(tempfile.mkdtemp(prefix="scheduler-live-"))
        self._procs: list[subprocess.Popen] = []
        self.store = ""
        self.engines: list[str] = []

    def __enter__(self) -> LiveProcesses:
        try:
            store = self._spawn("store", "serve", "--port", "0", "--dram-bytes", self.dram_bytes)
            ports = [_free_port() for _ in self.roles]
            self.store = f"127.0.0.1:{self._store_port(store)}"
            for i, (role, port) in enumerate(zip(self.roles, ports, strict=True)):
                flags = ["--port", str(port), "--role", role, "--store", self.store]
                self._spawn(f"engine-{i}-{role}", "engine", *flags, *self.spec.flags())
                self.engines.append(f"127.0.0.1:{port}")
            for address in self.engines:
                with EngineClient(address) as engine:
                    engine.wait_ready(timeout_s=START_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self._dir / f"{name}.log", "w")  # noqa: SIM115 - the child holds it
        cmd = [sys.executable, "-m", "kvstore.cli", *args]
        self._procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        log.close()
        return self._procs[-1]

    def _store_port(self, proc: subprocess.Popen) -> str:
        log_path = self._dir / "store.log"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"event=serving address=\S+:(\d+)", log_path.read_text())
            if found:
                with Client(f"127.0.0.1:{found.group(1)}", timeout_s=5.0) as client:
                    client.health()
                return found.group(1)
            time.sleep(0.05)  # waiting on another process's start, bounded by the deadline
        raise RuntimeError(f"the store did not start:\n{log_path.read_text()}")

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._procs.clear()
