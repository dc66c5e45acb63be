"""The request shapes of the `prefix` suite, after the common public benchmarks.

Each workload drives a list of engines (`EngineClient` or alike) and returns the requests it
measured. Requests are sent one at a time, so TTFT is prefill (or load) time, never queueing,
except in multi-round-qa, whose users are concurrent: there loads overlap other users'
decoding, which is what its TPOT row measures.

- system-prompt: one long system prompt shared by many users, users spread round-robin over
  two engines (a data-parallel deployment with no session affinity).
- multi-round-qa: users x rounds with a growing history (LMCache multi-round-qa, SGLang
  bench_multiturn); round r of user u goes to engine (u + r) % 2, as a load balancer would.
  A round's users ask at once (`Together`); the next round starts when all have answers.
- long-doc-qa: documents of 8k+ tokens; engine A reads each once (the warm phase, only where
  a store can carry it over), then engine B, which never saw them, is asked about each
  (measured), then asked again (the floor's suffix prefill: all but the question cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, Protocol

import numpy as np

from gpu_engine.engine_client import GenerateResult
from gpu_engine.runner import EngineLoad
from gpu_engine.sampling import SamplingParams

VOCAB = 32000  # the `bench` preset's
Advance = Callable[[int], None]
# Sends (engine index, prompt) requests at once; their results, in order.
Together = Callable[[Sequence[tuple[int, list[int]]], SamplingParams], list["GenerateResult"]]


class WorkloadEngine(Protocol):
    """What a workload needs of an engine: `EngineClient`'s generate and load."""

    def generate(self, prompt: list[int], params: SamplingParams) -> GenerateResult: ...

    def load(self) -> EngineLoad: ...


class WorkloadRun(NamedTuple):
    measured: list[GenerateResult]  # the rows' requests, in a fixed order
    repeat: list[GenerateResult]  # long-doc-qa: same documents, all but the question cached


@dataclass(frozen=True)
class Shape:
    """Sizes of one workload; `--quick` shrinks them, never the shape."""

    num_users: int
    num_rounds: int
    context_len: int  # system prompt / per-user history / document tokens
    question_len: int
    max_tokens: int


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


class Workload:
    """How a workload sends its requests."""

    name: str = ""
    num_engines: int = 2
    full: Shape
    quick: Shape

    def num_requests(self, shape: Shape, warm: bool) -> int:
        return shape.num_users * shape.num_rounds

    def drive(
        self,
        engines: Sequence[WorkloadEngine],
        shape: Shape,
        warm: bool,
        advance: Advance,
        together: Together,
    ) -> WorkloadRun:
        raise NotImplementedError


class SystemPrompt(Workload):
    name = "system-prompt"
    full = Shape(num_users=8, num_rounds=1, context_len=2048, question_len=64, max_tokens=16)
    quick = Shape(num_users=4, num_rounds=1, context_len=1024, question_len=32, max_tokens=8)

    def drive(
        self,
        engines: Sequence[WorkloadEngine],
        shape: Shape,
        warm: bool,
        advance: Advance,
        together: Together,
    ) -> WorkloadRun:
        rng = np.random.default_rng(1)
        system = _tokens(rng, shape.context_len)
        params = SamplingParams(max_tokens=shape.max_tokens)
        measured = []
        for user in range(shape.num_users):
            prompt = system + _tokens(rng, shape.question_len)
            measured.append(engines[user % len(engines)].generate(prompt, params))
            advance(1)
        return WorkloadRun(measured, [])


class MultiRoundQA(Workload):
    name = "multi-round-qa"
    full = Shape(num_users=4, num_rounds=4, context_len=1024, question_len=64, max_tokens=32)
    quick = Shape(num_users=3, num_rounds=3, context_len=512, question_len=32, max_tokens=16)

    def drive(
        self,
        engines: Sequence[WorkloadEngine],
        shape: Shape,
        warm: bool,
        advance: Advance,
        together: Together,
    ) -> WorkloadRun:
        rng = np.random.default_rng(2)
        histories = [_tokens(rng, shape.context_len) for _ in range(shape.num_users)]
        params = SamplingParams(max_tokens=shape.max_tokens)
        measured = []
        for rnd in range(shape.num_rounds):
            for user in range(shape.num_users):
                histories[user] += _tokens(rng, shape.question_len)
            requests = [((u + rnd) % len(engines), histories[u]) for u in range(shape.num_users)]
            outs = together(requests, params)
            for user, out in enumerate(outs):
                histories[user] += out.output_token_ids  # the answer joins the history
            measured += outs
            advance(len(outs))
        return WorkloadRun(measured, [])


class LongDocQA(Workload):
    name = "long-doc-qa"
    full = Shape(num_users=3, num_rounds=1, context_len=8192, question_len=64, max_tokens=16)
    quick = Shape(num_users=2, num_rounds=1, context_len=2048, question_len=32, max_tokens=8)

    def num_requests(self, shape: Shape, warm: bool) -> int:
        return shape.num_users * (3 if warm else 1)

    def drive(
        self,
        engines: Sequence[WorkloadEngine],
        shape: Shape,
        warm: bool,
        advance: Advance,
        together: Together,
    ) -> WorkloadRun:
        rng = np.random.default_rng(3)
        docs = [_tokens(rng, shape.context_len) for _ in range(shape.num_users)]
        params = SamplingParams(max_tokens=shape.max_tokens)
        reader, fresh = engines

        def ask(engine: WorkloadEngine, phase: int) -> list[GenerateResult]:
            questions = np.random.default_rng([3, phase])  # the same in every mode
            outs = []
            for doc in docs:
                outs.append(engine.generate(doc + _tokens(questions, shape.question_len), params))
                advance(1)
            return outs

        if warm:
            ask(reader, 0)
            _wait_published(reader)
        measured = ask(fresh, 1)
        repeat = ask(fresh, 2) if warm else []
        return WorkloadRun(measured, repeat)


def _wait_published(engine: WorkloadEngine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (load := engine.load()).num_pending_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert load.num_pending_blocks == 0, "publishing did not finish"
    assert load.num_dropped_blocks == 0, "publishes dropped: raise --publish-buffers"


WORKLOADS: MappingProxyType[str, Workload] = MappingProxyType(
    {w.name: w for w in (SystemPrompt(), MultiRoundQA(), LongDocQA())}
)
