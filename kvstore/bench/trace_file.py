"""Mooncake-format traces: one JSON request per line, and how hits are weighted in tokens.

A line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``,
one hash id per 512-token block of the prompt; equal ids at the same position are the same
prefix block. A simulation reports, per request, how many blocks from the first it hit
(`num_hit`); a weighting turns those counts into a hit ratio.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from itertools import accumulate
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

BLOCK_TOKENS = 512
TRACES = Path(__file__).resolve().parent / "traces"  # see its README
DEFAULT_TRACE = TRACES / "mooncake_synthetic_trace.jsonl"
REAL_TRACE = TRACES / "mooncake_conversation_first_half.jsonl"  # real traffic


class TraceLine(NamedTuple):
    timestamp_ms: int
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def parse_request(line: str) -> TraceLine:
    """One trace line; raises ValueError naming the missing or malformed field."""
    try:
        obj = json.loads(line)
        hash_ids = tuple(int(h) for h in obj["hash_ids"])
        req = TraceLine(
            int(obj["timestamp"]), int(obj["input_length"]), int(obj["output_length"]), hash_ids
        )
    except (KeyError, TypeError, ValueError) as exc:  # bad JSON is a ValueError too
        raise ValueError(f"not a Mooncake trace line ({exc!r}): {line[:80]!r}") from None
    if not hash_ids:
        raise ValueError(f"request without hash_ids: {line[:80]!r}")
    return req


def load_trace(path: Path, limit: int | None = None) -> list[TraceLine]:
    """The first `limit` requests of `path` (all when None), blank lines skipped, their
    ids made prefix ids (`chain_ids`)."""
    requests: list[TraceLine] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                try:
                    requests.append(parse_request(line))
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from None
    return chain_ids(requests)


def chain_ids(requests: Sequence[TraceLine]) -> list[TraceLine]:
    """Makes an id stand for one prefix: an id seen under another parent than the first
    time gets a fresh id for each such parent.

    Chained prefix hashes already are prefix ids, and come out unchanged. Any other id list
    (an id repeated within a request, or under another prefix) still replays with prefix
    semantics, the same in the store and in every simulation.
    """
    first_parent: dict[int, int | None] = {}
    fresh: dict[tuple[int | None, int], int] = {}
    next_id = 1 + max((h for req in requests for h in req.hash_ids), default=0)
    out = []
    for req in requests:
        ids: list[int] = []
        for h in req.hash_ids:
            parent = ids[-1] if ids else None
            if first_parent.setdefault(h, parent) != parent:
                if (parent, h) not in fresh:
                    fresh[parent, h], next_id = next_id, next_id + 1
                h = fresh[parent, h]
            ids.append(h)
        out.append(req._replace(hash_ids=tuple(ids)))
    return out


def _token_weights(req: TraceLine) -> list[int]:
    """512 tokens a block, except the last: what is left of the prompt, when positive."""
    n = len(req.hash_ids)
    last = req.input_len - BLOCK_TOKENS * (n - 1)
    return [BLOCK_TOKENS] * (n - 1) + [last if last > 0 else BLOCK_TOKENS]


def _block_weights(req: TraceLine) -> list[int]:
    """512 tokens for every block: the convention of the reference table in traces/README."""
    return [BLOCK_TOKENS] * len(req.hash_ids)


Weighting = Callable[[TraceLine], list[int]]
WEIGHTINGS: MappingProxyType[str, Weighting] = MappingProxyType(
    {"tokens": _token_weights, "blocks": _block_weights}
)


def hit_ratio(requests: Sequence[TraceLine], num_hit: Sequence[int], weighting: str) -> float:
    """Hit tokens over prompt tokens, where request i hit its first `num_hit[i]` blocks."""
    weigh = WEIGHTINGS[weighting]
    hit = total = 0
    for req, k in zip(requests, num_hit, strict=True):
        cum = [0, *accumulate(weigh(req))]
        hit += cum[k]
        total += cum[-1]
    return hit / total if total else 0.0


def sweep_capacities(requests: Sequence[TraceLine], fractions: Sequence[float]) -> list[int]:
    """Capacities at `fractions` of the distinct blocks of `requests`, each at least the
    longest request (a request's blocks must fit at once), ascending, without repeats."""
    distinct = len({h for req in requests for h in req.hash_ids})
    longest = max(len(req.hash_ids) for req in requests)
    return sorted({max(longest, round(f * distinct)) for f in fractions})
