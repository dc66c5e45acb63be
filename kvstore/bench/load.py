"""Suite `load`: many client processes against one real store node, every read verified.

`kvstore-bench load --clients N --seconds T` starts `kvstore serve` on a free loopback port
with less DRAM than the working set, then N spawned client processes (`kvstore.bench.load_worker`),
each running a mixed loop of match, get and put over the data plane (UCX where both ends
have it), get and put over the gRPC byte path, and remove. Puts hit keys already present,
gets hit keys evicted or removed, and every found block is checked byte for byte.

Before the timed loop, each client puts its share of the working set (DRAM fills up and
evicts), then the same loop runs untimed for `warm_up_s`, so the server's allocators and
connections reach their level under this load. The row: ops/s and latency percentiles of
the timed loop; errors (exceptions, by class), corrupted and verified bytes of every op; the
server's RSS and open fds through the timed loop, every client connected all along: at its
start and end, the median RSS over its first and last quarter (a leak grows with time, a
pool that reached its level does not), and the whole series for `--json` and `--plot`. A
second table gives the figures per op. `--metrics PATH` writes the server's Prometheus
text, scraped once the clients stopped. Exit status 1 when any byte was corrupted.

`--attack stalled-readers|silent-sockets` runs a hostile client beside the load
(`kvstore.bench.attacks`), started before the clients connect and stopped after them: readers that
open `--attack-size` gRPC Get streams over one connection and never read them (default
300), or that many
sockets kept open to the TCP data plane without a hello (default 256; run it with
`--transport tcp` so the clients take that plane). The row must still show 0 errors and 0
corrupted bytes, and the server's RSS says what the attack made it hold.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import queue
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvstore.bench.attacks import KINDS, attack
from kvstore.bench.load_footprint import Snapshot, quarter_medians
from kvstore.bench.load_server import ServerProcess, free_port, serve
from kvstore.bench.load_worker import Channels, LoadConfig, WorkerResult, run_worker
from kvstore.bench.options import extra_of
from kvstore.bench.report import Row, print_table, pyplot
from kvstore.bench.suites import SuiteOptions
from kvstore.client import Client

FULL = LoadConfig(num_clients=32, seconds=60.0)
QUICK = LoadConfig(num_clients=4, seconds=5.0, warm_up_s=1.0, dram_bytes=16 << 20, num_prompts=64)
READY_TIMEOUT_S = 300.0  # 32 spawns and their warm-up puts on 2 cores
REPORT_TIMEOUT_S = 120.0
COUNTS = (
    "corrupted", "verified_bytes", "blocks_found", "blocks_missed", "blocks_present",
    "blocks_stored", "puts_refused_parent",
)  # fmt: skip


@dataclass(frozen=True)
class LoadRun:
    """Everything one run measured."""

    config: LoadConfig
    results: list[WorkerResult]
    lost_workers: dict[int, int | None]  # index -> exit code of workers that never reported
    elapsed_s: float
    footprint: list[Snapshot]  # through the timed loop: its start, every tick, its end
    evictions: int
    transport: str
    server_exit_code: int | None = None
    attack: str = ""  # the hostile client beside the load ("kind:size"), if any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, metavar="N", help="client processes (32)")
    parser.add_argument("--seconds", type=float, metavar="T", help="timed loop length (60)")
    parser.add_argument(
        "--transport", choices=("auto", "shm", "tcp", "ucx"), help="the clients' data plane (auto)"
    )
    parser.add_argument("--attack", choices=KINDS, help="a hostile client beside the load")
    parser.add_argument(
        "--attack-size", type=int, metavar="N", help="its streams (300) or sockets (256)"
    )
    parser.add_argument(
        "--metrics",
        type=Path,
        metavar="PATH",
        help="serve Prometheus metrics and write the server's /metrics, scraped after the "
        "clients stopped, to PATH",
    )


def _config(options: SuiteOptions) -> LoadConfig:
    base = QUICK if options.quick else FULL
    extra = extra_of(options)
    clients = cast("int | None", extra.get("clients")) or base.num_clients
    seconds = cast("float | None", extra.get("seconds")) or base.seconds
    transport = cast("str | None", extra.get("transport")) or base.transport
    return replace(base, num_clients=clients, seconds=seconds, transport=transport)


def _server_flags(config: LoadConfig, metrics_port: int | None, tcp_port: int) -> list[str]:
    metrics = ["--metrics-port", str(metrics_port)] if metrics_port else []
    return [
        "--dram-bytes", str(config.dram_bytes), "--slab-bytes", str(config.slab_bytes),
        "--dataplane", "auto", "--dataplane-tcp-port", str(tcp_port), *metrics,
    ]  # fmt: skip


@contextlib.contextmanager
def _beside(
    options: SuiteOptions, config: LoadConfig, server: ServerProcess, tcp_port: int
) -> Iterator[str]:
    """The attack `--attack` names, running until the block ends; yields its name ("" for
    none)."""
    extra = extra_of(options)
    kind = cast("str | None", extra.get("attack"))
    if not kind:
        yield ""
        return
    size = cast(int, extra.get("attack_size") or (300 if kind == "stalled-readers" else 256))
    target = server.address if kind == "stalled-readers" else f"127.0.0.1:{tcp_port}"
    # The readers' blocks take a quarter of DRAM (leased until their stall deadline), over
    # one connection: the load's clients have no tokens either, so the readers are one client
    # among them (over many connections they could take every stream slot of the node).
    flags = ["--blocks", "4", "--block-bytes", str(config.dram_bytes // 16), "--channels", "1"]
    with attack(kind, target, size, *(flags if kind == "stalled-readers" else [])) as ready:
        Console(stderr=True).print(f"attack beside the load: {kind} ({ready})")
        yield f"{kind}:{size}"


def _scrape(port: int, path: Path) -> None:
    """Writes the server's Prometheus text to `path`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        path.write_bytes(reply.read())
    Console(stderr=True).print(f"server metrics after the run: {path}")


# -- driving the workers -----------------------------------------------------------------


def _spawn_workers(config: LoadConfig, address: str) -> tuple[list[Any], Channels]:
    ctx = mp.get_context("spawn")
    channels = Channels(
        ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event(),
        ctx.RawArray("q", 2 * config.num_clients),
    )  # fmt: skip
    procs = [
        ctx.Process(target=run_worker, args=(config, i, address, channels), daemon=True)
        for i in range(config.num_clients)
    ]
    for proc in procs:
        proc.start()
    return procs, channels


def _gather(procs: list[Any], q: Any, timeout_s: float, what: str) -> dict[int, Any]:
    """Items from `q` until every live worker sent one (items are indices or results)."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            item = q.get(timeout=0.5)
            got[item if isinstance(item, int) else item.worker] = item
        except queue.Empty:
            if all(not p.is_alive() for i, p in enumerate(procs) if i not in got):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(procs) - len(got)} workers not {what} after {timeout_s} s"
                ) from None
    return got


def _phase(
    progress: Progress,
    title: str,
    seconds: float,
    live: Callable[[], dict],
    tick: Callable[[float], None] = lambda at_s: None,
) -> None:
    """Shows a bar for `seconds` with live figures while the workers run; calls
    `tick(seconds since the phase began)` every quarter second."""
    task = progress.add_task(title, total=seconds or 1, **live())
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        tick(elapsed)
        progress.update(task, completed=elapsed, **live())
        time.sleep(min(0.25, seconds - elapsed))
    progress.update(task, completed=seconds or 1, **live())


def _run_phases(
    config: LoadConfig, channels: Channels, server: ServerProcess
) -> tuple[float, list[Snapshot]]:
    """Warm-up, then the timed loop, both under the same load; returns the timed loop's
    seconds and the server's footprint through it."""
    counters = channels.counters
    footprint: list[Snapshot] = []

    def live() -> dict:
        ops, errs = sum(counters[0::2]), sum(counters[1::2])
        rss = footprint[-1].rss_bytes if footprint else server.rss_bytes()
        return {"ops": ops, "errors": errs, "rss_mib": rss >> 20}

    def sample(at_s: float) -> None:
        footprint.append(Snapshot.of(server, at_s))

    columns = (
        TextColumn("[progress.description]{task.description}"), BarColumn(),
        TextColumn("{task.fields[ops]:,} ops, {task.fields[errors]} errors, server RSS "
                   "{task.fields[rss_mib]:,} MiB"), TimeElapsedColumn(),
    )  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        channels.go.set()
        _phase(progress, "warm-up", config.warm_up_s, live)
        channels.timed.set()
        began = time.monotonic()
        _phase(progress, f"load: {config.num_clients} clients", config.seconds, live, sample)
        elapsed_s = time.monotonic() - began
        sample(elapsed_s)
        channels.stop.set()
        return elapsed_s, footprint


def _drive(config: LoadConfig, server: ServerProcess) -> LoadRun:
    with Client(server.address, timeout_s=config.timeout_s, transport="grpc") as admin:
        procs, channels = _spawn_workers(config, server.address)
        try:
            ready = _gather(procs, channels.ready, READY_TIMEOUT_S, "filled")
            elapsed_s, footprint = _run_phases(config, channels, server)
            results = _gather(procs, channels.results, REPORT_TIMEOUT_S, "reporting")
            evictions = admin.stats().evictions
        finally:
            for event in (channels.go, channels.timed, channels.stop, channels.release):
                event.set()
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    lost = {i: p.exitcode for i, p in enumerate(procs) if i not in results or i not in ready}
    transport = _transport_of(list(results.values()))
    return LoadRun(config, list(results.values()), lost, elapsed_s, footprint, evictions, transport)


def _transport_of(results: list[WorkerResult]) -> str:
    """The planes the data-plane ops took ("shm", "ucx", "grpc"), comma-joined."""
    names = {op.rsplit("-", 1)[1] for r in results for op in r.latencies_s if op.startswith("put-")}
    return ",".join(sorted(names - {"grpc"})) or "grpc"


# -- rows --------------------------------------------------------------------------------


def _percentiles_ms(latencies_s: np.ndarray) -> dict[str, float | None]:
    if latencies_s.size == 0:
        return {"p50_ms": None, "p99_ms": None, "p999_ms": None}
    p50, p99, p999 = np.percentile(latencies_s, [50, 99, 99.9]) * 1e3
    return {"p50_ms": float(p50), "p99_ms": float(p99), "p999_ms": float(p999)}


def _latencies(run: LoadRun, op: str | None = None) -> np.ndarray:
    arrays = [a for r in run.results for k, a in r.latencies_s.items() if op in (None, k)]
    return np.concatenate(arrays) if arrays else np.empty(0)


def _errors(run: LoadRun) -> Counter[str]:
    errors: Counter[str] = Counter()
    for r in run.results:
        errors.update(r.errors)
    errors.update({"WorkerLost": len(run.lost_workers)} if run.lost_workers else {})
    return errors


def summary_row(run: LoadRun) -> Row:
    """The one row of the run: throughput, latency, errors, integrity, server footprint."""
    latencies = _latencies(run)
    errors = _errors(run)
    total = {f: sum(getattr(r, f) for r in run.results) for f in COUNTS}
    return {
        "clients": run.config.num_clients,
        "attack": run.attack or "-",
        "seconds": round(run.elapsed_s, 2),
        "transport": run.transport,
        "ops": int(latencies.size),
        "ops_per_s": latencies.size / run.elapsed_s,
        **_percentiles_ms(latencies),
        "errors": errors.total(),
        "error_classes": " ".join(f"{k}={v}" for k, v in sorted(errors.items())),
        **total,
        "evictions": run.evictions,
        "rss_start_bytes": run.footprint[0].rss_bytes,
        "rss_end_bytes": run.footprint[-1].rss_bytes,
        **quarter_medians(run.footprint),
        "fds_start": run.footprint[0].num_fds,
        "fds_end": run.footprint[-1].num_fds,
        "fds_max": max(s.num_fds for s in run.footprint),
        "server_exit_code": run.server_exit_code,
        "footprint": [[round(s.at_s, 2), s.rss_bytes, s.num_fds] for s in run.footprint],
    }


def op_rows(run: LoadRun) -> list[Row]:
    """One row per op kind, then all ops together."""
    ops = sorted({k for r in run.results for k in r.latencies_s})
    rows: list[Row] = []
    for op in [*ops, None]:
        latencies = _latencies(run, op)
        rows.append(
            {"op": op or "all", "ops": int(latencies.size),
             "ops_per_s": latencies.size / run.elapsed_s, **_percentiles_ms(latencies)}
        )  # fmt: skip
    return rows


def _error_rows(run: LoadRun) -> list[Row]:
    samples: dict[str, str] = {}
    for r in run.results:
        for name, text in r.error_samples.items():
            samples.setdefault(name, text)
    for index, code in run.lost_workers.items():
        samples.setdefault("WorkerLost", f"worker {index} exited {code} without reporting")
    return [{"error": k, "count": n, "first": samples.get(k, "")} for k, n in _errors(run).items()]


def run(options: SuiteOptions) -> list[Row]:
    """Runs the load; prints the per-op and error tables; returns the one summary row."""
    config = _config(options)
    metrics_path = extra_of(options).get("metrics")
    metrics_port = free_port() if metrics_path else None
    tcp_port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvstore-load-") as tmp:
        with serve(_server_flags(config, metrics_port, tcp_port), Path(tmp)) as server:
            with _beside(options, config, server, tcp_port) as attacking:
                result = replace(_drive(config, server), attack=attacking)
            if metrics_port:
                _scrape(metrics_port, Path(str(metrics_path)))
        result = replace(result, server_exit_code=server.proc.returncode)
        if _errors(result):
            print_table(_error_rows(result), title="load errors (first message of each class)")
            Console(stderr=True).print(f"server log (tail):\n{server.log_tail()}")
    print_table(op_rows(result), title="load per op")
    return [summary_row(result)]


def plot(rows: list[Row], path: Path) -> None:
    """The server's RSS and open fds through the timed loop, with the quarter medians."""
    plt = pyplot()
    fig, (rss_ax, fds_ax) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for row in rows:
        at_s, rss, fds = np.array(row["footprint"], dtype=float).T
        rss_ax.plot(at_s, rss / 2**20, lw=1, label=f"{row['clients']} clients")
        fds_ax.plot(at_s, fds, lw=1)
        for key, part in (("rss_first_quarter_bytes", 0), ("rss_last_quarter_bytes", 3)):
            span = at_s[-1] / 4 * np.array([part, part + 1])
            rss_ax.plot(span, [row[key] / 2**20] * 2, "k--", lw=1)  # type: ignore[operator]
    rss_ax.set_ylabel("server RSS (MiB)")
    rss_ax.set_title("kvstore-bench load: server footprint (dashed: quarter medians)")
    rss_ax.legend(loc="lower right")
    fds_ax.set_ylabel("open fds")
    fds_ax.set_xlabel("seconds into the timed loop")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def exit_status(rows: list[Row]) -> int:
    """1 when any verified byte was corrupted, else 0."""
    return int(any(row["corrupted"] for row in rows))
