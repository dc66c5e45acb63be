"""The server side of suite `load`: a real `kvstore serve` process on a free loopback port,
and what the kernel says it holds (resident memory, open file descriptors)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.client import Client


@dataclass(frozen=True)
class ServerProcess:
    """A running `kvstore serve` child; its log goes to `log_path`."""

    proc: subprocess.Popen
    address: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        """Resident memory now (`VmRSS` of /proc/PID/status)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS in /proc/{self.pid}/status")

    def num_fds(self) -> int:
        """Open file descriptors now (entries of /proc/PID/fd)."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def log_tail(self, num_lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(flags: Sequence[str], log_dir: Path, timeout_s: float = 60.0) -> Iterator[ServerProcess]:
    """Runs `kvstore serve FLAGS` on a free port until the block ends, then SIGTERM.

    Raises RuntimeError, with the log's tail, when the server does not answer within
    `timeout_s`.
    """
    port = free_port()
    log_path = log_dir / f"kvstore-serve-{port}.log"
    cmd = [
        sys.executable, "-m", "kvstore.cli", "--log-level", "WARNING", "serve",
        "--host", "127.0.0.1", "--port", str(port), *flags,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(proc, f"127.0.0.1:{port}", log_path)
    try:
        with Client(server.address, timeout_s=timeout_s, transport="grpc") as client:
            try:
                client.wait_ready(timeout_s=timeout_s)
            except Exception:
                raise RuntimeError(f"kvstore serve did not start:\n{server.log_tail()}") from None
        yield server
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
