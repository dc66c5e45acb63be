"""`kvstore-bench vllm`: vLLM with kvstore vs LMCache vs recompute, same vLLM and model.

Workloads (token prompts, greedy, one request at a time):
  long-doc-qa     each document is questioned once by a fresh vLLM process that never saw
                  it; a writer process served it before (for systems that share KV).
  multi-round-qa  sessions whose every turn resends the history plus a new question.

Needs `.venv-vllm` (`make test-vllm` makes it) and, for LMCache, `.venv-lmcache` (see
docs/vllm.md). A system whose venv is missing is reported, not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from kvstore.bench import dataplane_peers as peers
from kvstore.bench import hosts, verdict, vllm_phases, vllm_targets, vllm_tpot
from kvstore.bench.hosts import ONE_HOST, Hosts
from kvstore.bench.options import extra_of
from kvstore.bench.report import Row, progress_bar
from kvstore.bench.suites import SuiteOptions
from kvstore.bench.vllm_engine import BLOCK_TOKENS
from kvstore.bench.vllm_rows import kv_bytes_per_token, row
from kvstore.bench.vllm_systems import ROOT, SYSTEMS, System

log = logging.getLogger("kvstore.bench.vllm")
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}


class RunSize(TypedDict):
    """The model (a `kvstore.bench.vllm_model` size) and workloads of one run."""

    model: str
    doc_tokens: tuple[int, ...]  # long-doc QA document sizes
    docs: int  # long-doc QA documents
    sessions: int  # multi-round QA sessions
    turns: int  # multi-round QA turns after the first


SIZES: dict[bool, RunSize] = {  # quick: same rows, smaller model and prompts
    False: {
        "model": "bench",
        "doc_tokens": (512, 2048, 8192),
        "docs": 3,
        "sessions": 3,
        "turns": 4,
    },
    True: {"model": "tiny", "doc_tokens": (512, 1536), "docs": 2, "sessions": 2, "turns": 3},
}
QUESTION_LEN = 32
DEFAULT_SYSTEMS = tuple(s.name for s in SYSTEMS if s.by_default)  # without --systems
MAX_TOKENS = 16
DATAPLANE_GETS = 20  # calls timed for the data plane's get bandwidth (`dataplane_get_gbps`)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's own flags."""
    names = [s.name for s in SYSTEMS]
    default = ",".join(DEFAULT_SYSTEMS)
    parser.add_argument("--systems", default=default, help=f"subset of {names} (default {default})")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a built model")
    parser.add_argument(
        "--doc-tokens",
        default=None,
        help="long-doc QA document sizes, comma-separated (default 512,2048,8192; quick 512,1536)",
    )
    parser.add_argument(
        "--hosts",
        choices=("one", "netns"),
        default="one",
        help="netns: each server in a network namespace and every vLLM process in another,"
        " joined by a veth pair (root): KV crosses a network stack, as between two hosts",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="kvstore only: where the time of a fresh process's first and later loads goes",
    )
    parser.add_argument(
        "--tpot",
        action="store_true",
        help="whether the connector slows decode: TPOT with none, a null one and kvstore's",
    )


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2000) for _ in range(n)]


def long_doc_qa(num_docs: int, doc_tokens: int) -> dict[str, list[dict]]:
    """Each document asked once, then each question again (vLLM's own prefix cache serves
    the repeat: the baseline of the effective load bandwidth); the writer asks others."""
    rng = random.Random(doc_tokens)
    docs = [_tokens(rng, doc_tokens) for _ in range(num_docs)]
    asks = [{"turns": [d + _tokens(rng, QUESTION_LEN)]} for d in docs]
    writer = [{"turns": [d + _tokens(rng, QUESTION_LEN)]} for d in docs]
    return {"reader": asks + asks, "writer": writer}


def workloads(size: RunSize, doc_sizes: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Sessions of each workload, and the writer's sessions that fill shared caches."""
    wl = {f"long-doc-qa/{n}": long_doc_qa(size["docs"], n) for n in doc_sizes}
    rng = random.Random(0)
    system_prompt = _tokens(rng, 512)
    rounds = [
        {"turns": [system_prompt + _tokens(rng, 256)] + [_tokens(rng, 64)] * size["turns"]}
        for _ in range(size["sessions"])
    ]
    wl["multi-round-qa"] = {"reader": rounds, "writer": []}
    return wl


def _context_len(workload: str) -> int:
    if workload.startswith("long-doc-qa/"):
        return int(workload.split("/")[1]) + 512
    return 2048


def _run_engine(
    system: System, spec: dict[str, Any], workdir: Path, name: str, where: Hosts = ONE_HOST
) -> list[dict]:
    """Runs one vLLM process (on the client side) over `spec`; returns its records."""
    spec_path, out_path = workdir / f"{name}.json", workdir / f"{name}.out"
    spec_path.write_text(json.dumps(spec))
    cmd = [system.python, "-m", "kvstore.bench.vllm_engine", str(spec_path), str(out_path)]
    cmd = where.client_command(cmd)
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(ROOT)}
    with open(workdir / f"{name}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
    return list(json.loads(out_path.read_text()))


def _run_system(
    system: System,
    model: str,
    wl: dict,
    workdir: Path,
    advance: Callable[[int], None],
    store_block_bytes: int,
    where: Hosts = ONE_HOST,
) -> tuple[dict[str, list[dict]], float | None]:
    """Per workload, the reader's records (a fresh process), after a writer if shared;
    and for kvstore, its data plane's get bandwidth at the same block size, on the same
    node right after (the reference of the effective load bandwidth)."""
    base = {"model": model, "connector": system.connector, "max_tokens": MAX_TOKENS}
    base["connector_extra"] = dict(system.connector_extra)
    with system.serve(workdir, where) as server:
        base.update(server)
        results = {}
        for name, sessions in wl.items():
            base["max_model_len"] = base["max_num_batched_tokens"] = _context_len(name)
            tag = f"{system.name}-{name.replace('/', '-')}"
            if system.is_shared and sessions["writer"]:
                spec = {**base, "sessions": sessions["writer"]}
                _run_engine(system, spec, workdir, f"{tag}-writer", where)
            spec = {**base, "sessions": sessions["reader"]}
            results[name] = _run_engine(system, spec, workdir, f"{tag}-reader", where)
            advance(1)
        get_gbps = None
        if "store" in server:
            get_gbps = dataplane_get_gbps(str(server["store"]), store_block_bytes, where)
    return results, get_gbps


def block_bytes(model: str) -> int:
    """A KV block's bytes in the store for a `kvstore.bench.vllm_model` size."""
    return kv_bytes_per_token(model) * BLOCK_TOKENS


def dataplane_get_gbps(address: str, size: int, where: Hosts = ONE_HOST) -> float:
    """`kvstore-bench dataplane`'s get (batches of 64, shared-memory buffers) of `size`-byte
    blocks from the node at `address`, from the client side (over shared memory on one
    host, else the tcp plane): median GB/s of DATAPLANE_GETS calls."""
    cell = ("get", size, 64)
    transport = "shm" if where.client_ns is None else "tcp"
    drive = (peers.drive_kvstore, address, transport, [cell], DATAPLANE_GETS)
    times = hosts.call_from(where.client_ns, *drive)[cell]
    return round(64 * size / statistics.median(times) / 1e9, 3)


def _build_model(path: Path, size: str) -> None:
    """Builds the model with the vLLM venv's transformers (the bench venv may lack it)."""
    cmd = [str(ROOT / ".venv-vllm/bin/python"), "-m", "kvstore.bench.vllm_model", str(path), size]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def _doc_sizes(extra: Mapping[str, object], quick: bool) -> tuple[int, ...]:
    text = extra.get("doc_tokens")
    if not text:
        return tuple(SIZES[quick]["doc_tokens"])
    sizes = tuple(int(n) for n in str(text).split(","))
    if any(n < QUESTION_LEN for n in sizes):
        raise SystemExit(f"kvstore-bench vllm: --doc-tokens must be >= {QUESTION_LEN}")
    return sizes


def _system(name: str) -> System:
    return next(s for s in SYSTEMS if s.name == name)


def _usable(system: System, across: bool) -> bool:
    if across and system.one_host_only:
        log.warning("event=system_skipped system=%s reason=one host only", system.name)
        return False
    if system.needs_gpu and not _has_gpu():
        log.warning("event=system_skipped system=%s reason=needs a CUDA or XPU GPU", system.name)
        return False
    if (hint := system.missing()) is not None:
        log.warning("event=system_skipped system=%s reason=%r", system.name, hint)
        return False
    return True


def run(options: SuiteOptions) -> list[Row]:
    """One row per (workload, document size, system); outputs compared with recompute's."""
    extra = extra_of(options)
    size = SIZES[options.quick]
    recompute = _system("recompute")
    if (hint := recompute.missing()) is not None:
        raise SystemExit(f"kvstore-bench vllm: {hint}")  # the baseline every row needs
    doc_sizes = _doc_sizes(extra, options.quick)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-"))
    model_dir = Path(str(extra.get("model_dir") or workdir / f"model-{size['model']}"))
    _build_model(model_dir, size["model"])
    if extra.get("phases"):
        return _run_phases(model_dir, size["model"], doc_sizes, workdir)
    if extra.get("tpot"):
        return _run_tpot(model_dir, doc_sizes, workdir)
    wanted = str(extra.get("systems") or ",".join(DEFAULT_SYSTEMS)).split(",")
    across = extra.get("hosts") == "netns"
    wanted_systems = [s for s in SYSTEMS if s.name in wanted or s is recompute]
    systems = [s for s in wanted_systems if _usable(s, across)]
    wl = workloads(size, doc_sizes)
    results: dict[str, dict] = {}
    gets: dict[str, float | None] = {}
    with (
        hosts.netns_pair() if across else contextlib.nullcontext(ONE_HOST) as where,
        progress_bar("vllm", len(systems) * len(wl)) as advance,
    ):
        for system in systems:
            try:
                found = _run_system(
                    system, str(model_dir), wl, workdir, advance, block_bytes(size["model"]), where
                )
                results[system.name], gets[system.name] = found
            except (subprocess.CalledProcessError, OSError, AssertionError, TimeoutError) as exc:
                log.warning(
                    "event=system_failed system=%s error=%r logs=%s", system.name, exc, workdir
                )
    ref = results.get("recompute", {})
    rows = [
        row(w, name, res[w], ref.get(w), size["model"], gets.get(name))
        for w in wl
        for name, res in results.items()
    ]
    return [{"hosts": "netns", **r} for r in rows] if across else rows


def exit_status(rows: list[Row]) -> int:
    """1 where a target is missed or unmeasured (`kvstore.bench.vllm_targets`), else 0."""
    return verdict.exit_status(vllm_targets.failures(rows))


def _run_phases(model_dir: Path, model: str, doc_sizes: Sequence[int], workdir: Path) -> list[Row]:
    """Per document size: a writer, then per load mode a fresh reader whose connector logs
    its phases."""
    kvstore = _system("kvstore")
    rows: list[Row] = []
    num_runs = len(doc_sizes) * len(vllm_phases.MODES)
    with kvstore.serve(workdir) as server, progress_bar("vllm phases", num_runs) as advance:
        for n in doc_sizes:
            spec: dict[str, Any] = {"model": str(model_dir), "connector": "kvstore", **server}
            spec |= {"max_tokens": MAX_TOKENS, "max_model_len": n + 512}
            spec["max_num_batched_tokens"] = n + 512
            sessions = vllm_phases.sessions(n, QUESTION_LEN)
            _run_engine(kvstore, {**spec, "sessions": sessions["writer"]}, workdir, f"w{n}")
            for mode in vllm_phases.MODES:
                reader = {**spec, **vllm_phases.reader_spec(mode), "sessions": sessions["reader"]}
                records = _run_engine(kvstore, reader, workdir, f"r{n}-{mode}")
                log_text = vllm_phases.read_log(workdir / f"r{n}-{mode}.log")
                rows += vllm_phases.phase_rows(records, log_text, n, mode)
                advance(1)
    del model
    return rows


def _run_tpot(model_dir: Path, doc_sizes: Sequence[int], workdir: Path) -> list[Row]:
    """Per document size, paired rounds of fresh processes, one per `vllm_tpot.VARIANTS`,
    on the same new prompts; see `kvstore.bench.vllm_tpot`."""
    kvstore = _system("kvstore")  # its venv runs every variant
    if (hint := kvstore.missing()) is not None:
        raise SystemExit(f"kvstore-bench vllm: {hint}")
    rows: list[Row] = []
    num_runs = len(doc_sizes) * vllm_tpot.ROUNDS * len(vllm_tpot.VARIANTS)
    with kvstore.serve(workdir) as server, progress_bar("vllm tpot", num_runs) as advance:
        for n in doc_sizes:
            spec: dict[str, Any] = {"model": str(model_dir), "max_tokens": vllm_tpot.MAX_TOKENS}
            spec |= {"max_model_len": n + 512, "max_num_batched_tokens": n + 512, **server}
            rounds, identical = [], True
            stats: tuple[int, ...] = (0, 0, 0)  # blocks published, dropped, failed
            for r in range(vllm_tpot.ROUNDS):
                tpot_ms, outputs = {}, []
                for name in vllm_tpot.order(r):
                    connector, extra = vllm_tpot.VARIANTS[name]
                    run = {**spec, "connector": connector, "connector_extra": extra}
                    tag = f"tpot{n}-r{r}-{name}"
                    records = _run_engine(
                        kvstore, run | {"sessions": vllm_tpot.sessions(n, r)}, workdir, tag
                    )
                    tpot_ms[name] = vllm_tpot.process_tpot_ms(records)
                    outputs.append([rec["output"] for rec in records])
                    found = vllm_tpot.published(vllm_phases.read_log(workdir / f"{tag}.log"))
                    stats = tuple(a + b for a, b in zip(stats, found, strict=True))
                    advance(1)
                rounds.append(tpot_ms)
                identical = identical and all(out == outputs[0] for out in outputs)
            rows.append(vllm_tpot.tpot_row(n, rounds, stats, identical))
    return rows
