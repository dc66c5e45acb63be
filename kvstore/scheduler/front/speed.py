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

Both are plain ratios of sums over a window of the last `WINDOW` observations, 1.0 before
the first: they follow a machine whose load changes within a few dozen requests, and one
slow request moves them by at most its share.
"""

from __future__ import annotations

from collections import deque

WINDOW = 64  # observations a factor is measured over
MIN_FACTOR = 1e-6  # a profile is never taken to predict work as free


class SpeedRatio:
    """Measured over predicted seconds, over the last `window` observations; a window of 0
    measures nothing (the factor stays 1.0: predictions are the profile's own)."""

    def __init__(self, window: int = WINDOW) -> None:
        if window < 0:
            raise ValueError(f"window must be >= 0: {window}")
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, measured_s: float, predicted_s: float) -> None:
        """One piece of work took `measured_s`; the profile predicted `predicted_s`.
        Work the profile predicts no time for tells nothing and is not counted."""
        if predicted_s > 0 and measured_s >= 0 and self._recent.maxlen:
            self._recent.append((measured_s, predicted_s))

    @property
    def value(self) -> float:
        """The factor: 1.0 until something was observed."""
        if not self._recent:
            return 1.0
        measured = sum(m for m, _ in self._recent)
        predicted = sum(p for _, p in self._recent)
        return max(measured / predicted, MIN_FACTOR)

    def __len__(self) -> int:
        return len(self._recent)
