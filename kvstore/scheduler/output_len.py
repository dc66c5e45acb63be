"""What a decoding request's remaining output is expected to be, learnt from finished ones.

No server knows a request's output length up front. Given that a sequence has generated
`g` tokens, its expected remaining output is the mean residual life of the observed output
lengths: E[L - g | L > g] over the last `window` finished requests (and the prior while none
has finished). The same window gives the survival curve, P(L > x) for every x, which the
decode-memory prediction replays sequences with (`DecodeLoadPredictor.room`).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from itertools import accumulate

import numpy as np


class OutputLenEstimator:
    """Mean residual output length from a sliding window of observed output lengths."""

    def __init__(self, prior_len: int = 256, window: int = 2048, refresh_every: int = 32) -> None:
        if prior_len < 1 or window < 1 or refresh_every < 1:
            raise ValueError("prior_len, window and refresh_every must be >= 1")
        self._prior_len = prior_len
        self._window: deque[int] = deque(maxlen=window)
        self._refresh_every = refresh_every
        self._since_refresh = 0
        self._sorted: list[int] = []
        self._suffix: list[int] = [0]  # _suffix[i] = sum(_sorted[i:])
        self._running = np.zeros(0, dtype=np.int64)  # generated tokens of running sequences
        self._survival: np.ndarray | None = None  # built on first use after each change

    def observe(self, output_len: int) -> None:
        """Records a finished request's output length."""
        self._window.append(output_len)
        self._since_refresh += 1
        if self._since_refresh >= self._refresh_every or len(self._window) < self._refresh_every:
            self._refresh()

    def _refresh(self) -> None:
        self._sorted = sorted(self._window)
        self._suffix = [*reversed(list(accumulate(reversed(self._sorted)))), 0]
        self._since_refresh = 0
        self._survival = None

    @property
    def mean_len(self) -> float:
        """Mean output length (the prior before any observation)."""
        return self.remaining(0) if self._sorted else float(self._prior_len)

    def quantile(self, q: float) -> float:
        """The `q`-quantile of the observed output lengths (the prior before any); at least 1.

        Raises:
            ValueError: `q` outside 0..1.
        """
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in 0..1: {q}")
        if not self._sorted:
            return float(self._prior_len)
        return float(max(1, self._sorted[min(len(self._sorted) - 1, int(q * len(self._sorted)))]))

    def remaining(self, generated: int) -> float:
        """Expected tokens still to come for a sequence that generated `generated`; at least 1."""
        if not self._sorted:
            return max(1.0, self._prior_len - generated)
        i = bisect.bisect_right(self._sorted, generated)
        longer = len(self._sorted) - i
        if longer == 0:
            return 1.0  # longer than anything seen: expect it to end soon
        return max(1.0, self._suffix[i] / longer - generated)

    def censor(self, generated: Iterable[int]) -> None:
        """Sets the sequences decoding now, by tokens generated so far: their outputs are
        longer, which `survival` counts."""
        self._running = np.asarray(list(generated), dtype=np.int64)
        self._survival = None

    def survival(self) -> np.ndarray:
        """``S[x] = P(L > x)`` for x = 0 .. the longest output seen or running (where it is 0).

        The Kaplan-Meier estimate over the window's outputs and the sequences still running
        (`censor`), whose outputs are only known to be longer than they are now: while long
        outputs are still decoding, the short ones that finished first would otherwise stand
        for all. Before anything is seen, the prior as a certain length. Read-only.
        """
        if self._survival is None:
            self._survival = self._kaplan_meier()
            self._survival.setflags(write=False)
        return self._survival

    def _kaplan_meier(self) -> np.ndarray:
        ends = np.asarray(self._sorted, dtype=np.int64)
        if not ends.size and not self._running.size:
            ends = np.array([self._prior_len])
        size = int(max(ends.max(initial=0), self._running.max(initial=0))) + 2
        died = np.bincount(ends, minlength=size)  # outputs of exactly x tokens
        # At risk at x: ended at x or later, or running with x or more generated (L > x - 1).
        at_risk = np.cumsum((died + np.bincount(self._running, minlength=size))[::-1])[::-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            hazard = np.where(at_risk > 0, died / at_risk, 1.0)
        s = np.cumprod(1.0 - hazard)
        s[-1] = 0.0  # past everything seen, expect it to end
        return s
