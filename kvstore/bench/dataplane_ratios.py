"""The targets of suite `dataplane`: kvstore's GB/s as ratios to the limits and peers
measured in the same run (`RATIOS`), per block size, and which targets a ratio misses.

Every ratio says what it compares (`Ratio.kind`, printed by `legend`):

- like for like: the same transport and the same placement of the client's buffers.
  On one host both kvstore and Mooncake Store move blocks through shared memory the store
  process maps (kvstore's shm plane; Mooncake's dummy client, whose buffer is in the pool
  its real client maps: `mooncake-store/src/dummy_client.cpp`, `real_client.cpp`), each
  copying a block once; over TCP, both from a buffer of the client process. Mooncake's
  copies carry no checksum; kvstore sums every block on both sides (a checksum failure is a
  miss), which the `shm-ceiling` row prices. The targets are stated on these first.
- best path: each system's fastest way to move a batch on this host, whatever it is (for
  Mooncake, per cell, the faster of its shm and TCP paths).
- limit / ceiling: kvstore against what the hardware or a bare transport does (memcpy with
  kvstore's copy threads, a raw socket, raw ucxx), and against the same transfers with only
  the checks kvstore must make (`dataplane_ceilings`, a raw socket that sums).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection
from typing import NamedTuple, cast

from kvstore.bench.report import Row

BLOCK_BYTES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
LIKE = "like for like"
BEST = "best path"
LIMIT = "limit"
CEILING = "ceiling"


class Ratio(NamedTuple):
    """One ratio of GB/s at batch 64: `num` over `den` (over the fastest of several: a
    best path), per block size; a target from `from_size` up, or none (reported only)."""

    column: str
    kind: str
    num: str
    op: str
    den: tuple[str, ...]
    at_least: float | None
    from_size: int
    what: str


KIB, MIB = 1 << 10, 1 << 20
RATIOS = (
    Ratio("shm put/mooncake-shm", LIKE, "kvstore-shm", "put", ("mooncake-shm",), 1.0, 256 * KIB,
          "kvstore's shm plane / Mooncake's dummy client through its real client's shm"),
    Ratio("shm get/mooncake-shm", LIKE, "kvstore-shm", "get", ("mooncake-shm",), 1.0, 256 * KIB,
          "kvstore's shm plane / Mooncake's dummy client through its real client's shm"),
    Ratio("tcp put/mooncake", LIKE, "kvstore-tcp", "put", ("mooncake",), 1.0, 64 * KIB,
          "kvstore's TCP plane / Mooncake Store's TCP transport"),
    Ratio("tcp get/mooncake", LIKE, "kvstore-tcp", "get", ("mooncake",), 1.0, 64 * KIB,
          "kvstore's TCP plane / Mooncake Store's TCP transport"),
    Ratio("put/mooncake best", BEST, "kvstore-shm", "put", ("mooncake-shm", "mooncake"), None, 0,
          "kvstore's shm plane / the faster of Mooncake's shm and TCP paths"),
    Ratio("get/mooncake best", BEST, "kvstore-shm", "get", ("mooncake-shm", "mooncake"), None, 0,
          "kvstore's shm plane / the faster of Mooncake's shm and TCP paths"),
    Ratio("put/memcpy", LIMIT, "kvstore-shm", "put", ("memcpy",), 0.6, MIB,
          "kvstore's shm plane / one copy by as many threads as it copies with"),
    Ratio("get/memcpy", LIMIT, "kvstore-shm", "get", ("memcpy",), 0.8, MIB,
          "kvstore's shm plane / one copy by as many threads as it copies with"),
    Ratio("ucx put/raw-ucxx", LIMIT, "kvstore-ucx", "put", ("ucxx-raw",), None, 0,
          "kvstore's UCX plane / raw ucxx on the same transports"),
    Ratio("ucx get/raw-ucxx", LIMIT, "kvstore-ucx", "get", ("ucxx-raw",), None, 0,
          "kvstore's UCX plane / raw ucxx on the same transports"),
    Ratio("ucx-tcp get/tcp-socket", LIMIT, "kvstore-ucx-tcp", "get", ("tcp-socket",), 0.9, 0,
          "kvstore's UCX plane over TCP / a raw TCP socket"),
    Ratio("ucx-tcp put/tcp-socket", LIMIT, "kvstore-ucx-tcp", "put", ("tcp-socket",), None, 0,
          "kvstore's UCX plane over TCP / a raw TCP socket"),
    Ratio("tcp get/tcp-socket", LIMIT, "kvstore-tcp", "get", ("tcp-socket",), 0.9, 0,
          "kvstore's TCP plane / a raw TCP socket"),
    Ratio("tcp put/tcp-socket", LIMIT, "kvstore-tcp", "put", ("tcp-socket",), 0.9, 256 * KIB,
          "kvstore's TCP plane / a raw TCP socket"),
    Ratio("put/ceiling", CEILING, "kvstore-shm", "put", ("shm-ceiling",), None, 0,
          "kvstore's shm plane / a copy and a CRC32C per block, nothing else"),
    Ratio("get/ceiling", CEILING, "kvstore-shm", "get", ("shm-ceiling",), None, 0,
          "kvstore's shm plane / a copy and a CRC32C per block, nothing else"),
    Ratio("ceiling put/memcpy", CEILING, "shm-ceiling", "put", ("memcpy",), None, 0,
          "what the checks leave of the copy"),
    Ratio("ceiling get/memcpy", CEILING, "shm-ceiling", "get", ("memcpy",), None, 0,
          "what the checks leave of the copy"),
    Ratio("ucx-tcp get/tcp-crc32c", CEILING, "kvstore-ucx-tcp", "get", ("tcp-socket-crc32c",),
          None, 0, "kvstore's UCX plane over TCP / a raw socket whose receiver sums"),
    Ratio("tcp get/tcp-crc32c", CEILING, "kvstore-tcp", "get", ("tcp-socket-crc32c",), None, 0,
          "kvstore's TCP plane / a raw socket whose receiver sums"),
    Ratio("tcp-crc32c get/tcp", CEILING, "tcp-socket-crc32c", "get", ("tcp-socket",), None, 0,
          "what the receiver's sums leave of the raw socket"),
)  # fmt: skip


def judged(among: Collection[str] | None = None) -> list[Ratio]:
    """The ratios of systems all `among` those measured (None: every ratio)."""
    return [r for r in RATIOS if among is None or {r.num, *r.den} <= set(among)]


def legend(among: Collection[str] | None = None) -> list[Row]:
    """What each ratio compares, and its target: one row per ratio, like for like first."""
    return [
        {
            "ratio": r.column,
            "compares": r.kind,
            "what": r.what,
            "target": _target(r),
        }
        for r in judged(among)
    ]


def _target(r: Ratio) -> str:
    if r.at_least is None:
        return "-"
    if r.from_size <= BLOCK_BYTES[0]:
        return f">= {r.at_least:g} at every size"
    size = f"{r.from_size >> 20} MiB" if r.from_size >= MIB else f"{r.from_size >> 10} KiB"
    return f">= {r.at_least:g} from {size}"


def _gbps(rows: list[Row], system: str, op: str, size: int) -> float | None:
    for r in rows:
        if (r["system"], r["op"], r["block_bytes"], r["batch"]) == (system, op, size, 64):
            return r["gbps"]  # type: ignore[return-value]
    return None


def _fastest(rows: list[Row], systems: tuple[str, ...], op: str, size: int) -> float | None:
    """The best GB/s of `systems` (None unless every one of them was measured)."""
    found = [_gbps(rows, system, op, size) for system in systems]
    return None if any(g is None for g in found) else max(cast(list[float], found))


# kvstore's own GB/s beside its ratios: (column, system, op)
PLANES = (
    ("put_gbps", "kvstore-shm", "put"),
    ("get_gbps", "kvstore-shm", "get"),
    ("ucx_put_gbps", "kvstore-ucx", "put"),
    ("ucx_get_gbps", "kvstore-ucx", "get"),
    ("tcp_put_gbps", "kvstore-tcp", "put"),
    ("tcp_get_gbps", "kvstore-tcp", "get"),
)


def ratio_row(rows: list[Row], size: int, among: Collection[str] | None = None) -> Row:
    """One block size: kvstore's GB/s, its ratio to each baseline, and the targets missed;
    with `among`, only the ratios of those systems (`judged`)."""
    out: Row = {"block_bytes": size}
    for column, system, op in PLANES:
        if among is None or system in among:
            out[column] = _gbps(rows, system, op, size)
    for r in judged(among):
        a, b = _gbps(rows, r.num, r.op, size), _fastest(rows, r.den, r.op, size)
        out[r.column] = a / b if a and b else None
    if among is None:
        # The client sums every block a get receives: that work's share of a get's time, if
        # it did not overlap the transfer (it does: each block is summed as it lands).
        get, crc = out["get_gbps"], _gbps(rows, "crc32c", "get", size)
        out["crc/get"] = get / crc if get and crc else None  # type: ignore[operator]
    out["missed"] = _missed(out, among)
    return out


def _missed(ratios: Row, among: Collection[str] | None = None) -> str:
    """The targets a block size's ratios miss ("-": none); a target whose ratio could not be
    computed (a system absent or failed) is missed, as "unmeasured"."""
    missed = []
    for r in judged(among):
        ratio = ratios[r.column]
        if r.at_least is None or cast(int, ratios["block_bytes"]) < r.from_size:
            continue
        if ratio is None:
            missed.append(f"{r.column} unmeasured")
        elif ratio < r.at_least:  # type: ignore[operator]
            missed.append(f"{r.column}<{r.at_least:g}")
    return " ".join(missed) or "-"


def failures(ratio_rows: list[Row]) -> list[str]:
    """Each block size's missed and unmeasured targets, in words."""
    return [f"{r['block_bytes']} B: {r['missed']}" for r in ratio_rows if r["missed"] != "-"]


def ratios(rows: list[Row], among: Collection[str] | None = None) -> list[Row]:
    return [ratio_row(rows, size, among) for size in BLOCK_BYTES]


def median_ratios(rounds: list[list[Row]], among: Collection[str] | None = None) -> list[Row]:
    """Per block size, each ratio's median over the rounds (each round's ratio is of figures
    measured minutes apart at most), and the targets that median misses."""
    per_round = [ratios(rows, among) for rows in rounds]
    out = []
    for i, size in enumerate(BLOCK_BYTES):
        row: Row = {"block_bytes": size, "rounds": len(rounds)}
        for column in per_round[0][i]:
            if column in ("block_bytes", "missed"):
                continue
            values = [r[i][column] for r in per_round if r[i][column] is not None]
            row[column] = statistics.median(values) if values else None  # type: ignore[type-var]
        row["missed"] = _missed(row, among)
        out.append(row)
    return out
