"""What a decoding request's remaining output is expected to be, learnt from finished ones.

No server knows a request's output length up front. Given that a sequence has generated
`g` tokens, its expected remaining output is the mean residual life of the observed output
lengths: E[L - g | L > g] over the last `window` finished requests (and the prior while none
has finished). The same window gives survival curves, P(L > x) for every x, over all
prompts and by prompt-length octave (a prompt's length says something of its output's: long
documents get short answers), which the decode-memory prediction replays sequences with
(`DecodeLoadPredictor.room`).

An output cut short by its request's `max_tokens` did not end: its own length would have
been longer. It is observed as cut (`observe(..., ended=False)`) and counted as the running
sequences are, only known to be longer than it got; taken as an end instead, a front whose
clients ask for a few tokens would learn that every output is that short.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from itertools import accumulate
from typing import NamedTuple

import numpy as np


class OutputLenEstimator:
    """Mean residual output length from a sliding window of observed output lengths."""

    # A prompt-length octave gets its own survival curve past this many outputs; below it,
    # a curve's steps (1 / outputs) are too coarse and the curve over all prompts stands in.
    min_octave_outputs = 32

    def __init__(self, prior_len: int = 256, window: int = 2048, refresh_every: int = 32) -> None:
        if prior_len < 1 or window < 1 or refresh_every < 1:
            raise ValueError("prior_len, window and refresh_every must be >= 1")
        self._prior_len = prior_len
        self._window: deque[int] = deque(maxlen=window)
        self._octaves: deque[int] = deque(maxlen=window)  # prompt octave of each, -1 unknown
        self._ended: deque[bool] = deque(maxlen=window)  # False: cut short by max_tokens
        self._seen: list[tuple[int, int, bool]] = []  # (output, octave, ended) at the refresh
        self._num_cut = 0  # of `_seen`, those cut short
        self._refresh_every = refresh_every
        self._since_refresh = 0
        self._sorted: list[int] = []
        self._suffix: list[int] = [0]  # _suffix[i] = sum(_sorted[i:])
        self._running = np.zeros(0, dtype=np.int64)  # generated tokens of running sequences
        self._running_prompts = np.zeros(0, dtype=np.int64)  # and their prompt tokens
        self._table: SurvivalTable | None = None  # built on first use after each change

    def observe(self, output_len: int, prompt_len: int | None = None, ended: bool = True) -> None:
        """Records a finished request's output length, and its prompt's length if known;
        `ended` False: its output was cut at that length (`max_tokens`), not ended there."""
        self._window.append(output_len)
        self._octaves.append(-1 if prompt_len is None else int(prompt_octave(prompt_len)))
        self._ended.append(ended)
        self._since_refresh += 1
        if self._since_refresh >= self._refresh_every or len(self._window) < self._refresh_every:
            self._refresh()

    def _refresh(self) -> None:
        self._sorted = sorted(self._window)
        self._suffix = [*reversed(list(accumulate(reversed(self._sorted)))), 0]
        self._seen = list(zip(self._window, self._octaves, self._ended, strict=True))
        self._num_cut = self._ended.count(False)
        self._since_refresh = 0
        self._table = None

    @property
    def mean_len(self) -> float:
        """Mean output length (the prior before any observation)."""
        return self.remaining(0) if self._sorted else float(self._prior_len)

    def quantile(self, q: float) -> float:
        """The `q`-quantile of the observed output lengths (the prior before any); at least 1.
        Where some were cut short, the Kaplan-Meier quantile of the survival curve over all
        prompts, which counts them (and the sequences running) as longer than they got.

        Raises:
            ValueError: `q` outside 0..1.
        """
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in 0..1: {q}")
        if not self._sorted:
            return float(self._prior_len)
        n = len(self._sorted)
        k = min(n - 1, int(q * n))  # the k-th shortest: P(L <= x) reaches (k + 1) / n
        if not self._num_cut:
            return float(max(1, self._sorted[k]))
        curve = self.survival()
        reached = np.flatnonzero(curve <= 1 - (k + 1) / n + 1e-9)
        return float(max(1, reached[0] if reached.size else len(curve) - 1))

    def remaining(self, generated: int) -> float:
        """Expected tokens still to come for a sequence that generated `generated`; at least 1."""
        if not self._sorted:
            return max(1.0, self._prior_len - generated)
        i = bisect.bisect_right(self._sorted, generated)
        longer = len(self._sorted) - i
        if longer == 0:
            return 1.0  # longer than anything seen: expect it to end soon
        return max(1.0, self._suffix[i] / longer - generated)

    def censor(self, running: Iterable[tuple[int, int]]) -> None:
        """Sets the sequences decoding now, as (tokens generated so far, prompt tokens):
        their outputs are longer, which `survival` counts."""
        pairs = np.asarray(list(running), dtype=np.int64).reshape(-1, 2)
        self._running, self._running_prompts = pairs[:, 0], pairs[:, 1]
        self._table = None

    def survival(self) -> np.ndarray:
        """``S[x] = P(L > x)`` for x = 0 .. past the longest output seen or running (0 there),
        over all prompts (`survival_table` row 0). Read-only."""
        return self.survival_table().curves[0]

    def survival_table(self) -> SurvivalTable:
        """The survival curves, over all prompts and by prompt-length octave.

        Kaplan-Meier estimates over the window's outputs and the sequences still running
        (`censor`), whose outputs are only known to be longer than they are now: while long
        outputs are still decoding, the short ones that finished first would otherwise stand
        for all. Before anything is seen, the prior as a certain length.
        """
        if self._table is None:
            self._table = self._kaplan_meier()
        return self._table

    def _kaplan_meier(self) -> SurvivalTable:
        seen = np.array(self._seen, dtype=np.int64).reshape(-1, 3)
        cut = seen[:, 2] == 0  # cut short: known only to be longer, as a running sequence
        ends, octaves = seen[~cut, 0], seen[~cut, 1]
        if not seen.size and not self._running.size:
            ends, octaves = np.array([self._prior_len]), np.array([-1])
        longer = np.concatenate([self._running, seen[cut, 0]])
        run_octaves = np.concatenate([prompt_octave(self._running_prompts), seen[cut, 1]])
        size = int(max(ends.max(initial=0), longer.max(initial=0))) + 2
        rows = int(max(octaves.max(initial=0), run_octaves.max(initial=0))) + 2  # + unknown
        octaves = np.where(octaves < 0, rows - 1, octaves)
        run_octaves = np.where(run_octaves < 0, rows - 1, run_octaves)

        def counts(values: np.ndarray, at: np.ndarray) -> np.ndarray:
            return np.bincount(at * size + values, minlength=rows * size).reshape(rows, size)

        died = counts(ends, octaves)  # (octave, x): outputs of exactly x tokens
        running = counts(longer, run_octaves)
        known = died.sum(axis=1) >= self.min_octave_outputs
        known[-1] = False  # outputs observed without their prompt length
        died = np.vstack([died.sum(axis=0), died])  # row 0: all prompts
        running = np.vstack([running.sum(axis=0), running])
        # At risk at x: ended at x or later, or running with x or more generated (L > x - 1).
        at_risk = np.cumsum((died + running)[:, ::-1], axis=1)[:, ::-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            hazard = np.where(at_risk > 0, died / at_risk, 1.0)
        curves = np.cumprod(1.0 - hazard, axis=1)
        curves[:, -1] = 0.0  # past everything seen, expect it to end
        curves.setflags(write=False)
        return SurvivalTable(curves, known)


def prompt_octave(prompt_lens: np.ndarray | int) -> np.ndarray:
    """The octave of each prompt length: 0 for 0 tokens, k for 2^(k-1) .. 2^k - 1."""
    return np.frexp(np.maximum(np.asarray(prompt_lens), 0))[1].astype(np.int64)


class SurvivalTable(NamedTuple):
    """Output-length survival curves: ``curves[0, x] = P(L > x)`` over all prompts and
    ``curves[1 + k, x]`` over prompts of octave k (`prompt_octave`), where `known[k]`: a
    prompt's length tells how long its output runs (long documents, short answers)."""

    curves: np.ndarray  # (1 + octaves + 1, x), read-only
    known: np.ndarray  # (octaves + 1,): enough outputs of that octave seen

    def rows(self, prompt_lens: np.ndarray) -> np.ndarray:
        """The row of `curves` each prompt's sequence decodes by: its octave's, where known,
        else all prompts'."""
        octave = np.minimum(prompt_octave(prompt_lens), len(self.known) - 1)
        return np.where(self.known[octave], 1 + octave, 0)
