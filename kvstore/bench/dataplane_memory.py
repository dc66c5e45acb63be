"""`python -m kvstore.bench.dataplane_memory`: what bounds a same-host get on this host's memory.

A same-host get moves every byte once (the node's copy into memory the client shares) and
reads it once more (the client's CRC32C check where it landed), on two cores that share the
memory. Per block size, a batch of 64, medians of `--reps` passes taken in turn:

- memcpy: the `dataplane` suite's baseline, numpy's copy between two anonymous arrays;
- copy: the node's copy (`regions.copy`) from its own memory into a shared region, alone;
- check: the client's CRC32C of every landed block, alone;
- copy, a core busy: the copy while another process sums one block over and over in its
  cache (a core taken, the memory left alone);
- copy, memory busy: the copy while another process sums 64 other blocks from memory (at
  least 256 MiB, past any L3: the traffic of a get's check, when its blocks are no longer
  in the cache); beside it, how fast that neighbour summed meanwhile.

If `copy, a core busy` is `copy` and `copy, memory busy` is far longer, the two passes of a
get contend for memory, not for cores. A VM's two cores may share a path to memory in one
placement and not in another (on EPYC, a core complex's link), as its host moves them: then
the same row reads either, and the neighbour's own rate says which (slower when shared). A
get overlaps its check with its copy (two processes, block by block), so its time lies
between the copy alone and the two passes one after the other: get/memcpy between `alone`
(memcpy over the copy: the check for free) and `serial` (memcpy over copy and check). Where
it falls is what the overlap recovers of the check's reads; the `dataplane` suite's
`shm-ceiling` row measures it.

    python -m kvstore.bench.dataplane_memory --sizes 256K,1M,4M --reps 30
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.dataplane_peers import _timed
from kvstore.bench.report import Row, print_table, progress_bar, write_json
from kvstore.checksum import checksum
from kvstore.config import parse_bytes
from kvstore.dataplane.shm.regions import Region, copy

BATCH = 64
START_TIMEOUT_S = 30.0  # for the neighbour process to start summing
NEIGHBOUR_BYTES = 256 << 20  # the least a memory-busy neighbour sums: past any L3 cache
BUSY_CORE_BYTES = 256 << 10  # the most a core-busy neighbour sums: inside any L2 cache


def _sum_forever(nbytes: int, block_bytes: int, started: Any, stop: Any, summed: Any) -> None:
    """The neighbour: sums `nbytes` block by block until `stop`, saying when it started and
    counting the bytes it summed in `summed` (its only writer)."""
    data = np.ones(nbytes, np.uint8)
    started.set()
    while not stop.is_set():
        for start in range(0, nbytes, block_bytes):
            checksum(data[start : start + block_bytes])
        summed.value += nbytes


class _Neighbour:
    """Another process summing `nbytes` in a loop while the block runs; `gbps` after it: how
    fast it summed meanwhile (slower where it shares a path to memory with the copy)."""

    def __init__(self, nbytes: int, block_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        self._started, self._stop = ctx.Event(), ctx.Event()
        self._summed = ctx.RawValue("Q", 0)
        args = (nbytes, block_bytes, self._started, self._stop, self._summed)
        self._process = ctx.Process(target=_sum_forever, args=args, daemon=True)
        self._since = (0.0, 0)
        self.gbps = 0.0

    def __enter__(self) -> _Neighbour:
        self._process.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._started.wait(0.1):
            if not self._process.is_alive() or time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError("the neighbour process did not start summing")
        self._since = (time.perf_counter(), self._summed.value)
        return self

    def __exit__(self, *exc: object) -> None:
        start, summed = self._since
        self.gbps = (self._summed.value - summed) / (time.perf_counter() - start) / 1e9
        self._stop.set()
        self._process.join(START_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median of `fn`'s passes, timed as the `dataplane` suite times a cell."""
    return statistics.median(_timed(fn, reps)) * 1e3


def measure(block_bytes: int, reps: int) -> Row:
    """One row: every pass over a batch of 64 blocks of `block_bytes`, in ms."""
    total = BATCH * block_bytes
    src = [np.ones(block_bytes, np.uint8) for _ in range(BATCH)]
    dst = [np.zeros(block_bytes, np.uint8) for _ in range(BATCH)]
    slots = np.ones(total, np.uint8)  # the node's memory
    region, fd = Region.create(total)  # the client's, shared
    os.close(fd)
    region.array[:] = 0
    landed = [region.array[i * block_bytes : (i + 1) * block_bytes] for i in range(BATCH)]
    mine = [slots[i * block_bytes : (i + 1) * block_bytes] for i in range(BATCH)]

    def memcpy() -> None:
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)

    def node_copy() -> None:
        for s, d in zip(mine, landed, strict=True):
            copy(d, s)

    def check() -> None:
        for block in landed:
            checksum(block)

    try:
        row: Row = {"block_kib": block_bytes >> 10}
        row["memcpy_ms"] = _median_ms(memcpy, reps)
        row["copy_ms"] = _median_ms(node_copy, reps)
        row["check_ms"] = _median_ms(check, reps)
        with _Neighbour(min(block_bytes, BUSY_CORE_BYTES), block_bytes):
            row["copy_core_busy_ms"] = _median_ms(node_copy, reps)
        with _Neighbour(max(total, NEIGHBOUR_BYTES), block_bytes) as neighbour:
            row["copy_memory_busy_ms"] = _median_ms(node_copy, reps)
        row["neighbour_gbps"] = neighbour.gbps
    finally:
        region.close()  # unmapped once the views above are gone
    return _with_ratios(row)


def _with_ratios(row: Row) -> Row:
    """`row` rounded, with the ratios it shows: what each neighbour costs the copy, and the
    get/memcpy of a get whose check were free (`alone`) or not overlapped at all (`serial`)."""
    ms = {k: float(v) for k, v in row.items() if k.endswith("_ms")}  # type: ignore[arg-type]
    out: Row = {"block_kib": row["block_kib"], **{k: round(v, 3) for k, v in ms.items()}}
    out["neighbour_gbps"] = round(float(row["neighbour_gbps"]), 2)  # type: ignore[arg-type]
    out["core_busy/alone"] = round(ms["copy_core_busy_ms"] / ms["copy_ms"], 2)
    out["memory_busy/alone"] = round(ms["copy_memory_busy_ms"] / ms["copy_ms"], 2)
    out["alone get/memcpy"] = round(ms["memcpy_ms"] / ms["copy_ms"], 2)
    out["serial get/memcpy"] = round(ms["memcpy_ms"] / (ms["copy_ms"] + ms["check_ms"]), 2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvstore.bench.dataplane_memory", description=__doc__
    )
    parser.add_argument("--sizes", default="256K,1M,4M", help="block sizes, comma-separated")
    parser.add_argument("--reps", type=int, default=30, help="passes timed per measurement")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rows = []
    with progress_bar("memory", len(sizes)) as advance:
        for size in sizes:
            rows.append(measure(size, args.reps))
            advance(1)
    print_table(rows, f"a same-host get's two passes on this host's memory, batches of {BATCH}")
    if args.json:
        write_json(rows, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
