"""`kvstore-bench scheduler --matrix`: the conductor against the best anchors off the shared
trace and off the default shape.

One trace and one shape can hide a policy's weak spots: on the shared trace with 8 prefill
and 8 decode instances decode is never short, so admission on the decode load now and on
the load predicted at arrival decide alike. The matrix replays four traces (the shared
one, and a conversation, an agent and a coding trace generated in process by `trace_gen`
with fixed seeds) on a decode-bound shape (8P+1D), a balanced one (8P+2D) and a
prefill-bound one (8P+8D; each row reports its mean prefill and decode load, so the labels
are measured, not assumed), each at three overloaded speedups, through the four conductor
variants and the anchors that come closest to them (`ANCHORS`). Cells of
cache-aware-predictive count the decisions its prediction changed against the
current-batch test on the same view (`scheduler_decisions`).

The speedups are chosen per (trace, shape) by one rule, not by hand: the onset of
overload, the first speedup of the doubling ladder `LADDER` at which prefix-rr (Mooncake's
open-source proxy) meets both SLOs on fewer than 90% of the requests (the overload the
suite's targets are defined at, `scheduler_targets`), then twice and four times it.

Rows: one per (trace, shape, speedup, policy) cell. The summary, per (trace, shape), puts
the conductor's figures over its rivals' in the same run: goodput over the best other
policy's (worst speedup), wasted prefill over cache-aware-reject's, decode-load std over
cache-aware-reject's (worst speedup), requests refused after their prefill, and the
decisions the prediction changed. The run fails (exit 1) when cache-aware-predictive has
less goodput than another policy in any cell, or, in a cell where decode binds (its mean
decode load above its mean prefill load, measured), does not beat cache-aware-reject in
goodput, wasted prefill and decode-load swing; the simulator is deterministic, so any loss
is real.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

from rich.console import Console

from kvstore.bench import scheduler_targets, verdict
from kvstore.bench.report import Row, print_table, progress_bar
from kvstore.bench.scheduler_decisions import decisions_changed
from kvstore.bench.trace_file import load_trace
from kvstore.bench.trace_gen import generate
from kvstore.conductor import SLO, resolve_profile
from kvstore.conductor.sim.simulator import SimConfig, SimResult, TraceRequest, simulate

OURS, CURRENT = scheduler_targets.OURS, scheduler_targets.CURRENT
CONDUCTOR = ("cache-aware", "cache-aware-ttft", CURRENT, OURS)
# The anchors closest to the conductor on the default sweep: llm-d sheds on saturation,
# Dynamo refuses busy workers, prefix-rr is Mooncake's own proxy and the overload probe.
ANCHORS = ("llm-d-scorers", "dynamo-cost", scheduler_targets.ANCHOR)
POLICIES = (*CONDUCTOR, *ANCHORS)
SHAPES = ((8, 1), (8, 2), (8, 8))  # (prefill, decode): decode-bound, balanced, prefill-bound
LADDER = tuple(2.0**k for k in range(-3, 9))  # 0.125x .. 256x
OVERLOAD_STEPS = (1, 2, 4)  # multiples of the onset of overload
QUICK_STEPS = (1, 2)
# Generated traces: (kind, sessions, seed); sized so a replay takes about as long as the
# shared trace's.
GENERATED = MappingProxyType(
    {
        "conversation": ("conversation", 600, 0),
        "agent": ("agent", 300, 0),
        "coding": ("coding", 2000, 0),
    }
)
QUICK_SESSIONS = MappingProxyType({"conversation": 150, "agent": 80, "coding": 400})
QUICK_SHARED_REQUESTS = 800
SUMMARY_TITLE = "scheduler matrix: cache-aware-predictive over its rivals (ratios within this run)"


class TraceSpec(NamedTuple):
    """How a worker process obtains one trace of the matrix (hashable, so it is cached)."""

    name: str
    path: str | None  # a Mooncake-format file, or None for a generated trace
    kind: str = ""
    sessions: int = 0
    seed: int = 0
    limit: int | None = None


class Cell(NamedTuple):
    """One simulation of the matrix."""

    trace: TraceSpec
    prefill: int
    decode: int
    speedup: float
    policy: str


@functools.cache
def _requests(spec: TraceSpec) -> tuple[TraceRequest, ...]:
    # Cached per process: every cell of a worker replays the same few traces.
    if spec.path is not None:
        reqs = load_trace(Path(spec.path), spec.limit)
    else:
        reqs = generate(spec.kind, spec.sessions, spec.seed)
    return tuple(TraceRequest(r.timestamp_ms, r.input_len, r.output_len, r.hash_ids) for r in reqs)


def trace_specs(shared: Path, quick: bool) -> list[TraceSpec]:
    """The shared trace, then each generated trace of `GENERATED`."""
    specs = [TraceSpec("shared", str(shared), limit=QUICK_SHARED_REQUESTS if quick else None)]
    for name, (kind, sessions, seed) in GENERATED.items():
        specs.append(TraceSpec(name, None, kind, QUICK_SESSIONS[name] if quick else sessions, seed))
    return specs


def simulate_cell(cell: Cell, settings: Mapping[str, object]) -> SimResult:
    """Replays one cell under the suite's SLO, profile and seed."""
    slo = SLO(float(settings["ttft_slo_s"]), float(settings["tbt_slo_ms"]) / 1000)  # type: ignore[arg-type]
    profile = resolve_profile(str(settings["profile"]))
    seed = int(settings["seed"])  # type: ignore[call-overload]
    config = SimConfig(cell.prefill, cell.decode, cell.speedup, slo, profile, seed)
    result = simulate(cell.policy, _requests(cell.trace), config)
    return result._replace(outcomes=[], load=[])  # what crosses back from a worker


def _probe(
    trace: TraceSpec, shape: tuple[int, int], settings: Mapping[str, object]
) -> float | None:
    """The onset of overload: the first speedup of `LADDER` at which prefix-rr's SLO
    attainment is under `scheduler_targets.OVERLOAD_ATTAINMENT`; None when it never is."""
    for speedup in LADDER:
        cell = Cell(trace, *shape, speedup, scheduler_targets.ANCHOR)
        attainment = simulate_cell(cell, settings).summary.slo_attainment
        if attainment < scheduler_targets.OVERLOAD_ATTAINMENT:
            return speedup
    return None


def _cell_row(cell: Cell, result: SimResult) -> Row:
    m = result.summary
    return {
        "trace": cell.trace.name,
        "shape": f"{cell.prefill}P+{cell.decode}D",
        "speedup": cell.speedup,
        "policy": cell.policy,
        "goodput_rps": m.goodput_rps,
        "wasted_prefill_tokens": m.wasted_prefill_tokens,
        "accepted_slo_attainment": m.accepted_slo_attainment,
        "slo_attainment": m.slo_attainment,
        "decode_load_std": m.decode_load_std,
        "rejected": m.rejected,
        "rejected_late": m.rejected_late,
        "wasted_prefill_gpu_s": m.wasted_prefill_gpu_s,
        "prefill_load_mean": m.prefill_load_mean,
        "decode_load_mean": m.decode_load_mean,
        **decisions_changed(result.counts),
        "requests": m.requests,
        "prefill": cell.prefill,
        "decode": cell.decode,
    }


def _map(
    pool: ProcessPoolExecutor | None, fn: Callable[..., object], args: Sequence[tuple]
) -> Iterable[object]:
    """`fn` over `args`, in order; in `pool`'s processes when there is one."""
    if pool is None:
        return (fn(*a) for a in args)
    futures: list[Future] = [pool.submit(fn, *a) for a in args]
    return (f.result() for f in futures)


def _onsets(
    pool: ProcessPoolExecutor | None,
    pairs: Sequence[tuple[TraceSpec, tuple[int, int]]],
    settings: Mapping[str, object],
) -> list[float | None]:
    with progress_bar("scheduler matrix: overload probes", total=len(pairs)) as advance:
        onsets = []
        for onset in _map(pool, _probe, [(t, shape, settings) for t, shape in pairs]):
            onsets.append(onset)
            advance(1)
    return onsets  # type: ignore[return-value]


def _cells_rows(
    pool: ProcessPoolExecutor | None, cells: Sequence[Cell], settings: Mapping[str, object]
) -> list[Row]:
    with progress_bar("scheduler matrix: cells", total=len(cells)) as advance:
        rows = []
        for cell, m in zip(
            cells, _map(pool, simulate_cell, [(c, settings) for c in cells]), strict=True
        ):
            rows.append(_cell_row(cell, m))  # type: ignore[arg-type]
            advance(1)
    return rows


def run_matrix(
    settings: Mapping[str, object],
    quick: bool,
    workers: int,
    traces: Sequence[TraceSpec] | None = None,
    shapes: Sequence[tuple[int, int]] = SHAPES,
) -> list[Row]:
    """Probes each (trace, shape) for its overloaded speedups, then simulates every cell in
    `workers` processes; one row per cell. Prints the summary table (`summarize`).

    Args:
        settings: the scheduler suite's settings (trace, SLOs, profile, seed).
        quick: shorter traces, two speedups.
        workers: processes; 1 simulates in this one.
        traces: the traces to replay; by default `trace_specs` of the suite's trace.
        shapes: (prefill, decode) instance counts.
    """
    if traces is None:
        traces = trace_specs(Path(str(settings["trace"])), quick)
    pairs = [(t, shape) for t in traces for shape in shapes]
    steps = QUICK_STEPS if quick else OVERLOAD_STEPS
    # Spawned, not forked: a fork of a process with live threads (a data-plane client, gRPC)
    # can deadlock or abort, and a test process has them.
    spawn = mp.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=spawn) if workers > 1 else None
    try:
        onsets = _onsets(pool, pairs, settings)
        cells = [
            Cell(trace, *shape, onset * k, policy)
            for (trace, shape), onset in zip(pairs, onsets, strict=True)
            if onset is not None
            for k in steps
            for policy in POLICIES
        ]
        rows = _cells_rows(pool, cells, settings)
    finally:
        if pool is not None:
            pool.shutdown()
    for (trace, (p, d)), onset in zip(pairs, onsets, strict=True):
        if onset is None:
            note = f"{trace.name} {p}P+{d}D: prefix-rr meets 90% up to {LADDER[-1]:g}x, left out"
            Console(stderr=True).print(note)
    print_table(summarize(rows), title=SUMMARY_TITLE)
    return rows


def _ratio(num: float, den: float) -> float | None:
    """num / den; 1 for 0 / 0, None (unbounded) for x / 0."""
    if den:
        return num / den
    return None if num else 1.0


def _num(row: Row, key: str) -> float:
    return float(row[key])  # type: ignore[arg-type]


def _good(row: Row) -> float:
    return _num(row, "goodput_rps")


def _summary_row(group: list[Row]) -> Row:
    by = {(float(r["speedup"]), str(r["policy"])): r for r in group}  # type: ignore[arg-type]
    speedups = sorted({s for s, _ in by})
    worst: tuple[float, float, str] | None = None  # (ratio, speedup, rival)
    for s in speedups:
        ours = _good(by[s, OURS])
        rivals = [p for q, p in by if q == s and p != OURS]
        rival = max(rivals, key=lambda p: _good(by[s, p]))
        ratio = _ratio(ours, _good(by[s, rival]))
        ratio = float("inf") if ratio is None else ratio
        if worst is None or ratio < worst[0]:
            worst = (ratio, s, rival)
    assert worst is not None, "a summary of no cells"

    def total(policy: str, key: str) -> float:
        return sum(_num(by[s, policy], key) for s in speedups)

    stds = [
        _ratio(_num(by[s, OURS], "decode_load_std"), _num(by[s, CURRENT], "decode_load_std"))
        for s in speedups
    ]
    return {
        "trace": group[0]["trace"],
        "shape": group[0]["shape"],
        "speedups": " ".join(f"{s:g}" for s in speedups),
        "goodput_vs_best_other": worst[0],
        "at_speedup": worst[1],
        "best_other": worst[2],
        "waste_vs_reject": _ratio(
            total(OURS, "wasted_prefill_tokens"), total(CURRENT, "wasted_prefill_tokens")
        ),
        "late_rejected": int(total(OURS, "rejected_late")),
        "late_rejected_reject": int(total(CURRENT, "rejected_late")),
        "decisions_changed": int(total(OURS, "decisions_changed")),
        "placed_elsewhere": int(total(OURS, "placed_elsewhere")),
        "decode_load": max(_num(by[s, OURS], "decode_load_mean") for s in speedups),
        "prefill_load": max(_num(by[s, OURS], "prefill_load_mean") for s in speedups),
        "std_vs_reject": max((x for x in stds if x is not None), default=None),
        "min_accepted_attainment": min(
            _num(by[s, OURS], "accepted_slo_attainment") for s in speedups
        ),
        "cells_lost": len({f.split(":")[0] for f in failures(group)}),
    }


def summarize(rows: Sequence[Row]) -> list[Row]:
    """Per (trace, shape): cache-aware-predictive's goodput over the best other policy's at
    its worst speedup (and which rival, where), its wasted prefill over cache-aware-reject's
    (summed over the speedups; None when only ours wastes), its decode-load std over
    cache-aware-reject's at the worst speedup, its lowest accepted attainment, and how many
    cells it loses."""
    groups: dict[tuple[object, object], list[Row]] = {}
    for r in rows:
        groups.setdefault((r["trace"], r["shape"]), []).append(r)
    return [_summary_row(g) for g in groups.values()]


def is_matrix(rows: Sequence[Row]) -> bool:
    """Whether `rows` are matrix cells (they name a shape)."""
    return bool(rows) and all("shape" in r for r in rows)


def decode_binds(row: Row) -> bool:
    """Whether decode is the binding resource of a cell, as measured, not as its shape says:
    its mean decode load over its mean prefill load, under cache-aware-reject (the current
    batch, the rule the prediction must beat there)."""
    return _num(row, "decode_load_mean") > _num(row, "prefill_load_mean")


def _decode_bound_failures(ours: Row, current: Row) -> list[str]:
    """Where decode binds, prediction must beat the current batch: more goodput, less
    prefill thrown away (unless neither throws any), less decode-load swing."""
    out = []
    if _good(ours) <= _good(current):
        out.append(f"goodput {_good(ours):.4g} not above {CURRENT}'s {_good(current):.4g}")
    waste = [_num(r, "wasted_prefill_gpu_s") for r in (ours, current)]
    if waste[0] >= waste[1] and waste[1] > 0:
        out.append(f"wasted prefill {waste[0]:.4g} GPU-s not under {CURRENT}'s {waste[1]:.4g}")
    std = [_num(r, "decode_load_std") for r in (ours, current)]
    if std[0] >= std[1]:
        out.append(f"decode-load std {std[0]:.4g} not under {CURRENT}'s {std[1]:.4g}")
    return [f"{f} where decode binds" for f in out]


def failures(rows: Sequence[Row]) -> list[str]:
    """Each cell where another policy has more goodput than cache-aware-predictive, and each
    cell where decode binds (`decode_binds`) where it does not beat cache-aware-reject."""
    cells: dict[tuple[object, object, object], dict[str, Row]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["shape"], r["speedup"]), {})[str(r["policy"])] = r
    out = []
    for (trace, shape, speedup), at in cells.items():
        if OURS not in at:
            continue
        where = f"{trace} {shape} {speedup:g}x"
        ours = _good(at[OURS])
        out += [
            f"{where}: {p} {_good(r):.4g} > {OURS} {ours:.4g}"
            for p, r in at.items()
            if _good(r) > ours
        ]
        if CURRENT in at and decode_binds(at[CURRENT]):
            out += [f"{where}: {f}" for f in _decode_bound_failures(at[OURS], at[CURRENT])]
    return out


def exit_status(rows: Sequence[Row]) -> int:
    """1 when cache-aware-predictive loses a cell (listed on stderr), else 0."""
    return verdict.exit_status(failures(rows), "cell lost")
