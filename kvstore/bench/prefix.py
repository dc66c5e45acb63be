"""Suite `prefix`: TTFT of real engine processes that recompute, reuse their own prefix cache,
or load prefixes from a kvstore node, on three public workload shapes.

Per workload and mode the suite starts fresh `kvstore engine` processes (`bench` preset), and
for the kvstore mode a `kvstore serve` node they share; the bench drives Generate and times
the first token from the stream. The floor of the long-doc row is what no system beats: the
loaded KV bytes at the raw UCX bandwidth (a raw ucxx peer, measured in the same run) plus the
TTFT of the same request with all but its question cached locally.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import signal
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from gpu_engine.engine_client import EngineClient, GenerateResult
from gpu_engine.sampling import SamplingParams
from kvstore.bench import dataplane_peers as peers
from kvstore.bench import verdict
from kvstore.bench.options import extra_of
from kvstore.bench.prefix_workloads import WORKLOADS, Advance, Shape, Workload, WorkloadRun
from kvstore.bench.report import Row, print_table, progress_bar
from kvstore.bench.suites import SuiteOptions
from kvstore.bench.turns import Turns, TurnTakingEngine
from kvstore.client import Client

MODES = ("recompute", "local", "kvstore")
BLOCK_TOKENS = 32
ENGINE_FLAGS = (
    "--model", "bench", "--block-tokens", str(BLOCK_TOKENS), "--page-tokens", str(BLOCK_TOKENS),
    "--num-pages", "1280", "--max-prefill-tokens", "2048", "--publish-buffers", "1024",
    "--load-batch-blocks", "256",
)  # fmt: skip
TARGETS = (  # (what, workload, numerator, denominator, at most)
    ("long-doc kvstore TTFT / recompute", "long-doc-qa", "kvstore", "recompute", 0.1),
    ("long-doc kvstore TTFT / floor", "long-doc-qa", "kvstore", "floor", 2.0),
    ("multi-round kvstore TTFT / recompute", "multi-round-qa", "kvstore", "recompute", 0.3),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="all",
        help="which workload shape to run (default: all three)",
    )


def run(options: SuiteOptions) -> list[Row]:
    names = list(WORKLOADS) if extra_of(options).get("workload", "all") == "all" else None
    names = names or [str(extra_of(options)["workload"])]
    workloads = [WORKLOADS[n] for n in names]
    total = sum(_num_requests(w, options.quick) for w in workloads) + 1
    rows: list[Row] = []
    with progress_bar("prefix", total) as advance:
        raw_gbps = _raw_ucx_gbps(_block_bytes())
        advance(1)
        for workload in workloads:
            rows += _run_workload(workload, options.quick, raw_gbps, advance)
    _print_targets(rows)
    return rows


def _num_requests(workload: Workload, quick: bool) -> int:
    shape = workload.quick if quick else workload.full
    return sum(workload.num_requests(shape, warm=m == "kvstore") for m in MODES)


def _block_bytes() -> int:
    from gpu_engine.config import EngineConfig

    return EngineConfig(model="bench", block_tokens=BLOCK_TOKENS).namespace.block_bytes


# -- processes -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def _store() -> Iterator[str]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "kvstore.cli", "--log-level", "WARNING", "serve",
        "--port", str(port), "--dram-bytes", "1GiB", "--dataplane", "ucx",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout_s=60)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(proc)


@contextlib.contextmanager
def _engines(count: int, mode: str, store: str | None) -> Iterator[list[EngineClient]]:
    flags = list(ENGINE_FLAGS)
    if mode == "recompute":
        flags += ["--enable-prefix-cache", "false"]
    if store is not None:
        flags += ["--store", store]
    ports = [_free_port() for _ in range(count)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "--log-level", "WARNING", "engine",
             "--port", str(port), *flags],
            stdout=subprocess.DEVNULL,
        )
        for port in ports
    ]  # fmt: skip
    clients = [EngineClient(f"127.0.0.1:{port}") for port in ports]
    try:
        for client in clients:
            client.wait_ready(timeout_s=120)
        yield clients
    finally:
        for client in clients:
            client.close()
        for proc in procs:
            _stop(proc)


def _raw_ucx_gbps(block_bytes: int) -> float:
    """Raw ucxx get bandwidth (GB/s) between two processes, batches of 64 blocks: the best
    of the batches, since a floor must not inherit the box's noise."""
    ctx = mp.get_context("spawn")
    addresses = ctx.Queue()
    server = ctx.Process(target=peers.serve_ucxx, args=(addresses,), daemon=True)
    server.start()
    try:
        address = addresses.get(timeout=60)
        cell = ("get", block_bytes, 64)
        with ctx.Pool(1) as pool:
            times = pool.apply(peers.drive_ucxx, (address, [cell], 20))[cell]
    finally:
        server.kill()
    return block_bytes * 64 / min(times) / 1e9


# -- one workload --------------------------------------------------------------------------


def _run_workload(workload: Workload, quick: bool, raw_gbps: float, advance: Advance) -> list[Row]:
    """Every mode at once, each in its own thread and processes, taking turns per request."""
    shape = workload.quick if quick else workload.full
    turns = Turns(MODES)
    with ThreadPoolExecutor(len(MODES)) as pool:
        futures = {m: pool.submit(_run_mode, workload, shape, m, turns, advance) for m in MODES}
        runs = {m: f.result() for m, f in futures.items()}
    baseline = [r.output_token_ids for r in runs["recompute"][0].measured]
    return [
        _row(workload, mode, run, bytes_loaded, baseline, raw_gbps)
        for mode, (run, bytes_loaded) in runs.items()
    ]


def _run_mode(
    workload: Workload, shape: Shape, mode: str, turns: Turns, advance: Advance
) -> tuple[WorkloadRun, int]:
    try:
        with contextlib.ExitStack() as stack:
            store = stack.enter_context(_store()) if mode == "kvstore" else None
            engines = stack.enter_context(_engines(workload.num_engines, mode, store))
            with turns.turn(mode):  # every mode's processes are up before the first request
                pass
            taking_turns = [TurnTakingEngine(e, turns, mode) for e in engines]

            def together(
                requests: Sequence[tuple[int, list[int]]], params: SamplingParams
            ) -> list[GenerateResult]:
                with turns.turn(mode), ThreadPoolExecutor(len(requests)) as pool:
                    calls = [pool.submit(engines[i].generate, p, params) for i, p in requests]
                    return [c.result() for c in calls]

            warm = mode == "kvstore"
            run = workload.drive(taking_turns, shape, warm, advance, together)
            bytes_loaded = sum(e.load().bytes_loaded for e in engines)
    finally:
        turns.leave(mode)
    return run, bytes_loaded


def _ms(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(
    workload: Workload,
    mode: str,
    run: WorkloadRun,
    bytes_loaded: int,
    baseline: list[tuple[int, ...]],
    raw_gbps: float,
) -> Row:
    measured = run.measured
    ttfts = [r.ttft_s for r in measured]
    tpots = [r.tpot_s for r in measured if r.tpot_s is not None]
    wall_s = _busy_s([(r.start_s, r.end_s) for r in measured])
    return {
        "workload": workload.name,
        "mode": mode,
        "requests": len(measured),
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p90_ms": _ms(ttfts, 0.9),
        "tpot_p50_ms": statistics.median(tpots) * 1000 if tpots else None,
        "throughput_tok_s": sum(len(r.output_token_ids) for r in measured) / wall_s,
        "prompt_tokens": sum(r.usage.prompt_tokens for r in measured),
        "cached_tokens": sum(r.usage.cached_tokens for r in measured),
        "store_cached_tokens": sum(r.usage.store_cached_tokens for r in measured),
        "bytes_loaded": bytes_loaded,
        "floor_ms": _floor_ms(run, raw_gbps) if mode == "kvstore" else None,
        "raw_ucx_gbps": raw_gbps if mode == "kvstore" else None,
        "outputs_identical": [r.output_token_ids for r in measured] == baseline,
    }


def _busy_s(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of `spans`: the wall time of requests that overlap
    within a round and never across the modes' turns."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy


def _floor_ms(run: WorkloadRun, raw_gbps: float) -> float | None:
    """p50 over the measured requests of: their loaded bytes at raw UCX speed, plus the best
    TTFT of the same shape with everything but the question already in the engine (`repeat`;
    the minimum, since a floor bounds from below and the box's noise only adds)."""
    if not run.repeat:
        return None
    suffix_s = min(r.ttft_s for r in run.repeat)
    per_request = [_loaded_bytes(r) / (raw_gbps * 1e9) + suffix_s for r in run.measured]
    return statistics.median(per_request) * 1000


def _loaded_bytes(result: GenerateResult) -> int:
    return result.usage.store_cached_tokens // BLOCK_TOKENS * _block_bytes()


def _p50(rows: dict[tuple[object, object], Row], workload: str, mode: str, col: str) -> float:
    """A row's value of `col` (NaN when the row or the value is absent)."""
    value = rows.get((workload, mode), {}).get(col)
    return float(value) if isinstance(value, int | float) else float("nan")


def _target_rows(rows: list[Row]) -> list[Row]:
    """The targets of the workloads that ran: each ratio, and whether it is met (a ratio
    that could not be computed, NaN, is not)."""
    by_key: dict[tuple[object, object], Row] = {(r["workload"], r["mode"]): r for r in rows}
    ran = {r["workload"] for r in rows}
    lines: list[Row] = []
    for what, workload, num, den, at_most in TARGETS:
        if workload not in ran:
            continue
        top = _p50(by_key, workload, num, "ttft_p50_ms")
        base = _p50(by_key, workload, num if den == "floor" else den,
                    "floor_ms" if den == "floor" else "ttft_p50_ms")  # fmt: skip
        lines.append({"target": what, "ratio": top / base, "at_most": at_most})
    for name in dict.fromkeys(str(r["workload"]) for r in rows):
        top = _p50(by_key, name, "kvstore", "tpot_p50_ms")
        base = _p50(by_key, name, "recompute", "tpot_p50_ms")
        what = f"{name} kvstore TPOT / recompute"
        lines.append({"target": what, "ratio": top / base, "at_most": 1.1})
    return [line | {"met": float(line["ratio"]) <= float(line["at_most"])} for line in lines]  # type: ignore[arg-type]


def failures(rows: list[Row]) -> list[str]:
    """Each target missed or unmeasured, in words."""
    return [
        f"{line['target']}: "
        + ("unmeasured" if line["ratio"] != line["ratio"] else f"{line['ratio']:.3g}")
        + f" (at most {line['at_most']})"
        for line in _target_rows(rows)
        if not line["met"]
    ]


def exit_status(rows: list[Row]) -> int:
    """1 where a target of a workload that ran is missed or unmeasured, else 0."""
    return verdict.exit_status(failures(rows))


def _print_targets(rows: list[Row]) -> None:
    lines = _target_rows(rows)
    if lines:
        print_table(lines, title="prefix targets (ratios within this run)")
