"""`kvstore-bench trace --optimum`: every policy against the offline optimum, on every family.

The ablation's trace families (`trace_ablation.traces`: the shared synthetic trace, real
conversation traffic, generated conversation and agent traces; the first two with their
halves) at 2%, 5%, 10% and 20% of each trace's distinct blocks. Each policy of the registry
runs in the in-process simulator (which equals a store replay block for block), beside the
reference LRU, and each hit ratio is divided by the offline optimum's on the same trace at
the same capacity (Belady with prefix semantics, `trace_sim.simulate_belady`).

One row per family, fraction and policy: the fraction of the optimum (geometric mean over
the family's traces, and the worst), the policy's hit ratio and the optimum's on the
family's first trace (the whole file, for the shared and real families), and the reference
LRU's fraction beside.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.bench import trace_ablation, trace_sim
from kvstore.bench.report import Row
from kvstore.bench.trace_ablation import Job, Trace
from kvstore.bench.trace_file import TraceLine, hit_ratio, sweep_capacities
from kvstore.store.eviction import POLICIES

OPTIMUM, REFERENCE_LRU = "belady", "lru (reference)"  # not policies: the yardsticks


def simulate(requests: Sequence[TraceLine], capacity: int, name: str, weighting: str) -> float:
    """The hit ratio of policy `name`, or of the optimum or the reference LRU."""
    if name == OPTIMUM:
        num_hit = trace_sim.simulate_belady(requests, capacity)
    elif name == REFERENCE_LRU:
        num_hit = trace_sim.simulate_lru(requests, capacity)
    else:
        num_hit = trace_sim.simulate_policy(requests, capacity, name)
    return hit_ratio(requests, num_hit, weighting)


def run_optimum(
    shared: Path,
    weighting: str,
    quick: bool,
    workers: int,
    make_traces: Callable[[Path, bool], list[Trace]] = trace_ablation.traces,
) -> list[Row]:
    """One row per family, capacity fraction and policy (see the module docstring)."""
    all_traces = make_traces(shared, quick)
    fractions = trace_ablation.QUICK_FRACTIONS if quick else trace_ablation.FRACTIONS
    names = [*POLICIES, REFERENCE_LRU, OPTIMUM]
    capacities = {  # (trace, fraction) -> blocks; a trace too small for all keeps repeats
        (i, f): sweep_capacities(trace.requests, [f])[0]
        for i, trace in enumerate(all_traces)
        for f in fractions
    }
    jobs = [Job(i, cap, name) for (i, _), cap in capacities.items() for name in names]
    results = trace_ablation.run_jobs(
        all_traces, list(dict.fromkeys(jobs)), weighting, workers, simulate, "optimum"
    )
    rows = []
    families = list(dict.fromkeys(t.family for t in all_traces))
    for family in families:
        members = [i for i, t in enumerate(all_traces) if t.family == family]
        for f in fractions:
            first_capacity = capacities[(members[0], f)]
            for name in POLICIES:
                fraction, lru = [], []
                for i in members:
                    optimum = results[Job(i, capacities[(i, f)], OPTIMUM)]
                    ours = results[Job(i, capacities[(i, f)], name)]
                    reference = results[Job(i, capacities[(i, f)], REFERENCE_LRU)]
                    fraction.append(ours / optimum if optimum else 1.0)
                    lru.append(reference / optimum if optimum else 1.0)
                rows.append(
                    {
                        "family": family,
                        "fraction": f,
                        "blocks": first_capacity,
                        "policy": name,
                        "of_optimum": trace_ablation.geomean(fraction),
                        "min_of_optimum": min(fraction),
                        "lru_of_optimum": trace_ablation.geomean(lru),
                        "hit_ratio": results[Job(members[0], first_capacity, name)],
                        "optimum_hit_ratio": results[Job(members[0], first_capacity, OPTIMUM)],
                        "traces": len(members),
                    }
                )
    return rows
