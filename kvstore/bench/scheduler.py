"""Suite `scheduler`: replay a Mooncake-format trace through the simulated conductor, one row
per (policy, speedup).

Every policy of `kvstore.conductor.registry` runs on the same replay: N prefill and M
decode instances under one cost-model profile, the trace's arrivals `--speedup` times
faster (or at each speedup of the sweep). Rows give SLO attainment over all requests and
over accepted ones, goodput (requests/s finished within both SLOs), rejections, prefill
wasted on requests that then missed the SLO, TTFT and TBT percentiles, and the std over
time of the mean decode KV utilisation. `kvstore.bench.scheduler_targets` checks the conductor's
targets against the anchors measured in the same run.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import SupportsFloat, cast

from kvstore.bench import scheduler_live, scheduler_matrix, scheduler_overload, scheduler_targets
from kvstore.bench.options import extra_of
from kvstore.bench.report import Row, progress_bar, pyplot
from kvstore.bench.scheduler_decisions import decisions_changed
from kvstore.bench.suites import SuiteOptions
from kvstore.bench.trace_file import DEFAULT_TRACE, REAL_TRACE, load_trace
from kvstore.conductor import PROFILES, SCHEDULING_POLICIES, SLO, resolve_profile
from kvstore.conductor.sim.simulator import (
    DECODE_ADMISSIONS,
    SimConfig,
    SimResult,
    TraceRequest,
    simulate,
)

SWEEP = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
QUICK_SWEEP = (1.0, 3.0)
QUICK_REQUESTS = 800
DEFAULTS: Mapping[str, object] = {
    "trace": DEFAULT_TRACE,
    "prefill": 8,
    "decode": 8,
    "speedup": None,
    "sweep": False,
    "matrix": False,
    "overload": False,
    "workers": 2,
    "ttft_slo_s": 30.0,
    "tbt_slo_ms": 100.0,
    "profile": "datacenter",
    "policy": "all",
    "seed": 0,
    "decode_admission": "refuse",
}
# The decode-load plot draws these against each other at one overloaded speedup.
PLOT_POLICIES = ("prefix-rr", "cache-aware", "cache-aware-reject", "cache-aware-predictive")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's own flags."""
    add = parser.add_argument
    add(
        "--trace",
        type=Path,
        default=None,
        help="Mooncake-format JSONL trace (default: the shared trace; for --overload the real one)",
    )
    add("--prefill", type=int, default=DEFAULTS["prefill"], help="prefill instances")
    add("--decode", type=int, default=DEFAULTS["decode"], help="decode instances")
    add("--speedup", type=float, default=None, help="replay this many times faster (one run)")
    add("--sweep", action="store_true", help=f"every speedup of {SWEEP} (the default)")
    add(
        "--matrix",
        action="store_true",
        help="the conductor vs the best anchors over 4 traces x 3 shapes x 3 overloaded speedups",
    )
    add(
        "--overload",
        action="store_true",
        help="Mooncake's overload experiment: its three admissions at its shape and rate",
    )
    add("--workers", type=int, default=DEFAULTS["workers"], help="processes for --matrix")
    add("--ttft-slo-s", type=float, default=DEFAULTS["ttft_slo_s"], help="TTFT SLO, seconds")
    add("--tbt-slo-ms", type=float, default=DEFAULTS["tbt_slo_ms"], help="TBT SLO, ms")
    add("--profile", default=DEFAULTS["profile"], help=f"{sorted(PROFILES)} or a JSON file")
    add("--policy", default="all", choices=["all", *SCHEDULING_POLICIES], help="policy or all")
    add("--seed", type=int, default=DEFAULTS["seed"], help="seeds the policies' random choices")
    add(
        "--decode-admission",
        default=DEFAULTS["decode_admission"],
        choices=DECODE_ADMISSIONS,
        help="a decode instance that cannot take a request's KV on arrival refuses it "
        "(Mooncake) or queues it (an engine's waiting queue)",
    )
    scheduler_live.add_arguments(parser)


def _settings(options: SuiteOptions) -> dict[str, object]:
    s = {**DEFAULTS, **extra_of(options)}
    if s["trace"] is None:  # --overload replays real traffic, as the paper does
        s["trace"] = REAL_TRACE if s["overload"] else DEFAULT_TRACE
    if s["speedup"] is not None and s["sweep"]:
        raise SystemExit("--speedup and --sweep exclude each other")
    for mode in ("matrix", "overload"):
        if s[mode] and (s["speedup"] is not None or s["sweep"] or s["policy"] != "all"):
            raise SystemExit(f"--{mode} chooses its own speedups and policies")
    if s["matrix"] and s["overload"]:
        raise SystemExit("--matrix and --overload exclude each other")
    if int(s["workers"]) < 1:  # type: ignore[call-overload]
        raise SystemExit(f"--workers must be >= 1: {s['workers']}")
    return s


def _speedups(s: Mapping[str, object], quick: bool) -> tuple[float, ...]:
    if s["speedup"] is not None:
        return (float(s["speedup"]),)  # type: ignore[arg-type]
    return QUICK_SWEEP if quick else SWEEP


def _config(s: Mapping[str, object], speedup: float) -> SimConfig:
    try:
        profile = resolve_profile(str(s["profile"]))
        slo = SLO(float(s["ttft_slo_s"]), float(s["tbt_slo_ms"]) / 1000)  # type: ignore[arg-type]
        return SimConfig(
            int(s["prefill"]),  # type: ignore[call-overload]
            int(s["decode"]),  # type: ignore[call-overload]
            speedup,
            slo,
            profile,
            int(s["seed"]),  # type: ignore[call-overload]
            decode_admission=str(s["decode_admission"]),
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def load_requests(path: Path, limit: int | None) -> list[TraceRequest]:
    """The trace as the simulator takes it; SystemExit naming the problem."""
    try:
        requests = load_trace(path, limit)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--trace: {exc}") from None
    if not requests:
        raise SystemExit(f"--trace: no requests in {path}")
    return [TraceRequest(r.timestamp_ms, r.input_len, r.output_len, r.hash_ids) for r in requests]


def _row(s: Mapping[str, object], policy: str, config: SimConfig, result: SimResult) -> Row:
    m = result.summary
    return {
        "policy": policy,
        "speedup": config.speedup,
        **m._asdict(),  # the simulator's columns, the same in every row
        **decisions_changed(result.counts),
        "prefill": config.num_prefill,
        "decode": config.num_decode,
        "ttft_slo_s": config.slo.ttft_s,
        "tbt_slo_ms": config.slo.tbt_s * 1000,
        "profile": str(s["profile"]),
        "seed": config.seed,
        "decode_admission": config.decode_admission,
        "trace": str(s["trace"]),
    }


def run(options: SuiteOptions) -> list[Row]:
    """Simulates every (policy, speedup); one row each. With ``--matrix``, the rows of
    `scheduler_matrix.run_matrix` instead.

    Args:
        options: ``quick`` replays the first 800 requests at two speedups; the suite's own
            flags (`add_arguments`) come in ``extra``.
    """
    s = _settings(options)
    if s["matrix"]:
        return scheduler_matrix.run_matrix(s, options.quick, int(s["workers"]))  # type: ignore[call-overload]
    requests = load_requests(Path(str(s["trace"])), QUICK_REQUESTS if options.quick else None)
    if s["overload"]:
        settings = {k: s[k] for k in ("ttft_slo_s", "tbt_slo_ms", "seed")}  # for --plot
        settings |= {"profile": str(s["profile"]), "trace": str(s["trace"])}
        return [{**r, **settings} for r in scheduler_overload.run(_config(s, 1.0), requests)]
    if s.get("live"):  # real engines and the conductor instead of the simulator
        return scheduler_live.run(options, s, requests)
    policies = list(SCHEDULING_POLICIES) if s["policy"] == "all" else [str(s["policy"])]
    speedups = _speedups(s, options.quick)
    rows = []
    with progress_bar("scheduler", total=len(requests) * len(policies) * len(speedups)) as advance:
        for speedup in speedups:
            config = _config(s, speedup)
            for policy in policies:
                rows.append(_row(s, policy, config, simulate(policy, requests, config, advance)))
    return rows


def exit_status(rows: list[Row]) -> int:
    """1 when the conductor misses a target at an overloaded speedup, or no speedup of the
    run overloads prefix-rr, or a policy the targets compare did not run
    (`scheduler_targets`). A `--matrix` run fails where cache-aware-predictive loses a
    cell (`scheduler_matrix`), an `--overload` run where prediction does worse than the
    current load (`scheduler_overload`), a `--live` one where its live targets are missed
    (`scheduler_live`). `--no-targets` for exploration."""
    if scheduler_live.is_live(rows):
        return scheduler_live.exit_status(rows)
    if scheduler_overload.is_overload(rows):
        return scheduler_overload.exit_status(rows)
    if scheduler_matrix.is_matrix(rows):
        return scheduler_matrix.exit_status(rows)
    return scheduler_targets.exit_status(rows)


def _overloaded_speedup(rows: Sequence[Row]) -> float:
    """The lowest speedup at which prefix-rr misses 10% of its requests, else the highest."""
    speedups = sorted({float(r["speedup"]) for r in rows})  # type: ignore[arg-type]
    hit = scheduler_targets.overloaded_speedups(rows)
    return min(hit) if hit else speedups[-1]


def plot(rows: list[Row], path: Path) -> None:
    """Goodput vs speedup per policy; decode load over time at one overloaded speedup."""
    first = rows[0]
    if scheduler_overload.is_overload(rows):
        s = {**DEFAULTS, **first}
        requests = load_requests(Path(str(first["trace"])), int(first["requests"]))  # type: ignore[call-overload]
        scheduler_overload.plot(rows, requests, _config(s, 1.0), path)
        return
    if scheduler_matrix.is_matrix(rows):
        raise SystemExit("--plot draws the speedup sweep; the matrix has its summary table")
    s = {
        **DEFAULTS,
        **{
            k: first[k]
            for k in ("trace", "prefill", "decode", "profile", "seed", "decode_admission")
        },
    }
    s["ttft_slo_s"], s["tbt_slo_ms"] = first["ttft_slo_s"], first["tbt_slo_ms"]
    speedup = _overloaded_speedup(rows)
    requests = load_requests(Path(str(first["trace"])), int(first["requests"]))  # type: ignore[call-overload]
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for policy in dict.fromkeys(str(r["policy"]) for r in rows):
        mine = sorted(
            (float(cast(SupportsFloat, r["speedup"])), float(cast(SupportsFloat, r["goodput_rps"])))
            for r in rows
            if r["policy"] == policy
        )
        style = "o-" if policy.startswith("cache-aware") else "x--"
        left.plot([x for x, _ in mine], [y for _, y in mine], style, label=policy)
    left.set(xlabel="trace speedup", ylabel="goodput (requests/s within both SLOs)")
    left.legend(fontsize=7)
    config = _config(s, speedup)
    with progress_bar("scheduler plot", total=len(requests) * len(PLOT_POLICIES)) as advance:
        for policy in PLOT_POLICIES:
            series = simulate(policy, requests, config, advance).load
            right.plot(
                [x.time_s for x in series],
                [100 * x.mean_decode for x in series],
                label=policy,
                lw=0.8,
            )
    right.set(xlabel="simulated time (s)", ylabel="mean decode load (% of its limit)")
    right.set_title(f"decode load at {speedup:g}x", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle(
        f"{Path(str(first['trace'])).name}: {first['prefill']}P + {first['decode']}D, "
        f"SLO TTFT {first['ttft_slo_s']} s, TBT {first['tbt_slo_ms']} ms"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
