"""Decode-load prediction: the batch a decode instance will hold when a request reaches it,
and when the request gets room there.

Admitting on the load now lets in every request while decode is light, though all of them
reach decode together a TTFT later, then refuses everything while they decode: prefill and
decode load swing in anti-phase (Mooncake, arXiv 2407.00079 v3, section 7). The prediction
replays instead what the instance will do until the request arrives, step by step: each
running sequence still decodes with the probability the learnt output-length distribution
gives it, knowing how far it got (`OutputLenEstimator.survival`), so the batch's KV is its
expectation, not the KV left when every sequence ends after its mean residual output (which
holds all of it until then and none after: too much soon, too little late, for outputs of
any spread); the sequences waiting for KV room and those routed there and still in prefill
join in order (FIFO, as an engine's waiting queue) as soon as their KV fits beside it, and
the request joins after them. The result is the batch it joins and how long it waits for
room (`DecodeRoom`); a wait is not a miss: it spreads over the request's output tokens
(`DecodeRoom.tbt_s`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import numpy as np

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.output_len import OutputLenEstimator, SurvivalTable
from kvstore.conductor.view import DecodeView


class DecodeLoad(NamedTuple):
    """A decode batch: how many sequences and how many KV tokens they hold."""

    num_seqs: int
    context_tokens: float

    def plus(self, input_len: int) -> DecodeLoad:
        """The batch with one more sequence of `input_len` tokens."""
        return DecodeLoad(self.num_seqs + 1, self.context_tokens + input_len)


def current_load(decode: DecodeView) -> DecodeLoad:
    """What the instance holds now."""
    decoding = sum(1 for seq in decode.running() if not seq.is_waiting)
    return DecodeLoad(decoding, float(decode.context_tokens()))


class DecodeRoom(NamedTuple):
    """When a request reaching a decode instance gets KV room, and the batch it joins;
    and the probability that it fits at once when it arrives (`DecodeLoadPredictor.room`)."""

    join_s: float  # infinite when its KV exceeds the instance's capacity
    load: DecodeLoad  # the batch at join_s, the request included
    fits_p: float = 1.0  # P(its KV fits, and the step stays within the TBT, at its arrival)

    def tbt_s(self, step_s: float, reach_s: float, handoff_s: float, output_len: float) -> float:
        """Mean time between tokens of a request that reached decode at `reach_s`, `handoff_s`
        after its first token, and decodes `output_len` tokens in all at `step_s` a step:
        the wait for room and the handoff spread over its ``output_len - 1`` steps."""
        steps = max(1.0, output_len - 1)
        return step_s + (handoff_s + max(0.0, self.join_s - reach_s)) / steps


class _ExpectedBatch:
    """The expected KV tokens and sequences of a decode batch, on a grid `tau` of decode steps
    from now (integers, ascending, from 0).

    A member that has generated `g` tokens and holds `c` KV tokens still decodes `t` steps
    later with probability ``p = S(g + t) / S(g)`` (`OutputLenEstimator.survival`), holding
    ``c + t`` tokens then. The batch's KV is a sum over many members that end independently,
    so it stays close to its expectation; what the batch holds at a step is taken to be that.
    Its spread is kept too (each member a Bernoulli of ``p``: variance ``p (1 - p)`` of its
    count, times its tokens squared for the KV), for the odds that a newcomer fits.
    """

    def __init__(self, survival: SurvivalTable, spacing: int, points: int) -> None:
        self._table = survival
        self.spacing = spacing
        self.tau = np.arange(points, dtype=float) * spacing
        self.kv = np.zeros(points)
        self.seqs = np.zeros(points)
        self.kv_var = np.zeros(points)  # variance of the KV
        self.seqs_var = np.zeros(points)  # of the sequences' count
        self.cov = np.zeros(points)  # their covariance
        self.last_join = 0.0  # FIFO: none joins before the one ahead of it
        # (row, j): P(a sequence that joined j grid points ago still decodes), by survival
        # curve.
        curves = survival.curves
        first = curves[:, 1:2]
        with np.errstate(divide="ignore", invalid="ignore"):
            fresh = np.where(first > 0, curves[:, 1:] / first, np.arange(curves.shape[1] - 1) < 1)
        fresh = np.hstack([fresh, np.zeros((len(curves), 1))])
        self._fresh = fresh[:, np.minimum(np.arange(points) * spacing, fresh.shape[1] - 1)]

    def _alive(self, ages: np.ndarray, prompts: np.ndarray) -> np.ndarray:
        """(members, grid): P(still decoding) on the grid for members `ages` old now, by the
        curve of its prompt length. One older than any output seen ends within a step."""
        curves = self._table.curves
        rows = self._table.rows(prompts)
        last = curves.shape[1] - 1
        ages = np.minimum(ages, last)
        x = np.minimum(ages[:, None] + self.tau[None, :].astype(np.int64), last)
        base = curves[rows, ages][:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(base > 0, curves[rows[:, None], x] / base, self.tau < 1)

    def add(self, ages: np.ndarray, tokens: np.ndarray, prompts: np.ndarray) -> None:
        """Members of `ages` holding `tokens` now (of `prompts` prompt tokens)."""
        alive = self._alive(ages, prompts)
        held = tokens[:, None] + self.tau[None, :]
        spread = alive * (1 - alive)
        self.kv += (alive * held).sum(axis=0)
        self.seqs += alive.sum(axis=0)
        self.kv_var += (spread * held * held).sum(axis=0)
        self.seqs_var += spread.sum(axis=0)
        self.cov += (spread * held).sum(axis=0)

    def _count(self, k: int, alive: np.ndarray, held: np.ndarray, spread: np.ndarray) -> None:
        """Adds, from grid point `k` on, a member (or a group) alive with probability (or
        in number) `alive`, holding `held` KV tokens each, its count of variance `spread`."""
        weighted = spread * held
        self.kv[k:] += alive * held
        self.seqs[k:] += alive
        self.kv_var[k:] += weighted * held
        self.seqs_var[k:] += spread
        self.cov[k:] += weighted

    def join(self, at: float, tokens: float, row: int, capacity: float) -> float:
        """Adds a sequence of `tokens` KV tokens, decoding by survival curve `row`, that
        arrives at step `at` and joins at its `first_fit` (held from the grid point there or
        next); that step."""
        t = self.first_fit(at, tokens, capacity)
        self.last_join = t
        self.enter(t, tokens, row)
        return t

    def expect(self, t: float, count: float, tokens: float) -> None:
        """Adds `count` sequences expected (a Poisson count) to join fresh by step `t` (held
        from the grid point there or before), of `tokens` KV tokens each, decoding by the
        curve over all prompts."""
        k = max(0, math.floor(t / self.spacing))
        m = len(self.tau) - k
        alive = count * self._fresh[0, :m]
        self._count(k, alive, tokens + self.tau[:m], spread=alive)

    def enter(self, t: float, tokens: float, row: int, taken_p: float = 1.0) -> None:
        """Adds a sequence of `tokens` KV tokens, decoding by survival curve `row`, held from
        step `t` (the grid point there or next; now, if overdue) with probability
        `taken_p`."""
        k = max(0, math.ceil(t / self.spacing))
        m = len(self.tau) - k
        alive = taken_p * self._fresh[row, :m]
        self._count(k, alive, tokens + self.tau[:m], alive * (1 - alive))

    def first_fit(self, at: float, tokens: float, capacity: float) -> float:
        """The first step from `at` on (at the grid's resolution) at which `tokens` more fit;
        the grid's end when they fit nowhere on it. Not before the last `join` (FIFO)."""
        at = max(at, self.last_join)
        k = min(int(at // self.spacing), len(self.tau) - 1)
        fits = self.kv[k:] <= capacity - tokens
        j = int(fits.argmax())
        if not fits[j]:
            return max(at, float(self.tau[-1]))
        return max(at, float(self.tau[k + j]))

    def at(self, t: float) -> DecodeLoad:
        """The expected batch at step `t`."""
        return DecodeLoad(
            round(float(np.interp(t, self.tau, self.seqs))),
            float(np.interp(t, self.tau, self.kv)),
        )

    def fits_p(
        self, t: float, tokens: float, capacity: float, cost: CostModel, tbt_s: float
    ) -> float:
        """P(a newcomer of `tokens` KV tokens arriving at step `t` fits: the batch's KV and
        its own within `capacity`, and the step with it within `tbt_s`), the batch's KV and
        count taken as normal (sums of many independent members); the lesser of the two."""
        x = min(max(t / self.spacing, 0.0), len(self.tau) - 1.0)  # interpolated on the grid
        lo = min(int(x), len(self.tau) - 2) if len(self.tau) > 1 else 0
        w = x - lo
        kv, kv_var, seqs, seqs_var, cov = (
            float(a[lo] * (1 - w) + a[min(lo + 1, len(a) - 1)] * w)
            for a in (self.kv, self.kv_var, self.seqs, self.seqs_var, self.cov)
        )
        p = cost.profile
        a, b = p.decode_s_per_seq, p.decode_s_per_context_token
        step = cost.decode_step_s(1, tokens) + a * seqs + b * kv
        step_var = a * a * seqs_var + 2 * a * b * cov + b * b * kv_var
        return min(_below(capacity - tokens - kv, kv_var), _below(tbt_s - step, step_var))


def _below(margin: float, variance: float) -> float:
    """P(X <= mean + margin) for a normal X of `variance` (a step where it is 0)."""
    if variance <= 0:
        return float(margin >= 0)
    return 0.5 * (1 + math.erf(margin / math.sqrt(2 * variance)))


_GRID_POINTS = 1024  # steps a room prediction replays at most; coarser beyond


class Arrivals:
    """The requests recently routed to one decode instance: when, how long each was
    predicted to take to reach it, and its KV; so that a prediction can expect those not
    routed yet that will reach it before a given request (a shorter prefill overtakes).

    Routings come at the recent rate `r`; one routed `s` seconds from now arrives `D`
    later, `D` drawn from the recent delays; it reaches the instance before a request
    arriving `h` seconds from now when ``s + D < h``: over ``s`` in ``0..h`` that is
    ``r E[(h - D)+]`` of them.
    """

    def __init__(self, window: int = 64) -> None:
        self._recent: deque[tuple[float, float, int]] = deque(maxlen=window)

    def record(self, now_s: float, reach_s: float, input_len: int) -> None:
        """A request routed there at `now_s`, predicted to reach it at `reach_s`."""
        self._recent.append((now_s, max(0.0, reach_s - now_s), input_len))

    def overtaking(self, now_s: float, at_s: float) -> tuple[float, float]:
        """How many requests not routed yet are expected to reach the instance before
        `at_s`, and the KV tokens each holds (their recent mean)."""
        if len(self._recent) < 2:
            return 0.0, 0.0
        span = now_s - self._recent[0][0]
        if span <= 0:
            return 0.0, 0.0
        h = at_s - now_s
        ahead = sum(max(0.0, h - delay) for _, delay, _ in self._recent) / len(self._recent)
        tokens = sum(n for _, _, n in self._recent) / len(self._recent)
        return len(self._recent) / span * ahead, tokens


class DecodeLoadPredictor:
    """Predicts a decode instance's batch at a future time; learns output lengths."""

    def __init__(self, cost: CostModel, outputs: OutputLenEstimator) -> None:
        self.cost = cost
        self.outputs = outputs

    def step_s(self, load: DecodeLoad) -> float:
        """Decode step time of `load`."""
        return self.cost.decode_step_s(load.num_seqs, load.context_tokens)

    def room(
        self,
        decode: DecodeView,
        now_s: float,
        at_s: float,
        input_len: int,
        tbt_s: float = math.inf,
        arrivals: Arrivals | None = None,
    ) -> DecodeRoom:
        """When a sequence of `input_len` KV tokens reaching `decode` at `at_s` gets room
        there, and the batch it then joins (itself included); ``join_s`` is infinite when
        its KV exceeds the capacity. ``fits_p``: the odds that it fits at once on arrival,
        the step within `tbt_s` (`_ExpectedBatch.fits_p`).

        The sequences ahead of it are those running or waiting now and those incoming
        before `at_s`; one arriving later is not counted: it queues behind. Each joins (in
        order) at the first step its KV fits beside the expected KV of the batch
        (`_ExpectedBatch`); on an instance that refuses instead of queuing, it joins on
        arrival with the odds that it fits then, or never. Requests not routed yet that
        will reach the instance before it (a shorter prefill) join ahead too: as many as
        its recent `arrivals` say to expect (`Arrivals.overtaking`), where given.
        """
        capacity = decode.kv_capacity_tokens
        if input_len > capacity:
            return DecodeRoom(math.inf, DecodeLoad(1, float(input_len)), 0.0)
        step = max(self.step_s(current_load(decode)), self.cost.decode_step_s(1, 0))
        running = [s for s in decode.running() if not s.is_waiting]
        queue = [(0.0, float(s.context_len)) for s in decode.running() if s.is_waiting]
        queue += sorted(
            ((i.arrival_s - now_s) / step, float(i.input_len))
            for i in decode.incoming()
            if i.arrival_s <= at_s
        )
        queue = [(t, n) for t, n in queue if n <= capacity]  # the instance never holds more
        arrive = (at_s - now_s) / step
        table = self.outputs.survival_table()
        batch = _ExpectedBatch(table, *self._grid(arrive, queue, capacity))
        ages = np.array([s.generated for s in running], dtype=np.int64)
        tokens = np.array([s.context_len for s in running], dtype=np.int64)
        batch.add(ages, tokens.astype(float), tokens - ages)
        rows = table.rows(np.array([n for _, n in queue], dtype=np.int64)).tolist()
        for (t, n), row in zip(queue, rows, strict=True):
            if decode.refuses_when_busy:  # taken on arrival when it fits, else never
                batch.enter(t, n, row, batch.fits_p(t, n, capacity, self.cost, tbt_s))
            else:
                batch.join(t, n, row, capacity)
        if arrivals is not None:
            count, tokens_each = arrivals.overtaking(now_s, at_s)
            if count > 0:
                batch.expect(arrive, count, tokens_each)
        join = batch.first_fit(arrive, input_len, capacity)
        load = batch.at(join)
        join_s = at_s if join <= arrive else now_s + join * step
        fits_p = batch.fits_p(arrive, input_len, capacity, self.cost, tbt_s)
        return DecodeRoom(
            join_s, DecodeLoad(load.num_seqs + 1, load.context_tokens + input_len), fits_p
        )

    def _grid(
        self, arrive: float, queue: list[tuple[float, float]], capacity: int
    ) -> tuple[int, int]:
        """The steps from now to replay, as (spacing, points): past the arrival, by as many
        longest outputs as the queue ahead takes to drain (it joins as the batch ends), at
        most `_GRID_POINTS` of them."""
        longest = len(self.outputs.survival())
        queued = sum(n for _, n in queue) / capacity
        horizon = max(arrive, *(t for t, _ in queue), 0.0) + longest * (2 + queued)
        spacing = max(1, math.ceil(horizon / _GRID_POINTS))
        return spacing, math.ceil(horizon / spacing) + 1

    def decode_s(self) -> float:
        """How long a new request is expected to decode for, at most (at the TBT bound)."""
        return self.outputs.mean_len

    def end_times(self, decode: DecodeView, now_s: float) -> list[float]:
        """Predicted end of each running sequence, soonest first."""
        step = max(self.step_s(current_load(decode)), self.cost.decode_step_s(1, 0))
        return sorted(now_s + self.outputs.remaining(s.generated) * step for s in decode.running())
