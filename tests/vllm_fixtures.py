"""Helpers of the vLLM connector tests: a tiny offline model and vLLM runs in child
processes (vLLM spawns workers, so each run is its own interpreter)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from bench.vllm_engine import ENV

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
    """Runs `bench.vllm_engine` on `spec` in a fresh process; raises on failure."""
    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("json", "out", "log"))
    spec_path.write_text(json.dumps({"max_tokens": 8, "in_process": True, **spec}))
    cmd = [sys.executable, "-m", "bench.vllm_engine", str(spec_path), str(out_path)]
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
