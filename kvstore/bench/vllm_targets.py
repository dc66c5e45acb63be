"""The targets of suite `vllm`, and which of them a run's rows miss or could not measure.

- Long-doc QA, at every document size: kvstore's TTFT p50 under LMCache's and under
  recompute's; at 8,192 tokens and over, its effective load bandwidth at least half of the
  data plane's get of the same blocks (`load_vs_get` >= 0.5).
- Every kvstore row's outputs equal recompute's.
- `--tpot`: kvstore's TPOT at most `vllm_tpot.TARGET_RATIO` of the null connector's (the
  median of the rounds), with blocks published (a run that published nothing measured
  nothing) and outputs equal.
- `--phases` rows have no targets: they say where a load's time goes.

A peer that did not run (its venv missing, its process failed) leaves its target
unmeasured, which is a failure like a miss (`kvstore-bench vllm --no-targets` to explore).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.bench import vllm_tpot
from kvstore.bench.report import Row

TTFT_PEERS = ("lmcache", "recompute")  # kvstore's TTFT p50 under each one's
LOAD_VS_GET = 0.5  # the least effective load bandwidth, over the data plane's get
LOAD_FROM_TOKENS = 8192  # ... from this document size


def failures(rows: Sequence[Row]) -> list[str]:
    """Every target `rows` miss or leave unmeasured, in words."""
    if any("mode" in r for r in rows):
        return []
    if any("tpot_null_ms" in r for r in rows):
        return [line for r in rows for line in _tpot_failures(r)]
    out = [
        f"{r['workload']} {r['doc_tokens'] or ''} {r['system']}: outputs differ from recompute's"
        for r in rows
        if str(r["system"]).startswith("kvstore") and not r["outputs_identical"]
    ]
    docs = [r for r in rows if r["workload"] == "long-doc-qa"]
    sizes = sorted({int(r["doc_tokens"]) for r in docs})  # type: ignore[call-overload]
    if not sizes:
        return [*out, "long-doc-qa: no rows, nothing measured"]
    for size in sizes:
        out += _doc_failures(size, {r["system"]: r for r in docs if r["doc_tokens"] == size})
    return out


def _doc_failures(size: int, by_system: dict[object, Row]) -> list[str]:
    where = f"long-doc-qa {size} tokens"
    ours = by_system.get("kvstore")
    if ours is None:
        return [f"{where}: kvstore did not run, nothing measured"]
    out = []
    for peer in TTFT_PEERS:
        theirs = by_system.get(peer)
        if theirs is None:
            out.append(f"{where}: TTFT under {peer}'s unmeasured ({peer} did not run)")
        elif ours["ttft_p50_ms"] >= theirs["ttft_p50_ms"]:  # type: ignore[operator]
            out.append(
                f"{where}: TTFT p50 {ours['ttft_p50_ms']} ms, not under {peer}'s "
                f"{theirs['ttft_p50_ms']} ms"
            )
    if size >= LOAD_FROM_TOKENS:
        ratio = ours["load_vs_get"]
        if ratio is None:
            out.append(f"{where}: load_vs_get unmeasured (no load, or no data-plane get)")
        elif ratio < LOAD_VS_GET:  # type: ignore[operator]
            out.append(f"{where}: load_vs_get {ratio} < {LOAD_VS_GET}")
    return out


def _tpot_failures(row: Row) -> list[str]:
    where = f"tpot {row['doc_tokens']} tokens"
    out = []
    if not row["published_blocks"]:
        out.append(f"{where}: kvstore published no block, nothing measured")
    if row["ratio_p50"] > vllm_tpot.TARGET_RATIO:  # type: ignore[operator]
        out.append(
            f"{where}: kvstore over the null connector {row['ratio_p50']} > "
            f"{vllm_tpot.TARGET_RATIO}"
        )
    if not row["outputs_identical"]:
        out.append(f"{where}: outputs differ between variants")
    return out
