"""Helpers of the vLLM connector tests: a tiny offline model and vLLM runs in child
processes (vLLM spawns workers, so each run is its own interpreter)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvstore.bench.vllm_engine import ENV
from tests.conftest import wait_until

RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class VllmRun:
    """What one vLLM process returned: per-request records and its log."""

    records: list[dict[str, Any]]
    log: str

    @property
    def outputs(self) -> list[list[int]]:
        return [r["output"] for r in self.records]

    @property
    def cached_tokens(self) -> list[int]:
        return [r["cached_tokens"] for r in self.records]


def prompt_tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


def run_vllm(workdir: Path, name: str, **spec: Any) -> VllmRun:
    """Runs `kvstore.bench.vllm_engine` on `spec` in a fresh process; raises on failure."""
    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("json", "out", "log"))
    spec_path.write_text(json.dumps({"max_tokens": 8, "in_process": True, **spec}))
    cmd = [sys.executable, "-m", "kvstore.bench.vllm_engine", str(spec_path), str(out_path)]
    env = {**os.environ, **ENV}
    with open(log_path, "w") as log:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=RUN_TIMEOUT_S
        )
    text = log_path.read_text()
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{text[-4000:]}"
    return VllmRun(json.loads(out_path.read_text()), text)


def corrupt_ssd_blocks(ssd_path: Path) -> int:
    """Flips the last byte of every block record of a stopped store's SSD tier."""
    env = lmdb.open(str(ssd_path), max_dbs=2)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        records = list(txn.cursor())
        for key, value in records:
            txn.put(key, value[:-1] + bytes([value[-1] ^ 0xFF]))
    env.close()
    return len(records)


@dataclass
class OpenAIServer:
    """A `vllm.entrypoints.openai.api_server` child process on a loopback port."""

    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def is_healthy(self) -> bool:
        assert self.proc.poll() is None, f"the vLLM server exited:\n{self.log()[-4000:]}"
        try:
            with urllib.request.urlopen(self.base_url.removesuffix("/v1") + "/health", timeout=2):
                return True
        except OSError:
            return False

    def stop(self) -> int:
        """SIGTERM (vLLM shuts its engine down, and the connector flushes), then waits."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=SERVER_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


SERVER_START_S = 600.0
SERVER_STOP_S = 120.0
# vLLM's default (0) force-kills the engine and its workers at once on SIGTERM, before the
# connector's shutdown can flush its queued publishes; a positive value gives them that long.
ENGINE_SHUTDOWN_S = 60


def server_command(model: str, port: int, kv_transfer_config: dict[str, Any]) -> list[str]:
    """The OpenAI-compatible server of the CPU wheel (`vllm serve` looks up the wrong
    distribution name there), with the kvstore connector."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", model, "--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "float32", "--block-size", "32", "--max-model-len", "2048"),
        *("--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details"),
        *("--shutdown-timeout", str(ENGINE_SHUTDOWN_S)),
        *("--kv-transfer-config", json.dumps(kv_transfer_config)),
    ]


@contextlib.contextmanager
def openai_server(
    workdir: Path, name: str, model: str, kv_transfer_config: dict[str, Any], port: int
) -> Iterator[OpenAIServer]:
    """Starts a vLLM OpenAI server, waits (bounded) until it is healthy, stops it after."""
    log_path = workdir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_command(model, port, kv_transfer_config),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
        )
    server = OpenAIServer(proc, f"http://127.0.0.1:{port}/v1", log_path)
    try:
        wait_until(server.is_healthy, SERVER_START_S, f"vLLM server {name} is healthy")
        yield server
    finally:
        if proc.poll() is None:
            server.stop()
