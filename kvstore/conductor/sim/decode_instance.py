"""A simulated decode instance: continuous batching as a fluid of steps.

Every sequence in the batch gains one token a step, so the instance keeps one token clock
`G` (tokens each member has gained since the instance started) instead of stepping each
sequence: a member that joined at clock `g0` has generated ``G - g0`` tokens. With `B`
members holding ``A + B G`` KV tokens, a step takes ``s(G) = c + q G`` (`CostModel`), so
between membership changes the clock follows dt = s(G) dG exactly, in closed form.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import NamedTuple

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.decision import RejectReason
from kvstore.conductor.view import DecodeView, IncomingSeq, RunningSeq

_EPS = 1e-9


class _Member(NamedTuple):
    request_id: int
    input_len: int
    join_clock: float
    end_clock: float


class SimDecode(DecodeView):
    """One decode instance; the simulator admits sequences and collects finished ones.

    With `refuse_over_tbt_s`, a sequence whose KV does not fit now, or whose step would
    then take longer than that, is refused on arrival (`refusal`) instead of queued.
    """

    def __init__(
        self, cost: CostModel, capacity_tokens: int, refuse_over_tbt_s: float | None = None
    ) -> None:
        self.cost = cost
        self._capacity = capacity_tokens
        self._refuse_over_tbt_s = refuse_over_tbt_s
        self.clock = 0.0
        self.last_s = 0.0
        self.members: dict[int, _Member] = {}
        self._ends: list[tuple[float, int]] = []  # (end clock, request id)
        self._offset = 0.0  # A: sum(input_len - join_clock) over members
        self.waiting: deque[tuple[int, int, int]] = deque()  # (id, input_len, tokens)
        self.incoming_seqs: dict[int, IncomingSeq] = {}

    def _step_s(self) -> float:
        return self.cost.decode_step_s(
            len(self.members), self._offset + len(self.members) * self.clock
        )

    def load(self, tbt_s: float) -> float:
        """How close the instance is to its binding limit: the larger of its KV use over
        its capacity and its step time over `tbt_s` (1.0: at the limit)."""
        return max(self.context_tokens() / self._capacity, self._step_s() / tbt_s)

    def refusal(self, input_len: int) -> RejectReason | None:
        """Why a sequence of `input_len` KV tokens arriving now is refused; None when it is
        taken, or when the instance queues instead of refusing."""
        if self._refuse_over_tbt_s is None:
            return None
        if self.waiting or self.context_tokens() + input_len > self._capacity:
            return RejectReason.DECODE_MEMORY
        step = self.cost.decode_step_s(len(self.members) + 1, self.context_tokens() + input_len)
        return RejectReason.TBT if step > self._refuse_over_tbt_s else None

    @property
    def refuses_when_busy(self) -> bool:
        return self._refuse_over_tbt_s is not None

    def _slope(self) -> float:
        return self.cost.profile.decode_s_per_context_token * len(self.members)

    def advance(self, now_s: float) -> None:
        """Moves the token clock to `now_s`."""
        dt = now_s - self.last_s
        if dt > 0 and self.members:
            s0, q = self._step_s(), self._slope()
            self.clock += 2 * dt / (s0 + math.sqrt(s0 * s0 + 2 * q * dt))
        self.last_s = max(self.last_s, now_s)

    def admit(self, request_id: int, input_len: int, tokens: int, now_s: float) -> None:
        """A sequence of `input_len` KV tokens arrives to decode `tokens` more; it waits while
        the instance's KV is full or others wait ahead of it (FIFO, as an engine's waiting
        queue)."""
        self.advance(now_s)
        self.incoming_seqs.pop(request_id, None)
        full = self.context_tokens() + input_len > self._capacity
        if self.members and (full or self.waiting):
            self.waiting.append((request_id, input_len, tokens))
            return
        self._join(request_id, input_len, tokens)

    def _join(self, request_id: int, input_len: int, tokens: int) -> None:
        member = _Member(request_id, input_len, self.clock, self.clock + tokens)
        self.members[request_id] = member
        self._offset += input_len - self.clock
        heapq.heappush(self._ends, (member.end_clock, request_id))

    def next_end_s(self) -> float | None:
        """When the next member finishes, at the current membership; None when idle."""
        if not self._ends:
            return None
        d_clock = max(0.0, self._ends[0][0] - self.clock)
        return self.last_s + d_clock * (self._step_s() + self._slope() * d_clock / 2)

    def pop_finished(self, now_s: float) -> list[int]:
        """Removes the members done by `now_s` and lets waiting sequences in; their ids."""
        self.advance(now_s)
        done = []
        while self._ends and self._ends[0][0] <= self.clock + _EPS:
            _, request_id = heapq.heappop(self._ends)
            member = self.members.pop(request_id)
            self._offset -= member.input_len - member.join_clock
            done.append(request_id)
        while self.waiting and (
            not self.members or self.context_tokens() + self.waiting[0][1] <= self._capacity
        ):
            self._join(*self.waiting.popleft())
        return done

    def running(self) -> list[RunningSeq]:
        seqs = [
            RunningSeq(
                int(m.input_len + self.clock - m.join_clock), 1 + int(self.clock - m.join_clock)
            )
            for m in self.members.values()
        ]
        seqs.extend(RunningSeq(n, 1, is_waiting=True) for _, n, _ in self.waiting)
        return seqs

    def incoming(self) -> list[IncomingSeq]:
        return list(self.incoming_seqs.values())

    def context_tokens(self) -> int:
        return int(self._offset + len(self.members) * self.clock)

    @property
    def kv_capacity_tokens(self) -> int:
        return self._capacity
