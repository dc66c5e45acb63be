"""The targets of suite `dataplane`: kvstore's GB/s as ratios to the limits and peers
measured in the same run (`RATIOS`), per block size, and which targets a ratio misses."""

from __future__ import annotations

import statistics
from typing import cast

from kvstore.bench.report import Row

BLOCK_BYTES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
# (column, numerator system, op, denominator system, op, at least, from block size); ratios
# of GB/s at batch 64, per block size, targets from that size up (none: reported only). On
# the node's host a client moves bytes over shared memory ("auto" picks it), elsewhere UCX.
RATIOS = (
    ("put/memcpy", "kvstore-shm", "put", "memcpy", "put", 0.6, 1 << 20),
    ("put/mooncake", "kvstore-shm", "put", "mooncake", "put", 1.0, 256 << 10),
    ("ucx put/raw-ucxx", "kvstore-ucx", "put", "ucxx-raw", "put", None, 0),
    ("get/memcpy", "kvstore-shm", "get", "memcpy", "get", 0.8, 1 << 20),
    ("get/mooncake", "kvstore-shm", "get", "mooncake", "get", 1.0, 256 << 10),
    ("ucx get/raw-ucxx", "kvstore-ucx", "get", "ucxx-raw", "get", None, 0),
    ("ucx-tcp get/tcp-socket", "kvstore-ucx-tcp", "get", "tcp-socket", "get", 0.9, 0),
    ("ucx-tcp put/tcp-socket", "kvstore-ucx-tcp", "put", "tcp-socket", "put", None, 0),
    ("tcp get/tcp-socket", "kvstore-tcp", "get", "tcp-socket", "get", 0.9, 0),
    ("tcp put/tcp-socket", "kvstore-tcp", "put", "tcp-socket", "put", None, 0),
    # The ceilings: the same transfers with the checks kvstore must make and nothing else
    # (`dataplane_ceilings`, a raw socket that sums), and where they stand against the limits.
    ("put/ceiling", "kvstore-shm", "put", "shm-ceiling", "put", None, 0),
    ("get/ceiling", "kvstore-shm", "get", "shm-ceiling", "get", None, 0),
    ("ceiling put/memcpy", "shm-ceiling", "put", "memcpy", "put", None, 0),
    ("ceiling get/memcpy", "shm-ceiling", "get", "memcpy", "get", None, 0),
    ("ucx-tcp get/tcp-crc32c", "kvstore-ucx-tcp", "get", "tcp-socket-crc32c", "get", None, 0),
    ("tcp get/tcp-crc32c", "kvstore-tcp", "get", "tcp-socket-crc32c", "get", None, 0),
    ("tcp-crc32c get/tcp", "tcp-socket-crc32c", "get", "tcp-socket", "get", None, 0),
)


def _gbps(rows: list[Row], system: str, op: str, size: int) -> float | None:
    for r in rows:
        if (r["system"], r["op"], r["block_bytes"], r["batch"]) == (system, op, size, 64):
            return r["gbps"]  # type: ignore[return-value]
    return None


def ratio_row(rows: list[Row], size: int) -> Row:
    """One block size: kvstore's GB/s, its ratio to each baseline, and the targets missed."""
    out: Row = {"block_bytes": size}
    out["put_gbps"] = _gbps(rows, "kvstore-shm", "put", size)
    out["get_gbps"] = _gbps(rows, "kvstore-shm", "get", size)
    out["ucx_put_gbps"] = _gbps(rows, "kvstore-ucx", "put", size)
    out["ucx_get_gbps"] = _gbps(rows, "kvstore-ucx", "get", size)
    for column, num, num_op, den, den_op, _, _ in RATIOS:
        a, b = _gbps(rows, num, num_op, size), _gbps(rows, den, den_op, size)
        out[column] = a / b if a and b else None
    # The client sums every block a get receives: that work's share of a get's time, if it
    # did not overlap the transfer (it does: each block is summed as it lands).
    get, crc = out["get_gbps"], _gbps(rows, "crc32c", "get", size)
    out["crc/get"] = get / crc if get and crc else None  # type: ignore[operator]
    out["missed"] = _missed(out)
    return out


def _missed(ratios: Row) -> str:
    """The targets a block size's ratios miss ("-": none); a target whose ratio could not be
    computed (a system absent or failed) is missed, as "unmeasured"."""
    missed = []
    for column, _, _, _, _, at_least, from_size in RATIOS:
        ratio = ratios[column]
        if at_least is None or cast(int, ratios["block_bytes"]) < from_size:
            continue
        if ratio is None:
            missed.append(f"{column} unmeasured")
        elif ratio < at_least:  # type: ignore[operator]
            missed.append(f"{column}<{at_least:g}")
    return " ".join(missed) or "-"


def failures(ratio_rows: list[Row]) -> list[str]:
    """Each block size's missed and unmeasured targets, in words."""
    return [f"{r['block_bytes']} B: {r['missed']}" for r in ratio_rows if r["missed"] != "-"]


def ratios(rows: list[Row]) -> list[Row]:
    return [ratio_row(rows, size) for size in BLOCK_BYTES]


def median_ratios(rounds: list[list[Row]]) -> list[Row]:
    """Per block size, each ratio's median over the rounds (each round's ratio is of figures
    measured minutes apart at most), and the targets that median misses."""
    per_round = [ratios(rows) for rows in rounds]
    out = []
    for i, size in enumerate(BLOCK_BYTES):
        row: Row = {"block_bytes": size, "rounds": len(rounds)}
        for column in per_round[0][i]:
            if column in ("block_bytes", "missed"):
                continue
            values = [r[i][column] for r in per_round if r[i][column] is not None]
            row[column] = statistics.median(values) if values else None  # type: ignore[type-var]
        row["missed"] = _missed(row)
        out.append(row)
    return out
