"""The time a request's first token takes that the conductor's TTFT prediction leaves out.

A prediction is the work queued ahead of a request and its own prefill, both at the
engines' measured speed (`speed.SpeedRatio`). What a request also pays, whatever the work:
the conductor's match in the store, the calls to the engine and back, the engine's wait
for its current step to end. A ratio scales that with the work, too much for long prompts
and too little for short ones; here it is added instead: the median by which recent first
tokens came later than predicted, over the last `WINDOW` served requests within
`MAX_AGE_S`, 0 before any. A median, so that one request stuck behind a stall moves it by
one place; never below 0, since a cost that every request pays cannot be negative (work
predicted too slow is the speed factor's to correct).

Only the median is used. Admitting against the objectives less a high quantile of the
same errors (so that the promise holds with that confidence) was measured live and made
the conductor refuse almost everything without meeting its objectives more often: the
errors are measured on admitted requests only, and refusing makes them scarce
(docs/benchmarks/scheduler.md, Live).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple

from kvstore.conductor.front.speed import MAX_AGE_S, WINDOW


class _Late(NamedTuple):
    at_s: float
    late_s: float  # measured TTFT less the prediction without this latency


class FixedLatency:
    """The median lateness of recent first tokens (see the module docstring); a window of
    0 measures nothing (the latency stays 0). Times are the caller's clock."""

    def __init__(self, window: int = WINDOW, max_age_s: float = MAX_AGE_S) -> None:
        if window < 0 or not max_age_s > 0:
            raise ValueError(f"window must be >= 0 and max_age_s > 0: {window}, {max_age_s}")
        self.window = window
        self.max_age_s = max_age_s
        self._recent: deque[_Late] = deque(maxlen=window or None)

    def observe(self, now_s: float, measured_s: float, predicted_s: float) -> None:
        """At `now_s`, a first token came `measured_s` after its request's arrival, where
        queue and prefill were predicted to take `predicted_s`."""
        if self.window:
            self._recent.append(_Late(now_s, measured_s - predicted_s))

    def seconds(self, now_s: float) -> float:
        """The latency to add to a prediction made at `now_s`."""
        while self._recent and self._recent[0].at_s < now_s - self.max_age_s:
            self._recent.popleft()
        if not self._recent:
            return 0.0
        return max(0.0, statistics.median(r.late_s for r in self._recent))

    def __len__(self) -> int:
        return len(self._recent)
