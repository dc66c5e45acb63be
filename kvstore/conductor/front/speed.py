"""How much longer the engines take than the profile predicts, measured live.

A profile (`kvstore-bench calibrate`) times the model's forward pass in one quiet process.
Live, the same work also pays the engines' RPC and scheduling paths, the store, and every
process that shares the machine's cores, so it can take many times the profile's time; a
conductor that predicted with the profile alone would see empty queues and admit
everything. The live view therefore scales the profile by factors measured from what the
conductor itself sees, each the ratio of measured to predicted time over recent work:

- prefill, by the utilisation law (work = busy time / completions): an engine is busy
  while a request sent to it has not yet returned its first token, and each first token
  closes the busy time since the later of the engine's previous first token and the start
  of its busy period. Summed over recent requests, over the profile's prediction of their
  work, that is the factor. No queueing enters it: the wait of a request behind others is
  the busy time of those others, already counted once.
- decode: the gap between two messages of a decoding request is one step (or as many as
  the tokens it carried) of the batch the engine holds then; over the profile's step time
  of that batch, summed over recent gaps, it is the factor.
- handoff: from a request's first token to its decode engine's first message (the KV
  published, the decode call made, the KV loaded), over the profile's time to move the
  prompt's KV.

Both are plain ratios of sums over the last `WINDOW` observations, 1.0 before the first:
they follow a machine whose load changes within a few dozen requests, and one slow request
moves them by at most its share. An observation also expires `MAX_AGE_S` after it was made:
a conductor that once measured its engines slow (a stall) and then refused everything would
otherwise never measure them again; once its observations have expired it predicts with the
profile and measures anew.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

WINDOW = 64  # observations a factor is measured over
MAX_AGE_S = 60.0  # and none older than this
MIN_FACTOR = 1e-6  # a profile is never taken to predict work as free


class _Observation(NamedTuple):
    at_s: float
    measured_s: float
    predicted_s: float


class SpeedRatio:
    """Measured over predicted seconds, over the last `window` observations made within
    `max_age_s`; a window of 0 measures nothing (the factor stays 1.0: predictions are the
    profile's own). Times are the caller's clock, never going backwards."""

    def __init__(self, window: int = WINDOW, max_age_s: float = MAX_AGE_S) -> None:
        if window < 0 or not max_age_s > 0:
            raise ValueError(f"window must be >= 0 and max_age_s > 0: {window}, {max_age_s}")
        self.max_age_s = max_age_s
        self.window = window
        self._recent: deque[_Observation] = deque()
        self._measured_s = 0.0  # sums over `_recent`, kept as it changes (read per decision)
        self._predicted_s = 0.0

    def observe(self, now_s: float, measured_s: float, predicted_s: float) -> None:
        """At `now_s`, a piece of work took `measured_s` where the profile predicted
        `predicted_s`. Work the profile predicts no time for tells nothing: not counted."""
        if predicted_s > 0 and measured_s >= 0 and self.window:
            if len(self._recent) == self.window:
                self._drop_oldest()
            self._recent.append(_Observation(now_s, measured_s, predicted_s))
            self._measured_s += measured_s
            self._predicted_s += predicted_s

    def factor(self, now_s: float) -> float:
        """The factor at `now_s`: 1.0 while no observation is recent enough."""
        while self._recent and self._recent[0].at_s < now_s - self.max_age_s:
            self._drop_oldest()
        if not self._recent:
            return 1.0
        return max(self._measured_s / self._predicted_s, MIN_FACTOR)

    def _drop_oldest(self) -> None:
        old = self._recent.popleft()
        if self._recent:
            self._measured_s -= old.measured_s
            self._predicted_s -= old.predicted_s
        else:  # empty: start the sums afresh rather than carry rounding
            self._measured_s = self._predicted_s = 0.0

    def __len__(self) -> int:
        return len(self._recent)
