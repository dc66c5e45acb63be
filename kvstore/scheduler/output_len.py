"""What a decoding request's remaining output is expected to be, learnt from finished ones.

No server knows a request's output length up front. Given that a sequence has generated
`g` tokens, its expected remaining output is the mean residual life of the observed output
lengths: E[L - g | L > g] over the last `window` finished requests (and the prior while none
has finished).
"""

from __future__ import annotations

import bisect
from collections import deque
from itertools import accumulate


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
