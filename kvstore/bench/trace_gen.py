"""Suite `trace-gen`: write a synthetic Mooncake-format trace of a multi-turn workload.

The shared trace is one workload; a policy tuned to it may fail on others. These traces
check that it does not. Each is seeded and deterministic, and its hash ids are chained
content hashes, as a real engine computes them: a block's id names its parent's id and the
token ranges it holds, so two prompts share a block exactly when they share everything up
to its end.

Kinds:

- conversation: chat sessions over a few shared system prompts of Zipf popularity. A
  turn's prompt is the previous prompt, its answer and a new user message, so a turn reads
  every block of the previous turn's prompt but the last, which the answer completes.
- agent: tool-using agents over a few large shared tool prompts. A step appends a short
  action and tool result, so steps are many, short and close together.
- coding: code completion as the Azure LLM inference trace of 2023 shows it (Patel et al.,
  "Splitwise", ISCA'24, section III: coding prompts of about 1,500 tokens at the median,
  outputs of about 13): long prompts over a repository's shared context, a few tokens out,
  a few completions a session.

Sessions run `concurrency` at a time; each request comes from one of them at random, so
turns of a session are interleaved with others' as a serving system sees them.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvstore.bench.options import extra_of
from kvstore.bench.report import Row, progress_bar
from kvstore.bench.suites import SuiteOptions
from kvstore.bench.trace_file import BLOCK_TOKENS, TraceLine, hit_ratio
from kvstore.bench.trace_sim import simulate_unbounded


@dataclass(frozen=True)
class Workload:
    """The shape of one kind of trace; token counts are drawn uniformly in each range."""

    num_shared: int  # system or tool prompts
    shared_tokens: tuple[int, int]
    zipf: float  # popularity of the shared prompts: weight 1 / rank**zipf
    mean_turns: float  # turns (steps) per session: 1 + geometric
    user_tokens: tuple[int, int]  # user message (tool result) per turn
    answer_tokens: tuple[int, int]  # answer (action) per turn
    concurrency: int
    mean_gap_ms: float


KINDS: Mapping[str, Workload] = MappingProxyType(
    {
        "conversation": Workload(20, (1000, 6000), 1.2, 4.0, (50, 3000), (50, 800), 200, 200.0),
        "agent": Workload(4, (4000, 12000), 1.0, 8.0, (100, 1500), (50, 300), 64, 50.0),
        "coding": Workload(8, (300, 1200), 1.2, 4.0, (50, 500), (2, 30), 100, 20.0),
    }
)
DEFAULT_SESSIONS = 1500
QUICK_SESSIONS = 200


class _Prompt:
    """A growing prompt: segments of tokens, numbered, and the chained ids of its blocks."""

    def __init__(self, ids: dict[tuple, int], shared: tuple[int, int]) -> None:
        self._ids = ids
        self.segments: list[tuple[int, int]] = [shared]  # (segment id, tokens)

    def append(self, segment: int, tokens: int) -> None:
        self.segments.append((segment, tokens))

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.segments)

    def hash_ids(self) -> list[int]:
        """One id per block: (parent id, the token ranges it holds), numbered on first sight."""
        pieces: list[tuple[int, int, int]] = []  # (segment, first token, end) in this block
        out: list[int] = []
        parent = -1
        room = BLOCK_TOKENS
        for segment, tokens in self.segments:
            start = 0
            while start < tokens:
                take = min(room, tokens - start)
                pieces.append((segment, start, start + take))
                start += take
                room -= take
                if room == 0:
                    parent = self._block_id(parent, pieces, out)
                    pieces, room = [], BLOCK_TOKENS
        if pieces:
            self._block_id(parent, pieces, out)
        return out

    def _block_id(self, parent: int, pieces: list[tuple[int, int, int]], out: list[int]) -> int:
        block = self._ids.setdefault((parent, tuple(pieces)), len(self._ids))
        out.append(block)
        return block


def generate(
    kind: str, num_sessions: int, seed: int = 0, advance: Callable[[int], None] = lambda n: None
) -> list[TraceLine]:
    """A trace of `num_sessions` sessions of `kind`, the same for the same arguments.

    `advance(1)` as each session ends.
    """
    shape = KINDS[kind]
    rng = random.Random(seed)
    ids: dict[tuple, int] = {}
    shared = [(-1 - i, rng.randint(*shape.shared_tokens)) for i in range(shape.num_shared)]
    weights = [1 / (rank + 1) ** shape.zipf for rank in range(shape.num_shared)]
    next_segment = 0
    active: list[tuple[_Prompt, list[int]]] = []  # (prompt, [turns left])
    started = 0
    now_ms = 0.0
    requests: list[TraceLine] = []
    while started < num_sessions or active:
        while len(active) < shape.concurrency and started < num_sessions:
            turns = 1 + int(rng.expovariate(1 / (shape.mean_turns - 1)))
            active.append((_Prompt(ids, rng.choices(shared, weights)[0]), [turns]))
            started += 1
        session = rng.randrange(len(active))
        prompt, turns_left = active[session]
        prompt.append(next_segment, rng.randint(*shape.user_tokens))
        answer = rng.randint(*shape.answer_tokens)
        requests.append(TraceLine(int(now_ms), prompt.num_tokens, answer, tuple(prompt.hash_ids())))
        prompt.append(next_segment + 1, answer)
        next_segment += 2
        now_ms += rng.expovariate(1 / shape.mean_gap_ms)
        turns_left[0] -= 1
        if turns_left[0] == 0:
            active.pop(session)
            advance(1)
    return requests


def write_trace(requests: list[TraceLine], path: Path) -> None:
    """Writes `requests` as Mooncake-format JSONL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for req in requests:
            line = {
                "timestamp": req.timestamp_ms,
                "input_length": req.input_len,
                "output_length": req.output_len,
                "hash_ids": list(req.hash_ids),
            }
            f.write(json.dumps(line) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's own flags."""
    add = parser.add_argument
    add("--kind", default="conversation", choices=list(KINDS), help="workload shape")
    add("--out", type=Path, required=True, help="JSONL file to write")
    add("--sessions", type=int, default=None, help=f"sessions (default {DEFAULT_SESSIONS})")
    add("--seed", type=int, default=0, help="random seed")


def run(options: SuiteOptions) -> list[Row]:
    """Generates and writes one trace; one row describing it."""
    s = {"kind": "conversation", "seed": 0, "sessions": None, "out": None, **extra_of(options)}
    if s["out"] is None:
        raise SystemExit("trace-gen needs --out PATH")
    kind, out, seed = str(s["kind"]), Path(str(s["out"])), int(s["seed"])  # type: ignore[call-overload]
    default = QUICK_SESSIONS if options.quick else DEFAULT_SESSIONS
    sessions = default if s["sessions"] is None else int(s["sessions"])  # type: ignore[call-overload]
    if sessions < 1:
        raise SystemExit(f"--sessions must be >= 1: {sessions}")
    with progress_bar("trace-gen", total=sessions) as advance:
        requests = generate(kind, sessions, seed, advance)
    write_trace(requests, out)
    blocks = [h for req in requests for h in req.hash_ids]
    return [
        {
            "trace": str(out),
            "kind": kind,
            "seed": seed,
            "sessions": sessions,
            "requests": len(requests),
            "blocks": len(blocks),
            "unique_blocks": len(set(blocks)),
            "unbounded_hit_ratio": hit_ratio(requests, simulate_unbounded(requests), "tokens"),
        }
    ]
