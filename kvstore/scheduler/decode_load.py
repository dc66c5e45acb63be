"""Decode-load prediction: the batch a decode instance will hold when a request reaches it,
and when the request gets room there.

Admitting on the load now lets in every request while decode is light, though all of them
reach decode together a TTFT later, then refuses everything while they decode: prefill and
decode load swing in anti-phase (Mooncake, arXiv 2407.00079 v3, section 7). The prediction
replays instead, in a fluid of decode steps, what the instance will do until the request
arrives: each running sequence ends after its mean residual output (`OutputLenEstimator`),
the sequences waiting for KV room and those routed there and still in prefill join in
order (FIFO, as an engine's waiting queue) as the ends free room, each for a mean output,
and the request joins after them once its KV fits. The result is the batch it joins and
how long it waits for room (`DecodeRoom`); a wait is not a miss: it spreads over the
request's output tokens (`DecodeRoom.tbt_s`).
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

from kvstore.scheduler.cost_model import CostModel
from kvstore.scheduler.output_len import OutputLenEstimator
from kvstore.scheduler.view import DecodeView


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
    """When a request reaching a decode instance gets KV room, and the batch it joins."""

    join_s: float  # infinite when its KV exceeds the instance's capacity
    load: DecodeLoad  # the batch at join_s, the request included

    def tbt_s(self, step_s: float, reach_s: float, handoff_s: float, output_len: float) -> float:
        """Mean time between tokens of a request that reached decode at `reach_s`, `handoff_s`
        after its first token, and decodes `output_len` tokens in all at `step_s` a step:
        the wait for room and the handoff spread over its ``output_len - 1`` steps."""
        steps = max(1.0, output_len - 1)
        return step_s + (handoff_s + max(0.0, self.join_s - reach_s)) / steps


class _FluidBatch:
    """Members of a decode batch whose KV grows one token a step of `step_s`, ended in order
    of their predicted ends; `t` only moves forward."""

    def __init__(self, step_s: float, now_s: float) -> None:
        self.step_s = step_s
        self.t = now_s
        self._ends: list[tuple[float, float]] = []  # heap of (end, KV tokens at time 0)
        self._base = 0.0  # sum of the members' KV tokens at time 0

    @property
    def num_seqs(self) -> int:
        return len(self._ends)

    def context_at(self, t: float) -> float:
        return self._base + len(self._ends) * t / self.step_s

    def add(self, end_s: float, tokens: float) -> None:
        """A member holding `tokens` now (at `t`) until `end_s`."""
        base = tokens - self.t / self.step_s
        heapq.heappush(self._ends, (end_s, base))
        self._base += base

    def _end_next(self) -> None:
        end_s, base = heapq.heappop(self._ends)
        self.t = max(self.t, end_s)
        self._base -= base

    def make_room(self, arrival_s: float, tokens: float, capacity: float) -> bool:
        """Moves `t` to the earliest time from `arrival_s` on when `tokens` more fit, ending
        members as predicted; False (and nothing ended) when they never fit."""
        if tokens > capacity:
            return False
        self.t = max(self.t, arrival_s)
        while self._ends and self._ends[0][0] <= self.t:
            self._end_next()
        while self._ends and self.context_at(self.t) + tokens > capacity:
            self._end_next()
        return True


class DecodeLoadPredictor:
    """Predicts a decode instance's batch at a future time; learns output lengths."""

    def __init__(self, cost: CostModel, outputs: OutputLenEstimator) -> None:
        self.cost = cost
        self.outputs = outputs

    def step_s(self, load: DecodeLoad) -> float:
        """Decode step time of `load`."""
        return self.cost.decode_step_s(load.num_seqs, load.context_tokens)

    def room(self, decode: DecodeView, now_s: float, at_s: float, input_len: int) -> DecodeRoom:
        """When a sequence of `input_len` KV tokens reaching `decode` at `at_s` gets room
        there, and the batch it then joins (itself included); ``join_s`` is infinite when
        its KV exceeds the capacity.

        The sequences ahead of it are those running or waiting now and those incoming
        before `at_s`; one arriving later is not counted: it was or will be admitted
        against the batch it finds, this one included.
        """
        step = max(self.step_s(current_load(decode)), self.cost.decode_step_s(1, 0))
        batch = _FluidBatch(step, now_s)
        queue: list[tuple[float, float]] = []  # (arrival, KV tokens), in join order
        for seq in decode.running():
            if seq.is_waiting:
                queue.append((now_s, seq.context_len))
            else:
                batch.add(now_s + self.outputs.remaining(seq.generated) * step, seq.context_len)
        incoming = sorted(
            (i.arrival_s, i.input_len) for i in decode.incoming() if i.arrival_s <= at_s
        )
        capacity = decode.kv_capacity_tokens
        for arrival, tokens in [*queue, *incoming]:
            if not batch.make_room(arrival, tokens, capacity):
                continue  # never fits: the instance will not hold it either
            batch.add(batch.t + self.outputs.remaining(1) * step, tokens)
        if not batch.make_room(at_s, input_len, capacity):
            return DecodeRoom(math.inf, DecodeLoad(1, float(input_len)))
        return DecodeRoom(
            batch.t, DecodeLoad(batch.num_seqs + 1, batch.context_at(batch.t) + input_len)
        )

    def decode_s(self) -> float:
        """How long a new request is expected to decode for, at most (at the TBT bound)."""
        return self.outputs.mean_len

    def end_times(self, decode: DecodeView, now_s: float) -> list[float]:
        """Predicted end of each running sequence, soonest first."""
        step = max(self.step_s(current_load(decode)), self.cost.decode_step_s(1, 0))
        return sorted(now_s + self.outputs.remaining(s.generated) * step for s in decode.running())
