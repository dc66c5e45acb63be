"""`kvstore-bench vllm`: vLLM with kvstore vs LMCache vs recompute, same vLLM and model.

Workloads (token prompts, greedy, one request at a time):
  long-doc-qa     each document is questioned once by a fresh vLLM process that never saw
                  it; a writer process served it before (for systems that share KV).
  multi-round-qa  sessions whose every turn resends the history plus a new question.

Needs `.venv-vllm` (`make test-vllm` makes it) and, for LMCache, `.venv-lmcache` (see
README "Use with vLLM"). A system whose venv is missing is reported, not run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.options import extra_of
from bench.report import Row
from bench.suites import SuiteOptions
from bench.vllm_systems import ROOT, SYSTEMS, System

log = logging.getLogger("bench.vllm")
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
SIZES = {  # quick: same rows, smaller model and prompts
    False: {"model": "bench", "doc_len": 8192, "docs": 3, "sessions": 3, "turns": 4},
    True: {"model": "tiny", "doc_len": 1536, "docs": 2, "sessions": 2, "turns": 3},
}
QUESTION_LEN = 32
MAX_TOKENS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's own flags."""
    names = [s.name for s in SYSTEMS]
    parser.add_argument("--systems", default=",".join(names), help=f"subset of {names}")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a built model")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


def workloads(size: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Sessions of each workload, and the writer's sessions that fill shared caches."""
    rng = random.Random(0)
    docs = [_tokens(rng, size["doc_len"]) for _ in range(size["docs"])]
    reader = [{"turns": [d + _tokens(rng, QUESTION_LEN)]} for d in docs]
    writer = [{"turns": [d + _tokens(rng, QUESTION_LEN)]} for d in docs]
    system_prompt = _tokens(rng, 512)
    rounds = [
        {"turns": [system_prompt + _tokens(rng, 256)] + [_tokens(rng, 64)] * size["turns"]}
        for _ in range(size["sessions"])
    ]
    return {
        "long-doc-qa": {"reader": reader, "writer": writer},
        "multi-round-qa": {"reader": rounds, "writer": []},
    }


def _run_engine(system: System, spec: dict[str, Any], workdir: Path, name: str) -> list[dict]:
    spec_path, out_path = workdir / f"{name}.json", workdir / f"{name}.out"
    spec_path.write_text(json.dumps(spec))
    cmd = [system.python, "-m", "bench.vllm_engine", str(spec_path), str(out_path)]
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(ROOT)}
    with open(workdir / f"{name}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    return list(json.loads(out_path.read_text()))


def _run_system(system: System, model: str, wl: dict, size: dict, workdir: Path) -> list[dict]:
    """Per workload, the reader's records (a fresh process), after a writer if shared."""
    base = {"model": model, "connector": system.connector, "max_tokens": MAX_TOKENS}
    base["max_model_len"] = base["max_num_batched_tokens"] = size["doc_len"] + 512
    with system.serve(workdir) as server:
        base.update(server)
        results = {}
        for name, sessions in wl.items():
            if system.is_shared and sessions["writer"]:
                spec = {**base, "sessions": sessions["writer"]}
                _run_engine(system, spec, workdir, f"{system.name}-{name}-writer")
            spec = {**base, "sessions": sessions["reader"]}
            results[name] = _run_engine(system, spec, workdir, f"{system.name}-{name}-reader")
    return results


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _row(workload: str, system: str, records: list[dict], reference: list[dict] | None) -> Row:
    ttft = [r["ttft_s"] * 1e3 for r in records]
    same = reference is not None and [r["output"] for r in records] == [
        r["output"] for r in reference
    ]
    return {
        "workload": workload,
        "system": system,
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p90_ms": round(_pct(ttft, 0.9), 1),
        "tpot_p50_ms": round(statistics.median(r["tpot_s"] * 1e3 for r in records), 2),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "outputs_identical": same,
    }


def _build_model(path: Path, size: str) -> None:
    """Builds the model with the vLLM venv's transformers (the bench venv may lack it)."""
    cmd = [str(ROOT / ".venv-vllm/bin/python"), "-m", "bench.vllm_model", str(path), size]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def run(options: SuiteOptions) -> list[Row]:
    """One row per (workload, system); outputs compared with recompute's."""
    extra = extra_of(options)
    size = SIZES[options.quick]
    wanted = str(extra.get("systems") or ",".join(s.name for s in SYSTEMS)).split(",")
    recompute = next(s for s in SYSTEMS if s.name == "recompute")
    if (hint := recompute.missing()) is not None:
        raise SystemExit(f"kvstore-bench vllm: {hint}")  # the baseline every row needs
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-"))
    model_dir = extra.get("model_dir") or workdir / f"model-{size['model']}"
    _build_model(Path(str(model_dir)), size["model"])
    wl = workloads(size)
    results: dict[str, dict] = {}
    for system in (s for s in SYSTEMS if s.name in wanted or s.name == "recompute"):
        if system.needs_gpu and not _has_gpu():
            log.warning(
                "event=system_skipped system=%s reason=needs a CUDA or XPU GPU", system.name
            )
            continue
        if (hint := system.missing()) is not None:
            log.warning("event=system_skipped system=%s reason=%r", system.name, hint)
            continue
        try:
            results[system.name] = _run_system(system, str(model_dir), wl, size, workdir)
        except (subprocess.CalledProcessError, OSError, AssertionError, TimeoutError) as exc:
            log.warning("event=system_failed system=%s error=%r logs=%s", system.name, exc, workdir)
    ref = results.get("recompute", {})
    return [_row(w, name, res[w], ref.get(w)) for name, res in results.items() for w in wl]
