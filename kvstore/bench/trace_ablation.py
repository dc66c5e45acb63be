"""`kvstore-bench trace --ablation`: what each mechanism of prefix-2q gains.

For every mechanism (`WITHOUT`), the policy with it on (`Prefix2QPolicy()`) against the
policy with it off, as a ratio of hit ratios: 2Q itself (off: prefix-lru) and its ghost
list (off: 2Q that forgets what it evicted). A new mechanism gets a switch in
`Prefix2QPolicy` and a line here.
Measured on four trace families, each at several capacities:

- shared: the shared synthetic trace (`--trace`), its first half and its second half;
- real: real conversation traffic (`--real-trace`, `trace_file.REAL_TRACE`), its first
  half and its second half;
- conversation and agent: traces of `kvstore.bench.trace_gen`, two seeds each.

Per mechanism and family, the geometric mean and the minimum of the ratio over the
family's traces and capacities. A mechanism is worth keeping (`is_worth_keeping`) when it
gains at least 1% (geometric mean) on more than one family, the real family among them
where it is measured (a mechanism must earn its keep on real traffic), and costs no
family more than 2% (geometric mean); the worst single run is reported beside.

The policies run in the in-process simulator (`trace_sim.simulate_instance`), which the
trace tests check equals a store replay block for block; jobs run in `workers` processes.
"""

from __future__ import annotations

import functools
import math
import multiprocessing as mp
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

from kvstore.bench import trace_sim
from kvstore.bench.report import Row, progress_bar
from kvstore.bench.trace_file import (
    REAL_TRACE,
    TraceLine,
    hit_ratio,
    load_trace,
    sweep_capacities,
)
from kvstore.bench.trace_gen import generate
from kvstore.store.eviction import EvictionPolicy, Prefix2QPolicy, PrefixLRUPolicy
from kvstore.store.eviction.prefix_2q import GHOST_AGES

# Each mechanism measured -> the policy without it.
WITHOUT: Mapping[str, Callable[[], EvictionPolicy]] = MappingProxyType(
    {
        "2q": PrefixLRUPolicy,
        "ghost list": functools.partial(Prefix2QPolicy, ghost_ages=()),
        "earned ghost ages": functools.partial(Prefix2QPolicy, ghost_ages=GHOST_AGES[:1]),
    }
)
FRACTIONS = (0.02, 0.05, 0.1, 0.2)  # capacities, as fractions of a trace's distinct blocks
QUICK_FRACTIONS = (0.05, 0.2)
GENERATED = {"conversation": 1000, "agent": 400}  # sessions per generated trace
QUICK_GENERATED = {"conversation": 200, "agent": 80}
SEEDS = (0, 1)
QUICK_REQUESTS = 1000
KEEP_GAIN = 1.01  # geometric mean on more than one family, the real one among them
KEEP_LOSS = 0.98  # geometric mean, on every family
REAL_FAMILY = "real"


class Trace(NamedTuple):
    family: str
    name: str
    requests: list[TraceLine]


@dataclass(frozen=True)
class Job:
    """One simulation: a variant of the policy on one trace at one capacity."""

    trace: int  # index into the traces
    capacity: int
    variant: str  # "" for the full policy, a mechanism's name for the policy without it


def traces(shared: Path, quick: bool, real: Path = REAL_TRACE) -> list[Trace]:
    """The traces of every family: the shared one and the real one, each with its halves,
    and generated ones."""
    out = []
    for family, path in (("shared", shared), ("real", real)):
        requests = load_trace(path, QUICK_REQUESTS if quick else None)
        half = len(requests) // 2
        out += [
            Trace(family, path.name, requests),
            Trace(family, f"{family} first half", requests[:half]),
            Trace(family, f"{family} second half", requests[half:]),
        ]
    for kind, sessions in (QUICK_GENERATED if quick else GENERATED).items():
        out += [Trace(kind, f"{kind} seed {s}", generate(kind, sessions, seed=s)) for s in SEEDS]
    return out


def variants() -> list[str]:
    """The mechanisms measured."""
    return list(WITHOUT)


def make_variant(variant: str) -> EvictionPolicy:
    """The policy ("") or the policy without one mechanism."""
    return WITHOUT[variant]() if variant else Prefix2QPolicy()


def _simulate(requests: Sequence[TraceLine], capacity: int, variant: str, weighting: str) -> float:
    num_hit = trace_sim.simulate_instance(requests, capacity, make_variant(variant))
    return hit_ratio(requests, num_hit, weighting)


Simulate = Callable[[Sequence[TraceLine], int, str, str], float]


def _jobs(all_traces: Sequence[Trace], fractions: Sequence[float]) -> list[Job]:
    jobs = []
    for i, trace in enumerate(all_traces):
        for capacity in sweep_capacities(trace.requests, fractions):
            jobs += [Job(i, capacity, v) for v in ["", *variants()]]
    return jobs


def run_jobs(
    all_traces: Sequence[Trace],
    jobs: Sequence[Job],
    weighting: str,
    workers: int,
    simulate: Simulate = _simulate,
    what: str = "ablation",
) -> dict[Job, float]:
    """Hit ratio per job (`simulate(requests, capacity, variant, weighting)`, a module-level
    function), `workers` processes at a time (in this process when 1)."""
    results: dict[Job, float] = {}
    with progress_bar(what, total=len(jobs)) as advance:
        if workers <= 1:
            for job in jobs:
                results[job] = simulate(
                    all_traces[job.trace].requests, job.capacity, job.variant, weighting
                )
                advance(1)
            return results
        # Spawned, not forked: forking a process with live threads can deadlock or abort.
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            futures = {
                job: pool.submit(
                    simulate, all_traces[job.trace].requests, job.capacity, job.variant, weighting
                )
                for job in jobs
            }
            for job, future in futures.items():
                results[job] = future.result()
                advance(1)
    return results


class Ratio(NamedTuple):
    family: str
    where: str  # trace @ capacity
    value: float  # hit ratio on / off


def _ratios(all_traces: Sequence[Trace], results: Mapping[Job, float]) -> dict[str, list[Ratio]]:
    out: dict[str, list[Ratio]] = {v: [] for v in variants()}
    for job, off in results.items():
        if not job.variant:
            continue
        trace = all_traces[job.trace]
        on = results[Job(job.trace, job.capacity, "")]
        value = on / off if off else (1.0 if not on else math.inf)
        out[job.variant].append(Ratio(trace.family, f"{trace.name} @ {job.capacity}", value))
    return out


def geomean(values: Sequence[float]) -> float:
    if min(values) <= 0:  # a policy that hit nothing where the other hit something
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def is_worth_keeping(by_family: Mapping[str, Sequence[float]]) -> bool:
    """At least `KEEP_GAIN` (geometric mean) on more than one family, `REAL_FAMILY` among
    them where it is measured, and no family's geometric mean below `KEEP_LOSS`."""
    means = {family: geomean(v) for family, v in by_family.items()}
    gains = [family for family, mean in means.items() if mean >= KEEP_GAIN]
    real_gains = REAL_FAMILY not in means or REAL_FAMILY in gains
    return len(gains) > 1 and real_gains and min(means.values()) >= KEEP_LOSS


def _summary(variant: str, ratios: Sequence[Ratio]) -> Iterator[Row]:
    families: dict[str, list[Ratio]] = {}
    for r in ratios:
        families.setdefault(r.family, []).append(r)
    keep = is_worth_keeping({f: [r.value for r in rs] for f, rs in families.items()})
    for family, rs in families.items():
        worst = min(rs, key=lambda r: r.value)
        yield {
            "mechanism": variant,
            "family": family,
            "runs": len(rs),
            "geomean_ratio": geomean([r.value for r in rs]),
            "min_ratio": worst.value,
            "min_at": worst.where,
            "keep": keep,
        }


def run_ablation(
    shared: Path,
    weighting: str,
    quick: bool,
    workers: int,
    make_traces: Callable[[Path, bool], list[Trace]] = traces,
) -> list[Row]:
    """One row per mechanism and trace family: the geometric mean and minimum ratio of the
    policy's hit ratio with the mechanism on to that with it off."""
    all_traces = make_traces(shared, quick)
    jobs = _jobs(all_traces, QUICK_FRACTIONS if quick else FRACTIONS)
    results = run_jobs(all_traces, jobs, weighting, workers)
    ratios = _ratios(all_traces, results)
    return [row for variant in variants() for row in _summary(variant, ratios[variant])]
