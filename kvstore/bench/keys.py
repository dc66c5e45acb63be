"""Suite `keys`: time `block_keys` over a 128k-token prompt.

One row per (block_tokens, input kind). The prompt is hashed from a Python list (what a
tokenizer returns) and from a numpy uint32 array. Besides the absolute median against the
5 ms target, each row gives the ratio to a floor measured beside it in the same run: one
blake2b call over the prompt's bytes, the hash work with none of the per-block overhead.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np

from kvstore.bench.report import Row, progress_bar, pyplot
from kvstore.bench.suites import SuiteOptions
from kvstore.keys import KVLayout, Namespace, block_keys, tokens_to_bytes

PROMPT_TOKENS = 131_072
BLOCK_TOKENS = (16, 64, 256, 512)
TARGET_MS = 5.0
VOCAB_SIZE = 128_256  # Llama 3
REPEATS = 50
QUICK_REPEATS = 3

Tokens = Sequence[int] | np.ndarray
INPUT_KINDS: dict[str, Callable[[np.ndarray], Tokens]] = {
    "list": lambda arr: arr.tolist(),
    "numpy": lambda arr: arr,
}


def _prompt() -> np.ndarray:
    """Fixed pseudo-random token ids, the same in every run."""
    rng = np.random.default_rng(0)
    return rng.integers(0, VOCAB_SIZE, size=PROMPT_TOKENS, dtype=np.uint32)  # (T,)


def _namespace(block_tokens: int) -> Namespace:
    return Namespace("llama-3-8b", KVLayout("bfloat16", 32, 8, 128, block_tokens))


def _time_ms(fn: Callable[[], object], repeats: int, advance: Callable[[int], None]) -> list[float]:
    """Wall times of `repeats` calls after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e6)
        advance(1)
    return times


def _floor_ms(prompt: np.ndarray, repeats: int, advance: Callable[[int], None]) -> float:
    data = tokens_to_bytes(prompt)
    times = _time_ms(lambda: hashlib.blake2b(data, digest_size=32).digest(), repeats, advance)
    return statistics.median(times)


def _row(block_tokens: int, kind: str, times: list[float], floor_ms: float) -> Row:
    median_ms = statistics.median(times)
    num_blocks = PROMPT_TOKENS // block_tokens
    return {
        "block_tokens": block_tokens,
        "input": kind,
        "prompt_tokens": PROMPT_TOKENS,
        "num_blocks": num_blocks,
        "repeats": len(times),
        "median_ms": median_ms,
        "p90_ms": float(np.percentile(times, 90)),
        "blocks_per_s": num_blocks / (median_ms / 1e3),
        "x_floor": median_ms / floor_ms,
        "target_ms": TARGET_MS,
        "meets_target": median_ms <= TARGET_MS,
    }


def run(options: SuiteOptions) -> list[Row]:
    """Times `block_keys` for every (block_tokens, input kind); one row each.

    Args:
        options: ``quick`` cuts the repetitions per row from 50 to 3.
    """
    repeats = QUICK_REPEATS if options.quick else REPEATS
    prompt = _prompt()
    cases = [(bt, kind) for bt in BLOCK_TOKENS for kind in INPUT_KINDS]
    rows = []
    with progress_bar("keys", total=repeats * (len(cases) + 1)) as advance:
        floor_ms = _floor_ms(prompt, repeats, advance)
        for block_tokens, kind in cases:
            ns, tokens = _namespace(block_tokens), INPUT_KINDS[kind](prompt)
            times = _time_ms(partial(block_keys, ns, tokens), repeats, advance)
            rows.append(_row(block_tokens, kind, times, floor_ms))
    return rows


def plot(rows: list[Row], path: Path) -> None:
    """Median ms per block size, one line per input kind, with the target as a dashed line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in INPUT_KINDS:
        mine = [r for r in rows if r["input"] == kind]
        ax.plot([r["block_tokens"] for r in mine], [r["median_ms"] for r in mine], "o-", label=kind)
    ax.axhline(TARGET_MS, color="grey", linestyle="--", label=f"target {TARGET_MS:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_xticks(BLOCK_TOKENS, [str(b) for b in BLOCK_TOKENS])
    ax.minorticks_off()
    ax.set(xlabel="block_tokens", ylabel="median ms", ylim=(0, None))
    ax.set_title(f"block_keys over {PROMPT_TOKENS:,} tokens")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
