"""Suite `trace`: replay a Mooncake-format trace through a real store, one row per policy.

Each row gives the prefix hit ratio the store achieved with that policy at the given DRAM
(and SSD) capacity, and beside it, simulated on the same requests at the same total
capacity, the reference LRU, the offline optimum (Belady) and an unbounded cache. Hits are
weighted in tokens ("tokens": 512 a block, the last block what is left of the prompt;
"blocks": 512 every block, the convention of traces/README.md).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvstore.bench import policy_cost, trace_ablation, trace_optimum, trace_sim
from kvstore.bench.options import extra_of
from kvstore.bench.report import Row, progress_bar, pyplot
from kvstore.bench.suites import SuiteOptions
from kvstore.bench.trace_file import (
    DEFAULT_TRACE,
    REAL_TRACE,
    WEIGHTINGS,
    TraceLine,
    hit_ratio,
    load_trace,
    sweep_capacities,
)
from kvstore.bench.trace_replay import ReplayConfig, ReplayResult, replay
from kvstore.store.eviction import POLICIES

QUICK_REQUESTS = 1000
DEFAULTS: Mapping[str, object] = {
    "trace": DEFAULT_TRACE,
    "dram_blocks": 5000,
    "ssd_blocks": 0,
    "policy": "all",
    "block_bytes": 64,
    "weighting": "tokens",
    "ablation": False,
    "optimum": False,
    "cost": False,
    "real_trace": REAL_TRACE,
    "workers": 2,
}
# The plot's capacities, as fractions of the trace's distinct blocks, on a log axis: the
# same picture for traces of any size (for the shared trace, 374 to 30,747 blocks: never
# fewer than its longest request).
SWEEP_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.45, 0.7)
QUICK_SWEEP_FRACTIONS = (0.01, 0.05, 0.2, 0.45)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's own flags."""
    add = parser.add_argument
    add("--trace", type=Path, default=DEFAULTS["trace"], help="Mooncake-format JSONL trace")
    add("--dram-blocks", type=int, default=DEFAULTS["dram_blocks"], help="DRAM capacity, blocks")
    add("--ssd-blocks", type=int, default=DEFAULTS["ssd_blocks"], help="SSD capacity, blocks")
    add("--policy", default=DEFAULTS["policy"], choices=["all", *POLICIES], help="policy or all")
    add("--block-bytes", type=int, default=DEFAULTS["block_bytes"], help="payload per block")
    add("--weighting", default=DEFAULTS["weighting"], choices=list(WEIGHTINGS))
    add("--ablation", action="store_true", help="what each mechanism of prefix-2q gains")
    add(
        "--optimum",
        action="store_true",
        help="every policy as a fraction of the offline optimum, on every trace family",
    )
    add("--cost", action="store_true", help="each policy's time per operation at 320,000 blocks")
    add(
        "--real-trace",
        type=Path,
        default=DEFAULTS["real_trace"],
        help="--ablation, --optimum: the real-traffic family's trace",
    )
    add("--workers", type=int, default=DEFAULTS["workers"], help="--ablation, --optimum: processes")


def _settings(options: SuiteOptions) -> dict[str, object]:
    return {**DEFAULTS, **extra_of(options)}


def _references(requests: Sequence[TraceLine], capacity: int, weighting: str) -> Row:
    """LRU, Belady and unbounded hit ratios on `requests` at `capacity` blocks."""
    return {
        "lru_hit_ratio": hit_ratio(requests, trace_sim.simulate_lru(requests, capacity), weighting),
        "belady_hit_ratio": hit_ratio(
            requests, trace_sim.simulate_belady(requests, capacity), weighting
        ),
        "unbounded_hit_ratio": hit_ratio(
            requests, trace_sim.simulate_unbounded(requests), weighting
        ),
    }


def _tier_fields(result: ReplayResult) -> Row:
    tiers = result.stats.tiers
    return {
        "tier_hits": {name: result.tier_hits.get(name, 0) for name in (t.name for t in tiers)},
        "tier_bytes_read": {t.name: t.bytes_read for t in tiers},
        "tier_bytes_written": {t.name: t.bytes_written for t in tiers},
    }


def _row(
    settings: Mapping[str, object],
    requests: Sequence[TraceLine],
    result: ReplayResult,
    config: ReplayConfig,
    refs: Row,
) -> Row:
    ratio = hit_ratio(requests, result.num_hit, str(settings["weighting"]))
    lru, belady = float(refs["lru_hit_ratio"]), float(refs["belady_hit_ratio"])  # type: ignore[arg-type]
    return {
        "trace": str(settings["trace"]),
        "requests": len(requests),
        "dram_blocks": config.dram_blocks,
        "ssd_blocks": config.ssd_blocks,
        "policy": config.policy,
        "weighting": settings["weighting"],
        "hit_ratio": ratio,
        **refs,
        "ratio_to_lru": ratio / lru if lru else None,
        "ratio_to_belady": ratio / belady if belady else None,
        **_tier_fields(result),
        "replay_s": result.seconds,
    }


def _check_fits(requests: Sequence[TraceLine], dram_blocks: int) -> None:
    """A request reserves all its missing blocks in DRAM at once; they must fit."""
    longest = max((len(r.hash_ids) for r in requests), default=0)
    if longest > dram_blocks:
        raise SystemExit(f"--dram-blocks {dram_blocks}: the longest request has {longest} blocks")


def run(options: SuiteOptions) -> list[Row]:
    """Replays the trace once per policy; one row each.

    Args:
        options: ``quick`` replays the first 1,000 requests; the suite's own flags
            (`add_arguments`) come in ``extra``.
    """
    s = _settings(options)
    if s["cost"]:
        return policy_cost.run_cost(options.quick)
    if s["ablation"] or s["optimum"]:
        trace, weighting = Path(str(s["trace"])), str(s["weighting"])
        make_traces = functools.partial(trace_ablation.traces, real=Path(str(s["real_trace"])))
        run_families = trace_optimum.run_optimum if s["optimum"] else trace_ablation.run_ablation
        return run_families(trace, weighting, options.quick, int(s["workers"]), make_traces)  # type: ignore[call-overload]
    try:
        requests = load_trace(Path(str(s["trace"])), QUICK_REQUESTS if options.quick else None)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--trace: {exc}") from None
    if not requests:
        raise SystemExit(f"--trace: no requests in {s['trace']}")
    _check_fits(requests, int(s["dram_blocks"]))  # type: ignore[call-overload]
    policies = list(POLICIES) if s["policy"] == "all" else [str(s["policy"])]
    configs = [
        ReplayConfig(int(s["dram_blocks"]), int(s["ssd_blocks"]), p, int(s["block_bytes"]))  # type: ignore[call-overload]
        for p in policies
    ]
    refs = _references(
        requests, configs[0].dram_blocks + configs[0].ssd_blocks, str(s["weighting"])
    )
    rows = []
    with progress_bar("trace", total=len(requests) * len(configs)) as advance:
        for config in configs:
            rows.append(_row(s, requests, replay(requests, config, advance), config, refs))
    return rows


def _sweep(
    requests: Sequence[TraceLine],
    policies: Sequence[str],
    weighting: str,
    capacities: Sequence[int],
) -> dict[str, list[float]]:
    """Hit ratio per capacity for each policy (simulated as the store drives it) and Belady."""
    lines: dict[str, list[float]] = {name: [] for name in [*policies, "belady"]}
    with progress_bar("sweep", total=len(capacities) * len(lines)) as advance:
        for cap in capacities:
            for name in policies:
                num_hit = trace_sim.simulate_policy(requests, cap, name)
                lines[name].append(hit_ratio(requests, num_hit, weighting))
                advance(1)
            lines["belady"].append(
                hit_ratio(requests, trace_sim.simulate_belady(requests, cap), weighting)
            )
            advance(1)
    return lines


def plot(rows: list[Row], path: Path) -> None:
    """Hit ratio vs total capacity per policy, with Belady and unbounded; rows as points."""
    first = rows[0]
    if "trace" not in first:
        raise SystemExit("--plot draws a replay, not --ablation, --optimum or --cost")
    requests = load_trace(Path(str(first["trace"])), int(first["requests"]))  # type: ignore[call-overload]
    weighting = str(first["weighting"])
    quick = len(requests) <= QUICK_REQUESTS
    capacities = sweep_capacities(requests, QUICK_SWEEP_FRACTIONS if quick else SWEEP_FRACTIONS)
    lines = _sweep(requests, [str(r["policy"]) for r in rows], weighting, capacities)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ratios in lines.items():
        style = "k--" if name == "belady" else "o-"
        ax.plot(capacities, ratios, style, label=name)
    ax.axhline(float(first["unbounded_hit_ratio"]), color="grey", linestyle=":", label="unbounded")  # type: ignore[arg-type]
    for row in rows:
        total = int(row["dram_blocks"]) + int(row["ssd_blocks"])  # type: ignore[call-overload]
        ax.plot([total], [row["hit_ratio"]], "x", color="black")
    ax.set_xscale("log")
    ax.set(xlabel="capacity (blocks)", ylabel=f"prefix hit ratio ({weighting})", ylim=(0, None))
    ax.set_title(f"{Path(str(first['trace'])).name}: {len(requests):,} requests (x: store replay)")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
