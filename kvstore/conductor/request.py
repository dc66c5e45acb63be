"""A request as the conductor sees it: no output length, which no server knows up front."""

from __future__ import annotations

from typing import NamedTuple


class SchedRequest(NamedTuple):
    """One request to route.

    Attributes:
        request_id: unique within a run.
        arrival_s: when it reached the conductor.
        input_len: prompt tokens.
        hash_ids: chained prefix ids of its full and last blocks, one per `block_tokens`.
        priority: llm-d's notion: below `SHEDDABLE_BELOW` the request may be shed.
        max_output: the most output tokens its client asked for (`max_tokens`), None where
            not said: the output is at most that, though how long is still unknown.
    """

    request_id: int
    arrival_s: float
    input_len: int
    hash_ids: tuple[int, ...]
    priority: int = 0
    max_output: int | None = None
