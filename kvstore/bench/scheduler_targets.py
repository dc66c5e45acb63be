"""The conductor's targets, checked on the rows of one `scheduler` run.

At every speedup where `prefix-rr` (Mooncake's open-source proxy) finishes fewer than 90%
of requests within SLO, `cache-aware-predictive` must have the highest goodput of all
policies and at least 1.2x that of `prefix-rr`; waste at most half the prefill tokens
`cache-aware-reject` wastes; meet both SLOs on at least 95% of the requests it accepts;
and its decode load must vary less over time than `cache-aware-reject`'s. Every figure
is a ratio to a baseline measured in the same run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import SupportsFloat, cast

from kvstore.bench import verdict
from kvstore.bench.report import Row

OURS, ANCHOR, CURRENT = "cache-aware-predictive", "prefix-rr", "cache-aware-reject"
OVERLOAD_ATTAINMENT = 0.9
MIN_GOODPUT_RATIO = 1.2
MIN_ACCEPTED_ATTAINMENT = 0.95


def overloaded_speedups(rows: Sequence[Row]) -> list[float]:
    """Speedups at which prefix-rr's SLO attainment is under 90%."""
    return sorted(
        float(cast(SupportsFloat, r["speedup"]))
        for r in rows
        if r["policy"] == ANCHOR
        and float(cast(SupportsFloat, r["slo_attainment"])) < OVERLOAD_ATTAINMENT
    )


def _failures_at(rows: Sequence[Row], speedup: float) -> list[str]:
    at = {str(r["policy"]): r for r in rows if float(r["speedup"]) == speedup}  # type: ignore[arg-type]
    ours = at[OURS]
    good = {p: float(r["goodput_rps"]) for p, r in at.items()}  # type: ignore[arg-type]
    out = []
    if any(g > good[OURS] for p, g in good.items() if p != OURS):
        out.append(f"not the highest goodput ({max(good, key=good.__getitem__)})")
    if good[OURS] < MIN_GOODPUT_RATIO * good[ANCHOR]:
        out.append(f"goodput {good[OURS]:.3g} < {MIN_GOODPUT_RATIO} x prefix-rr {good[ANCHOR]:.3g}")
    if CURRENT in at:
        if 2 * int(ours["wasted_prefill_tokens"]) > int(at[CURRENT]["wasted_prefill_tokens"]):  # type: ignore[call-overload]
            out.append("wastes more than half the prefill of cache-aware-reject")
        if float(ours["decode_load_std"]) >= float(at[CURRENT]["decode_load_std"]):  # type: ignore[arg-type]
            out.append("decode load varies no less than cache-aware-reject's")
    if float(ours["accepted_slo_attainment"]) < MIN_ACCEPTED_ATTAINMENT:  # type: ignore[arg-type]
        out.append(f"accepted attainment {ours['accepted_slo_attainment']:.3f} < 0.95")
    return [f"{speedup:g}x: {f}" for f in out]


def failures(rows: Sequence[Row]) -> list[str]:
    """Each target missed, by speedup, or not measured: the conductor's or prefix-rr's rows
    absent, or no speedup of the run overloads prefix-rr (the targets are set there)."""
    policies = {r["policy"] for r in rows}
    absent = [p for p in (OURS, ANCHOR) if p not in policies]
    if absent:
        return [f"unmeasured: no rows of {', '.join(absent)}"]
    overloaded = overloaded_speedups(rows)
    if not overloaded:
        return ["unmeasured: no speedup of this run overloads prefix-rr"]
    return [f for s in overloaded for f in _failures_at(rows, s)]


def exit_status(rows: Sequence[Row]) -> int:
    """1 when a target is missed or unmeasured (listed on stderr), else 0."""
    return verdict.exit_status(failures(rows))
