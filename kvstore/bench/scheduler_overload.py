"""`kvstore-bench scheduler --overload`: Mooncake's overload experiment, in the simulator.

The Mooncake paper (Qin et al., FAST'25 / arXiv 2407.00079 v3, sections 7 and 8.2) runs 8
prefill and 8 decode instances under a real trace of 23,608 requests an hour replayed at
2x, and counts the requests three admissions reject: none before prefill (the decode
instance refuses after the prefill what it cannot take, and that prefill is thrown away)
4,183; early rejection on the decode load now 3,771; early rejection on the decode load
predicted for when the request reaches decode 3,589. It also shows that rejecting on the
load now makes prefill and decode load swing in anti-phase: while decode is loaded every
request is refused, prefill idles, decode drains, everything is admitted again, and a
TTFT later decode is overloaded again.

Here the three admissions are `cache-aware-ttft`, `cache-aware-reject` and
`cache-aware-predictive` (all Algorithm 1, all rejecting on the predicted TTFT), on the
suite's trace replayed at the paper's arrival rate (the speedup that makes it 2 x 23,608
requests an hour, whatever the trace's own rate), on the paper's shape and on one where
decode binds (`SHAPES`: with the calibrated datacenter profile a decode instance of the
paper's shape stays far from its limits, see the docs). Rows give rejections before and
after prefill, the prefill thrown away in tokens and GPU-seconds, goodput, how much the
mean prefill and decode loads vary, and their correlation over time (negative: anti-phase).
The run fails when prediction rejects more, wastes more or serves less than rejection on
the current load at any shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvstore.bench import verdict
from kvstore.bench.report import Row, progress_bar, pyplot
from kvstore.bench.scheduler_decisions import decisions_changed
from kvstore.conductor.sim.simulator import LoadSample, SimConfig, SimResult, TraceRequest, simulate

# (admission in the paper's words, policy)
ADMISSIONS = (
    ("no early rejection", "cache-aware-ttft"),
    ("early rejection", "cache-aware-reject"),
    ("early rejection by prediction", "cache-aware-predictive"),
)
PAPER_REJECTED = {
    "cache-aware-ttft": 4183,
    "cache-aware-reject": 3771,
    "cache-aware-predictive": 3589,
}
PAPER_REQUESTS_PER_S = 2 * 23_608 / 3600  # the paper's trace at 2x
SHAPES = ((8, 8), (8, 2))  # the paper's; one where decode binds
CURRENT, OURS = "cache-aware-reject", "cache-aware-predictive"


def paper_speedup(requests: Sequence[TraceRequest]) -> float:
    """The speedup at which `requests` arrive at the paper's rate."""
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    if len(requests) < 2 or span_s <= 0:
        raise SystemExit("--overload: the trace spans no time")
    return PAPER_REQUESTS_PER_S / (len(requests) / span_s)


def anti_phase(load: Sequence[LoadSample]) -> float:
    """Correlation over time of the mean prefill and the mean decode load (-1: perfect
    anti-phase); NaN when either is constant."""
    prefill = np.array([x.mean_prefill for x in load])
    decode = np.array([x.mean_decode for x in load])
    if len(load) < 2 or prefill.std() == 0 or decode.std() == 0:
        return float("nan")
    return float(np.corrcoef(prefill, decode)[0, 1])


def _row(shape: tuple[int, int], admission: str, policy: str, result: SimResult) -> Row:
    m = result.summary
    return {
        "shape": f"{shape[0]}P+{shape[1]}D",
        "admission": admission,
        "policy": policy,
        "rejected": m.rejected,
        "rejected_early": m.rejected - m.rejected_late,
        "rejected_late": m.rejected_late,
        "rejected_share": m.rejected / m.requests,
        "paper_rejected_share": PAPER_REJECTED[policy] / 23_608,
        "wasted_prefill_tokens": m.wasted_prefill_tokens,
        "wasted_prefill_gpu_s": m.wasted_prefill_gpu_s,
        "goodput_rps": m.goodput_rps,
        "accepted_slo_attainment": m.accepted_slo_attainment,
        "prefill_load_mean": m.prefill_load_mean,
        "prefill_load_std": float(np.std([x.mean_prefill for x in result.load])),
        "decode_load_mean": m.decode_load_mean,
        "decode_load_std": m.decode_load_std,
        "anti_phase": anti_phase(result.load),
        **decisions_changed(result.counts),
        "requests": m.requests,
    }


def _configs(base: SimConfig, speedup: float) -> list[SimConfig]:
    return [
        SimConfig(p, d, speedup, base.slo, base.profile, base.seed, decode_admission="refuse")
        for p, d in SHAPES
    ]


def run(base: SimConfig, requests: Sequence[TraceRequest]) -> list[Row]:
    """The three admissions at each shape of `SHAPES`, at the paper's arrival rate, under
    `base`'s SLO, profile and seed; one row each."""
    configs = _configs(base, paper_speedup(requests))
    rows = []
    with progress_bar("scheduler overload", total=len(requests) * len(ADMISSIONS) * 2) as advance:
        for config in configs:
            shape = (config.num_prefill, config.num_decode)
            for admission, policy in ADMISSIONS:
                result = simulate(policy, requests, config, advance)
                rows.append({**_row(shape, admission, policy, result), "speedup": config.speedup})
    return rows


def is_overload(rows: Sequence[Row]) -> bool:
    """Whether `rows` are this experiment's."""
    return bool(rows) and all("admission" in r for r in rows)


def failures(rows: Sequence[Row]) -> list[str]:
    """Per shape: prediction rejects more, wastes more prefill or serves less than
    rejection on the current load; or either row is missing."""
    out = []
    for p, d in SHAPES:
        shape = f"{p}P+{d}D"
        at = {str(r["policy"]): r for r in rows if r["shape"] == shape}
        if CURRENT not in at or OURS not in at:
            out.append(f"unmeasured: {shape} lacks {CURRENT} or {OURS}")
            continue
        ours, current = at[OURS], at[CURRENT]
        for key, worse in (
            ("rejected", lambda a, b: a > b),
            ("wasted_prefill_gpu_s", lambda a, b: a > b),
            ("goodput_rps", lambda a, b: a < b),
        ):
            a, b = float(ours[key]), float(current[key])  # type: ignore[arg-type]
            if worse(a, b):
                out.append(f"{shape}: {key} {a:.4g} against {b:.4g} on the current load")
    return out


def exit_status(rows: Sequence[Row]) -> int:
    """1 when a target is missed or unmeasured (listed on stderr), else 0."""
    return verdict.exit_status(failures(rows))


def plot(
    rows: Sequence[Row], requests: Sequence[TraceRequest], base: SimConfig, path: Path
) -> None:
    """Mean prefill and decode load over time, one panel per (shape, admission on the current
    or the predicted load)."""
    configs = _configs(base, float(rows[0]["speedup"]))  # type: ignore[arg-type]
    policies = (CURRENT, OURS)
    plt = pyplot()
    fig, axes = plt.subplots(len(configs), 2, figsize=(13, 4 * len(configs)), squeeze=False)
    total = len(requests) * len(configs) * len(policies)
    with progress_bar("scheduler overload plot", total=total) as advance:
        for line, config in zip(axes, configs, strict=True):
            for ax, policy in zip(line, policies, strict=True):
                load = simulate(policy, requests, config, advance).load
                t = [x.time_s for x in load]
                ax.plot(
                    t, [x.mean_prefill for x in load], label="prefill (queue / TTFT SLO)", lw=0.8
                )
                ax.plot(t, [x.mean_decode for x in load], label="decode (of its limit)", lw=0.8)
                ax.set_title(
                    f"{config.num_prefill}P+{config.num_decode}D, {policy}: "
                    f"correlation {anti_phase(load):.2f}",
                    fontsize=9,
                )
                ax.set(xlabel="simulated time (s)", ylabel="mean load (1 = at the limit)")
                ax.legend(fontsize=7)
    fig.suptitle(f"Mooncake's overload experiment at {configs[0].speedup:.3g}x")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
