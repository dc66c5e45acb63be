"""`python -m kvstore.bench.dataplane_profile`: where the CPU of a get (or a put) over loopback
TCP goes.

For each system and block size, a peer (or a kvstore node) and a driver getting (or putting)
batches of 64 blocks in a loop, as `kvstore-bench dataplane` runs them; once the driver is
past its warm-up, `perf record` samples both processes (every thread) for a window, and
the loopback interface counts the bytes they moved meanwhile. Each row: the window's
GB/s, the cores the two processes kept busy, and their CPU per GB moved, split by where it
ran (the kernel's copies, the rest of the kernel: TCP, wake-ups, scheduling; the Python
interpreter; UCX and ucxx; libc's memcpy; CRC32C; anything else).

A system's bandwidth is the cores it keeps busy over its CPU per GB: the row shows what
that CPU is spent on, so which part of a ceiling is the transport's own. Needs `perf`
(Debian's `linux-perf`) and root or `kernel.perf_event_paranoid` <= 1.

    python -m kvstore.bench.dataplane_profile --sizes 64K,256K,1M --seconds 3 [--op put]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvstore.bench import dataplane
from kvstore.bench import dataplane_peers as peers
from kvstore.bench.report import Row, print_table, progress_bar, write_json
from kvstore.config import parse_bytes

BATCH = 64
SYSTEMS = ("tcp-socket", "ucxx-raw-tcp", "kvstore-ucx-tcp", "kvstore-tcp")
FREQ_HZ = 999  # perf's sampling rate: a sample is ~1 ms of one thread's CPU
WARM_BATCHES = 4  # batches moved before the window opens (connect, warm-up, first put)
WARM_TIMEOUT_S = 120.0
# (category, pattern on "dso symbol"); the first that matches takes the sample.
CATEGORIES = (
    ("kernel copy", re.compile(r"^\[kernel\S*\] .*(copy_to_iter|copy_from_iter|copy_user|memcpy)")),
    ("kernel other", re.compile(r"^\[kernel")),
    ("crc32c", re.compile(r"crc32c", re.I)),
    ("ucx", re.compile(r"^(libuc[ptsm]|libucxx|ucxx|libucs)")),
    ("memcpy", re.compile(r"^libc\.so\S* __mem(move|cpy)")),
    ("python", re.compile(r"^(libpython|python|_asyncio|\S*cpython)")),
)
_SAMPLE = re.compile(r"^\s*(\d+)\s+(\S+)\s+\[[.k]\]\s+(.+?)\s*$")


def _loopback_bytes(dev: str) -> int:
    """Bytes the loopback interface received, from /proc/net/dev's text `dev`."""
    for line in dev.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[0])  # received: each packet once
    raise RuntimeError("no loopback interface in /proc/net/dev")


def _loopback_now() -> int:
    return _loopback_bytes(Path("/proc/net/dev").read_text())


@contextlib.contextmanager
def _system(name: str) -> Iterator[tuple[list[int], Callable[[], Any], dict]]:
    """The peer of `name` running; yields its pids, the driver's target and UCX env."""
    spawn = mp.get_context("spawn")
    if name == "tcp-socket":
        queue = spawn.Queue()
        server = dataplane._spawn(peers.serve_tcp, queue)
        try:
            socket_address = ("127.0.0.1", queue.get(timeout=60))
            yield [server.pid], functools.partial(peers.drive_tcp, socket_address), {}
        finally:
            server.kill()
    elif name == "ucxx-raw-tcp":
        env = dataplane.UCX_TCP_ENV
        queue = spawn.Queue()
        server = dataplane._spawn(peers.serve_ucxx, queue, env=env)
        try:
            yield [server.pid], functools.partial(peers.drive_ucxx, queue.get(timeout=60)), env
        finally:
            server.kill()
    else:
        transport, env = (
            ("ucx", dataplane.UCX_TCP_ENV) if name == "kvstore-ucx-tcp" else ("tcp", {})
        )
        with dataplane._kvstore_server(env, transport) as (address, pid):
            yield [pid], functools.partial(peers.drive_kvstore, address, transport), env


def _drive_forever(drive: Callable[..., Any], op: str, size: int) -> None:
    drive([(op, size, BATCH)], 1 << 30)  # killed once the window closes


def profile(name: str, size: int, seconds: float, workdir: Path, op: str = "get") -> Row:
    """One row: `name`'s `op`s (get or put) of 64 x `size` bytes, sampled for `seconds`
    once warm."""
    with _system(name) as (pids, drive, env):
        start = _loopback_now()
        driver = dataplane._spawn(_drive_forever, drive, op, size, env=env)
        try:
            _wait_warm(start, WARM_BATCHES * BATCH * size, driver)
            data = workdir / f"{name}-{op}-{size}.data"
            # Samples span perf's whole run (it starts sampling before its command and
            # stops after): the bytes and the window are counted around all of it.
            targets = ",".join(str(p) for p in [*pids, driver.pid])
            cmd = ["perf", "record", "-q", "-F", str(FREQ_HZ), "-o", str(data), "-p", targets]
            before, began = _loopback_now(), time.perf_counter()
            subprocess.run([*cmd, "--", "sleep", str(seconds)], check=True, capture_output=True)
            window_s, moved = time.perf_counter() - began, _loopback_now() - before
        finally:
            driver.kill()
    samples = _samples(data)
    return {"op": op, **row_of(name, size, samples, moved, window_s)}


def _wait_warm(start: int, nbytes: int, driver: Any) -> None:
    deadline = time.monotonic() + WARM_TIMEOUT_S
    while _loopback_now() - start < nbytes:
        if not driver.is_alive():
            raise RuntimeError(f"the driver exited ({driver.exitcode}) before it was warm")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the driver moved under {nbytes} bytes in {WARM_TIMEOUT_S} s")
        time.sleep(0.05)


def _samples(data: Path) -> dict[str, int]:
    """Samples of each category in a `perf record` file."""
    cmd = ["perf", "report", "-i", str(data), "--stdio", "--no-children", "-g", "none"]
    cmd += ["--sort", "dso,sym", "-F", "sample,dso,sym", "--percent-limit", "0"]
    return categorize(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def categorize(report: str) -> dict[str, int]:
    """Samples of each category in `perf report --sort dso,sym -F sample,dso,sym` text."""
    counts = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0)
    for line in report.splitlines():
        found = _SAMPLE.match(line)
        if found is None:
            continue
        n, where = int(found.group(1)), f"{found.group(2)} {found.group(3)}"
        category = next((c for c, pattern in CATEGORIES if pattern.search(where)), "other")
        counts[category] += n
    return counts


def row_of(name: str, size: int, samples: dict[str, int], moved: int, window_s: float) -> Row:
    gb = moved / 1e9
    cpu_s = sum(samples.values()) / FREQ_HZ
    row: Row = {"system": name, "block_kib": size >> 10, "gbps": round(gb / window_s, 2)}
    row["cores_busy"] = round(cpu_s / window_s, 2)
    row["cpu_s_per_gb"] = round(cpu_s / gb, 3) if gb else None
    for category, n in samples.items():
        row[category.replace(" ", "_")] = round(n / FREQ_HZ / gb, 3) if gb else None
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvstore.bench.dataplane_profile", description=__doc__
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {','.join(SYSTEMS)}")
    parser.add_argument("--sizes", default="64K,256K,1M", help="block sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0, help="the sampled window")
    parser.add_argument("--op", choices=("get", "put"), default="get", help="what is driven")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("dataplane_profile needs perf: apt-get install linux-perf")
    systems = args.systems.split(",")
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        progress_bar("profile", len(systems) * len(sizes)) as advance,
    ):
        for size in sizes:
            for name in systems:
                rows.append(profile(name, size, args.seconds, Path(tmp), args.op))
                advance(1)
    print_table(rows, f"CPU per GB of {args.op}s, batches of 64 (cpu s / GB by where it ran)")
    if args.json:
        write_json(rows, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
