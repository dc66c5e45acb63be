"""The one registry of benchmark suites, and the options every suite receives.

A suite is a module with ``run(options: SuiteOptions) -> list[Row]``, when it draws a
picture ``plot(rows: list[Row], path: Path) -> None``, and when its rows can fail the run
``exit_status(rows: list[Row]) -> int``. Modules are imported only when their suite runs,
so a suite's heavy dependencies (UCX, torch, Redis) never slow down another's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvstore.bench.report import Row


@dataclass(frozen=True)
class SuiteOptions:
    """Flags shared by every suite.

    Attributes:
        quick: a short run with the same rows and columns as the full one.
    """

    quick: bool = False


@dataclass(frozen=True)
class SuiteSpec:
    """Where a suite lives and what the CLI says about it."""

    name: str
    module: str
    help: str
    can_plot: bool = False

    def run(self, options: SuiteOptions) -> list[Row]:
        """Imports the suite's module and runs it; returns one dict per table row."""
        run: Callable[[SuiteOptions], list[Row]] = importlib.import_module(self.module).run
        return run(options)

    def exit_status(self, rows: list[Row]) -> int:
        """The suite's verdict on `rows` (its module's ``exit_status``); 0 when it has none."""
        verdict = getattr(importlib.import_module(self.module), "exit_status", None)
        return 0 if verdict is None else int(verdict(rows))

    def plot(self, rows: list[Row], path: Path) -> None:
        """Writes the suite's PNG of `rows` to `path`."""
        assert self.can_plot, f"suite {self.name} has no plot"
        plot: Callable[[list[Row], Path], None] = importlib.import_module(self.module).plot
        plot(rows, path)


_SPECS = (
    SuiteSpec(
        "keys",
        "kvstore.bench.keys",
        "block_keys over a 128k-token prompt: list vs numpy input, four block sizes",
        can_plot=True,
    ),
    SuiteSpec(
        "trace",
        "kvstore.bench.trace",
        "replay a Mooncake-format trace through a real store: hit ratio per policy vs "
        "LRU and the offline optimum",
        can_plot=True,
    ),
    SuiteSpec(
        "cluster",
        "kvstore.bench.cluster",
        "the global pool on Redis: get and put as nodes are added, Redis round trips per "
        "match, a trace's hit ratio global vs per-node vs one node; --kill: seconds to miss",
    ),
    SuiteSpec(
        "trace-gen",
        "kvstore.bench.trace_gen",
        "write a synthetic Mooncake-format trace of a multi-turn workload (conversation or "
        "agent) to check policies off the shared trace",
    ),
    SuiteSpec(
        "scheduler",
        "kvstore.bench.scheduler",
        "replay a Mooncake-format trace through the simulated conductor: SLO attainment, "
        "goodput, rejections and wasted prefill per routing/admission policy and speedup",
        can_plot=True,
    ),
    SuiteSpec(
        "calibrate",
        "kvstore.bench.calibrate",
        "fit the conductor's cost model (prefill, decode step, pool transfer) to the real "
        "engine and store on this machine; writes the profile as JSON (--out)",
    ),
    SuiteSpec(
        "recovery",
        "kvstore.bench.recovery",
        "restart recovery: index rebuild from an SSD tier of 100k blocks vs a bare LMDB scan",
    ),
    SuiteSpec(
        "dataplane",
        "kvstore.bench.dataplane",
        "put/get throughput and latency: kvstore over UCX and gRPC vs memcpy, TCP, raw "
        "ucxx, Redis and Mooncake Store",
    ),
    SuiteSpec(
        "load",
        "kvstore.bench.load",
        "N client processes against one store with less DRAM than the working set: mixed "
        "match/get/put/remove over UCX and gRPC, every read verified; ops/s, latency, server "
        "RSS and fds",
        can_plot=True,
    ),
    SuiteSpec(
        "prefix",
        "kvstore.bench.prefix",
        "TTFT/TPOT of real engine processes: recompute vs engine-local prefix cache vs "
        "kvstore, on system-prompt, multi-round-qa and long-doc-qa workloads",
    ),
    SuiteSpec(
        "vllm",
        "kvstore.bench.vllm",
        "vLLM on CPU: TTFT/TPOT of long-document and multi-round QA with kvstore vs LMCache "
        "vs vLLM offloading vs recompute",
    ),
)

SUITES: Mapping[str, SuiteSpec] = MappingProxyType({spec.name: spec for spec in _SPECS})
