"""The event loop: arrivals, prefill starts and ends, KV arrivals at decode, decode ends.

Deterministic: events at the same time run in the order they were scheduled, and the only
randomness is the policy's, seeded by `SimConfig.seed`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from kvstore.conductor.base import PolicyContext, SchedulingPolicy
from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.decision import Reject
from kvstore.conductor.profile import DATACENTER, CostProfile
from kvstore.conductor.registry import make_scheduling_policy
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.sim.cluster import SimCluster
from kvstore.conductor.sim.outcome import RequestOutcome, SimSummary, summarize
from kvstore.conductor.slo import SLO
from kvstore.conductor.view import IncomingSeq


class TraceRequest(NamedTuple):
    """A trace line: arrival (ms from the trace start), lengths, one hash id per block."""

    timestamp_ms: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment and replay.

    Attributes:
        num_prefill, num_decode: instances of each role.
        speedup: arrivals come this many times faster than the trace's timestamps.
        slo: the objectives requests are judged on (and admitted against).
        profile: the cost model's coefficients; also sizes caches and KV capacity.
        seed: seeds the policy's random choices.
        sample_s: how often, in simulated seconds, instance load is sampled.
        decode_admission: what a decode instance does with a request whose KV arrives
            when it cannot decode it at once within the TBT objective: ``"refuse"`` it,
            throwing its prefill away (Mooncake's decode instances), or ``"queue"`` it
            until its KV fits (an engine's waiting queue).
    """

    num_prefill: int = 8
    num_decode: int = 8
    speedup: float = 1.0
    slo: SLO = field(default_factory=SLO)
    profile: CostProfile = DATACENTER
    seed: int = 0
    sample_s: float = 1.0
    decode_admission: str = "refuse"

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("at least one prefill and one decode instance")
        if self.decode_admission not in DECODE_ADMISSIONS:
            raise ValueError(
                f"decode_admission {self.decode_admission!r} not one of {DECODE_ADMISSIONS}"
            )
        if not self.speedup > 0 or not self.sample_s > 0:
            raise ValueError(f"speedup and sample_s must be > 0: {self.speedup}, {self.sample_s}")


DECODE_ADMISSIONS = ("refuse", "queue")


class _Kind(IntEnum):
    # Order breaks ties at equal times: work that frees capacity runs before arrivals see it.
    DECODE_END = 0
    PREFILL_END = 1
    DECODE_ARRIVE = 2
    ARRIVAL = 3
    SAMPLE = 4


class LoadSample(NamedTuple):
    """Every instance's load at one time (1.0: at its limit).

    A prefill instance's load is its queued work over the TTFT objective; a decode
    instance's the larger of its KV use over its capacity and its step time over the TBT
    objective (`SimDecode.load`).
    """

    time_s: float
    prefill: tuple[float, ...]
    decode: tuple[float, ...]

    @property
    def mean_decode(self) -> float:
        """The decode instances' mean load."""
        return sum(self.decode) / len(self.decode)

    @property
    def mean_prefill(self) -> float:
        """The prefill instances' mean load."""
        return sum(self.prefill) / len(self.prefill)


class SimResult(NamedTuple):
    """The per-request outcomes, the load series, the summary of one run, and what the
    policy counted (`SchedulingPolicy.counts`)."""

    outcomes: list[RequestOutcome]
    load: list[LoadSample]
    summary: SimSummary
    counts: Mapping[str, int]


class Simulator:
    """Replays `requests` through `policy` on the deployment `config` describes."""

    def __init__(
        self, config: SimConfig, policy: SchedulingPolicy, requests: Sequence[TraceRequest]
    ) -> None:
        self.config = config
        self.policy = policy
        self.cost = CostModel(config.profile)
        pool_blocks = config.profile.pool_capacity_blocks * config.num_prefill
        refuse = config.slo.tbt_s if config.decode_admission == "refuse" else None
        self.cluster = SimCluster(
            self.cost, config.num_prefill, config.num_decode, pool_blocks, refuse
        )
        t0 = requests[0].timestamp_ms if requests else 0.0
        self.requests = [
            (
                SchedRequest(
                    i, (r.timestamp_ms - t0) / 1000 / config.speedup, r.input_len, r.hash_ids
                ),
                r.output_len,
            )
            for i, r in enumerate(requests)
        ]
        self._events: list[tuple[float, int, int, int, int]] = []  # (t, kind, seq, a, b)
        self._seq = 0
        self._outcomes: dict[int, RequestOutcome] = {}
        self._prefill_end_s: dict[int, float] = {}
        self._decode_version = [0] * config.num_decode
        self._load: list[LoadSample] = []
        self._handlers: dict[_Kind, Callable[[float, int, int], None]] = {
            _Kind.ARRIVAL: self._on_arrival,
            _Kind.PREFILL_END: self._on_prefill_end,
            _Kind.DECODE_ARRIVE: self._on_decode_arrive,
            _Kind.DECODE_END: self._on_decode_end,
            _Kind.SAMPLE: self._on_sample,
        }

    def _push(self, t: float, kind: _Kind, a: int = 0, b: int = 0) -> None:
        heapq.heappush(self._events, (t, int(kind), self._seq, a, b))
        self._seq += 1

    def run(self, advance: Callable[[int], None] = lambda n: None) -> SimResult:
        """Runs to the last event; `advance(1)` as each request is decided."""
        for i, (req, _) in enumerate(self.requests):
            self._push(req.arrival_s, _Kind.ARRIVAL, i)
        self._push(0.0, _Kind.SAMPLE)
        self._advance = advance
        while self._events:
            t, kind, _, a, b = heapq.heappop(self._events)
            self.cluster.set_time(t)
            self._handlers[_Kind(kind)](t, a, b)
        outcomes = [self._outcomes[i] for i in range(len(self.requests))]
        window = self.requests[-1][0].arrival_s if self.requests else 0.0
        decode = [sample.mean_decode for sample in self._load]
        prefill = [sample.mean_prefill for sample in self._load]
        gpus = self.config.profile.gpus_per_instance
        summary = summarize(outcomes, self.config.slo, window, decode, gpus, prefill)
        return SimResult(outcomes, self._load, summary, dict(self.policy.counts()))

    def _on_arrival(self, t: float, i: int, _: int) -> None:
        req, _output = self.requests[i]
        decision = self.policy.decide(req, self.cluster)
        self._advance(1)
        if isinstance(decision, Reject):
            self._outcomes[i] = RequestOutcome(i, decision.reason)
            return
        prefill = self.cluster.prefills[decision.prefill]
        ahead = prefill.queued_s()
        job = prefill.enqueue(req, decision.decode)
        handoff_s = self.cost.handoff_s(req.input_len, job.predicted.compute_s)
        reach = t + ahead + job.predicted_s + handoff_s
        self.cluster.decodes[decision.decode].incoming_seqs[i] = IncomingSeq(reach, req.input_len)
        for rep in self.policy.replications(self.cluster):
            self.cluster.prefills[rep.target].cache.insert(
                rep.hash_ids[: self.cluster.pool.prefix(rep.hash_ids)]
            )
        if prefill.running is None:
            self._start(decision.prefill, t)

    def _start(self, p: int, t: float) -> None:
        job = self.cluster.prefills[p].start_next(t)
        if job is not None:
            assert job.plan is not None
            self._push(t + job.plan.seconds, _Kind.PREFILL_END, p)

    def _on_prefill_end(self, t: float, p: int, _: int) -> None:
        job = self.cluster.prefills[p].finish()
        req = job.request
        assert job.plan is not None
        i = req.request_id
        self._prefill_end_s[i] = t
        self._outcomes[i] = RequestOutcome(
            i,
            None,
            t - req.arrival_s,
            0.0,
            req.input_len - job.plan.cached_len,
            job.plan.seconds,
        )
        output = self.requests[i][1]
        if output > 1:
            handoff_s = self.cost.handoff_s(req.input_len, job.plan.compute_s)
            self._push(t + handoff_s, _Kind.DECODE_ARRIVE, i, job.decode)
        else:
            self.cluster.decodes[job.decode].incoming_seqs.pop(i, None)
            self.policy.observe_output(output, req.input_len)
        self._start(p, t)

    def _on_decode_arrive(self, t: float, i: int, d: int) -> None:
        req, output = self.requests[i]
        decode = self.cluster.decodes[d]
        refusal = decode.refusal(req.input_len)
        if refusal is not None:
            decode.incoming_seqs.pop(i, None)
            self._outcomes[i] = self._outcomes[i]._replace(rejected=refusal, late=True)
            return
        decode.admit(i, req.input_len, output - 1, t)
        self._reschedule(d)

    def _reschedule(self, d: int) -> None:
        self._decode_version[d] += 1
        end = self.cluster.decodes[d].next_end_s()
        if end is not None:
            self._push(end, _Kind.DECODE_END, d, self._decode_version[d])

    def _on_decode_end(self, t: float, d: int, version: int) -> None:
        if version != self._decode_version[d]:
            return  # membership changed since this end was predicted
        for i in self.cluster.decodes[d].pop_finished(t):
            output = self.requests[i][1]
            tbt = (t - self._prefill_end_s[i]) / (output - 1)
            self._outcomes[i] = self._outcomes[i]._replace(tbt_s=tbt)
            self.policy.observe_output(output, self.requests[i][0].input_len)
        self._reschedule(d)

    def _on_sample(self, t: float, _a: int, _b: int) -> None:
        slo = self.config.slo
        prefill = tuple(p.queued_s() / slo.ttft_s for p in self.cluster.prefills)
        decode = tuple(d.load(slo.tbt_s) for d in self.cluster.decodes)
        self._load.append(LoadSample(t, prefill, decode))
        if self.requests and t + self.config.sample_s <= self.requests[-1][0].arrival_s:
            self._push(t + self.config.sample_s, _Kind.SAMPLE)


def simulate(
    policy: str,
    requests: Sequence[TraceRequest],
    config: SimConfig,
    advance: Callable[[int], None] = lambda n: None,
) -> SimResult:
    """Replays `requests` through the registered `policy` on `config`'s deployment."""
    ctx = PolicyContext(CostModel(config.profile), config.slo, config.seed)
    return Simulator(config, make_scheduling_policy(policy, ctx), requests).run(advance)
