"""Where the time of a connector's load goes: one timer per phase, totals per process.

A load is timed phase by phase (`PhaseClock.lap`), so the phases add up to the load's wall
time. The phases of the vLLM connector's worker side:

    connect   the data-plane connection (UCX worker, handshake, endpoint) made on first use
    share     (warm-up only) vLLM's pages moved onto memory shared with a node on this host
    stage     host staging for the blocks: allocation and first touch of fresh pages
    transfer  waiting for blocks to land in staging (the store's side, the wire, CRC32C)
    scatter   copying staging into vLLM's paged per-layer tensors (not overlapped with a
              transfer)

and on its scheduler side, per request: `register` (the namespace, first request of a salt),
`hash` (the prompt's block keys) and `match` (the store's longest-prefix answer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

Clock = Callable[[], float]


class LoadPhases(NamedTuple):
    """Seconds spent per phase by one load (or one request's planning), and its size."""

    seconds: Mapping[str, float]
    num_blocks: int
    num_bytes: int

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def log_fields(self) -> str:
        """`name_ms=...` for each phase, then the size and the bandwidth over the total."""
        parts = [f"{name}_ms={s * 1e3:.2f}" for name, s in self.seconds.items()]
        gbps = self.num_bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0
        parts += [f"total_ms={self.total_s * 1e3:.2f}", f"blocks={self.num_blocks}"]
        parts += [f"bytes={self.num_bytes}", f"gbps={gbps:.3f}"]
        return " ".join(parts)


class LoadResult(NamedTuple):
    """How many blocks of a load, from the first, are in the paged cache; its phases; the
    error that cut it short (None when every block was found or only some were missed)."""

    num_loaded: int
    phases: LoadPhases
    error: BaseException | None


@dataclass
class PhaseClock:
    """Laps of one load: each `lap(name)` adds the time since the previous lap to `name`."""

    clock: Clock = time.perf_counter
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._last = self.clock()

    def lap(self, name: str) -> None:
        now = self.clock()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def skip(self) -> None:
        """Starts the next lap now: time since the last lap belongs to no phase."""
        self._last = self.clock()

    def done(self, num_blocks: int, num_bytes: int) -> LoadPhases:
        return LoadPhases(dict(self.seconds), num_blocks, num_bytes)


@dataclass
class PhaseTotals:
    """Sums of many loads' phases, for the process's closing log line."""

    num_loads: int = 0
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, phases: LoadPhases) -> None:
        self.num_loads += 1
        self.num_blocks += phases.num_blocks
        self.num_bytes += phases.num_bytes
        for name, s in phases.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + s

    def items(self) -> Iterator[tuple[str, float]]:
        return iter(self.seconds.items())

    def log_fields(self) -> str:
        return (
            f"loads={self.num_loads} "
            + LoadPhases(self.seconds, self.num_blocks, self.num_bytes).log_fields()
        )
