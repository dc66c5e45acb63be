"""`kvstore-bench vllm --tpot`: whether the kvstore connector slows decode.

A request's prompt blocks are copied out once, in the step that computed them; the put
into the store runs on a background thread during the decode steps that follow, on the
same cores, and the connector's hooks run in every step. This mode measures what that
costs: per document size, `ROUNDS` rounds, each one fresh vLLM process per variant
(`VARIANTS`: no connector; a connector that does nothing, `kvstore.bench.null_connector`, which is
what vLLM's connector machinery costs by itself; kvstore's, publishing), in an order that
reverses every round, serving the same fresh prompts (new in every round, so every prompt
block is published and none is loaded) with `MAX_TOKENS` greedy tokens each. A process's
TPOT is its requests' median; a round's ratio is one variant's TPOT over another's in the
same round, so host drift between rounds cancels. The row reports the median ratios
(kvstore over the null connector: kvstore's own cost, the target's; the null connector over
none: vLLM's share; kvstore over none: both), the target ratio's spread over rounds, and the
blocks the connector published (a run that published nothing measured nothing).

The target divides by the null connector, not by no connector: once any connector is set,
vLLM configures itself differently (it turns off its hybrid KV cache manager), which can
make decode faster or slower by itself, and is no cost of kvstore's.
"""

from __future__ import annotations

import random
import re
import statistics
from typing import Any

from kvstore.bench.report import Row

ROUNDS = 3
NUM_PROMPTS = 2
MAX_TOKENS = 64
TARGET_RATIO = 1.05  # TPOT with kvstore's connector within 5% of the null connector's
# name: (connector, its settings)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "recompute": ("recompute", {}),
    "null": ("null", {}),
    "kvstore": ("kvstore", {}),
}
PUBLISH_STATS = re.compile(r"event=publish_stats published=(\d+) dropped=(\d+) failed=(\d+)")


def order(round_index: int) -> tuple[str, ...]:
    """The variants of a round in the order they run, reversed every other round, so none
    always runs first on a host that drifts."""
    names = tuple(VARIANTS)
    return names if round_index % 2 == 0 else names[::-1]


def sessions(doc_tokens: int, round_index: int) -> list[dict[str, Any]]:
    """`NUM_PROMPTS` prompts of `doc_tokens` tokens, the same for every variant of a round
    and new in every round."""
    rng = random.Random(f"tpot-{doc_tokens}-{round_index}")
    return [
        {"turns": [[rng.randrange(3, 2000) for _ in range(doc_tokens)]]} for _ in range(NUM_PROMPTS)
    ]


def published(log_text: str) -> tuple[int, int, int]:
    """(published, dropped, failed) blocks from the connector's shutdown line; zeros if it
    never logged one."""
    found = PUBLISH_STATS.search(log_text)
    return (int(found[1]), int(found[2]), int(found[3])) if found else (0, 0, 0)


def process_tpot_ms(records: list[dict[str, Any]]) -> float:
    """One process's TPOT: the median of its requests'."""
    return statistics.median(r["tpot_s"] for r in records) * 1e3


def tpot_row(
    doc_tokens: int,
    rounds: list[dict[str, float]],
    stats: tuple[int, ...],
    identical: bool,
) -> Row:
    """One row per document size. `rounds`: per round, each variant's TPOT in ms; `stats`:
    the publishing processes' totals; `identical`: outputs equal in every round."""
    ratios = sorted(r["kvstore"] / r["null"] for r in rounds)
    ratio = statistics.median(ratios)
    row: Row = {"doc_tokens": doc_tokens, "rounds": len(rounds), "max_tokens": MAX_TOKENS}
    for name in VARIANTS:
        row[f"tpot_{name}_ms"] = round(statistics.median(r[name] for r in rounds), 2)
    null = statistics.median(r["null"] / r["recompute"] for r in rounds)
    whole = statistics.median(r["kvstore"] / r["recompute"] for r in rounds)
    return row | {
        "ratio_p50": round(ratio, 3),
        "ratio_min": round(ratios[0], 3),
        "ratio_max": round(ratios[-1], 3),
        "ratio_null_p50": round(null, 3),
        "ratio_vs_none_p50": round(whole, 3),
        "published_blocks": stats[0],
        "dropped_blocks": stats[1],
        "failed_blocks": stats[2],
        "outputs_identical": identical,
        "within_target": ratio <= TARGET_RATIO,
    }
