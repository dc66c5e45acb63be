"""The conductor: admits each completion through a scheduling policy over the live view,
then runs it on the engines it chose and keeps the view's bookkeeping.

Flow of one request (`admit`, then `run`):

1. Its prompt's block keys are matched in the store (one Match), the view is snapshot at
   the arrival time, and the policy decides with the request's SLO. A `Reject` raises
   `RejectedError` at once: nothing ran anywhere.
2. Accepted, its predicted prefill work joins the chosen prefill engine's queue and its
   blocks that engine's approximate cache; the decode engine expects it at the predicted
   end of prefill plus hand-off.
3. Disaggregated (engines of roles prefill and decode): the prefill engine computes the
   prompt and streams the first token, which goes to the client at once; its stream ends
   ("prefill") once the prompt's full blocks are in the store. The decode engine gets the
   prompt with `num_published_tokens`, loads those blocks and streams every token from the
   first; the first (the same token, since sampling is seeded) is not sent again.
   Co-located (engines of role "both"): the chosen prefill engine serves the whole request
   and is also its decode instance (the policy's decode choice is not used).
4. TTFT (arrival at the conductor to first token out) and TBT (mean gap after the first)
   are measured; the outcome, with the prediction made at admission, goes to every
   listener (metrics, a benchmark). Each first token and each later token's gap is also
   an observation of the engines' speed (`LiveCluster`), which scales the next predictions.

Replications the policy plans (hot blocks of the admitted request's prompt that its prefill
engine lacks) start at admission, in the background: that engine prefetches them from the
store into its prefix cache (`GenerateRequest.prefetch`) while the request waits in its
queue, so the request finds them local instead of loading them on its critical path. Each
ends "done", "failed" or "unsupported" (an OpenAI backend); `replication_listeners` hear
every outcome and how many blocks it loaded. A failed one costs only the copy: the request
loads what it lacks itself.

A request at temperature > 0 without a seed gets one drawn from the conductor's seeded
generator, so that prefill and decode engines sample the same first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.client.async_client import AsyncClient
from kvstore.conductor import ttft
from kvstore.conductor.base import Replication, SchedulingPolicy
from kvstore.conductor.decision import Accept, Reject
from kvstore.conductor.front.completion import (
    CompletionChunk,
    CompletionOutcome,
    CompletionRequest,
    RejectedError,
)
from kvstore.conductor.front.engine_handle import EngineBackend, EngineChunk
from kvstore.conductor.front.live_view import LiveCluster, PromptBlocks, prompt_blocks
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.slo import SLO
from kvstore.errors import InvalidArgumentError, KVStoreError
from kvstore.keys import Namespace

log = logging.getLogger("kvstore.conductor")
PREFILL_DONE = "prefill"  # a prefill engine's finish reason: decode continues
WARMUP_PROMPT_BLOCKS = 8  # a warm-up probe's prompt, in the engines' blocks
WARMUP_OUTPUT_TOKENS = 8  # and its output: a few decode steps
WARMUP_VOCAB = 256  # its tokens are drawn below this: valid in any model's vocabulary


class Roles(NamedTuple):
    """Which engines (indexes into the conductor's list) back the view's instances."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]
    is_colocated: bool  # every engine is "both": prefill instance i is decode instance i

    @classmethod
    def of(cls, roles: Sequence[str]) -> Roles:
        """From each engine's Load role; InvalidArgumentError for a mix the flow cannot run
        (both with split roles, or prefill without decode)."""
        if roles and all(r == "both" for r in roles):
            every = tuple(range(len(roles)))
            return cls(every, every, True)
        prefill = tuple(i for i, r in enumerate(roles) if r == "prefill")
        decode = tuple(i for i, r in enumerate(roles) if r == "decode")
        if not prefill or not decode or len(prefill) + len(decode) != len(roles):
            raise InvalidArgumentError(
                f"engines must all be 'both', or 'prefill' and 'decode' (>= 1 each): {roles}"
            )
        return cls(prefill, decode, False)


@dataclass
class Ticket:
    """An admitted request, until `Conductor.run` ends it; `outcome` is set then."""

    request_id: int
    request: CompletionRequest
    blocks: PromptBlocks
    accept: Accept
    arrival_s: float
    predicted_ttft_s: float
    predicted_work_s: float  # of that, the queue ahead and the prefill (no latency)
    tokens: list[int] = field(default_factory=list)
    first_token_s: float = float("nan")
    last_token_s: float = float("nan")
    cached_tokens: int = 0
    num_published_tokens: int = 0  # the prefill engine's count, handed to decode
    finish_reason: str = ""
    outcome: CompletionOutcome | None = None
    is_probe: bool = False  # a warm-up request (`Conductor.warm_up`): not an outcome

    @property
    def input_len(self) -> int:
        return len(self.request.prompt_token_ids)


class Conductor:
    """Routes, admits and runs completions over engine processes.

    Args:
        engines: one handle per engine process.
        roles: which engines are prefill and decode instances (`Roles.of`).
        cluster: the live view over them, instances in `roles` order.
        policy: decides every request; the same object the simulator drives.
        namespace: the engines' KV namespace (block keys are computed in it).
        store: the store the engines publish to (pool prefix matches: a node of a global
            pool answers for the whole pool); None: no pool.
        clock: seconds, monotonic; the view's clock is it minus its value at construction.
        seed: seeds the seeds drawn for unseeded sampling.
    """

    def __init__(
        self,
        engines: Sequence[EngineBackend],
        roles: Roles,
        cluster: LiveCluster,
        policy: SchedulingPolicy,
        namespace: Namespace,
        store: AsyncClient | None,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
    ) -> None:
        self.engines = list(engines)
        self.roles = roles
        self.cluster = cluster
        self.policy = policy
        self.namespace = namespace
        self.store = store
        self.listeners: list[Callable[[CompletionOutcome], None]] = []
        # (outcome: started, done, failed or unsupported; blocks loaded) of each replication
        self.replication_listeners: list[Callable[[str, int], None]] = []
        self._replicating: set[asyncio.Task[None]] = set()
        self._clock = clock
        self._t0 = clock()
        self._ids = itertools.count()
        self._rng = random.Random(seed)

    def now_s(self) -> float:
        """The conductor's clock, seconds since it started."""
        return self._clock() - self._t0

    async def admit(self, request: CompletionRequest) -> Ticket:
        """Decides `request` now; raises `RejectedError` with the policy's reason when it is
        refused, else returns its ticket, which the caller must `run` (or `release`)."""
        request_id, arrival_s = next(self._ids), self.now_s()
        blocks = prompt_blocks(self.namespace, request.prompt_token_ids)
        num_pooled = await self._pool_match(blocks)
        self.cluster.snapshot(self.now_s())
        self.cluster.set_pool_match(blocks.hash_ids, num_pooled)
        sched = SchedRequest(
            request_id,
            arrival_s,
            len(request.prompt_token_ids),
            blocks.hash_ids,
            max_output=request.max_tokens,
        )
        with _policy_slo(self.policy, request.slo):
            decision = self.policy.decide(sched, self.cluster)
        replications = self.policy.replications(self.cluster)
        if isinstance(decision, Reject):
            self._emit(CompletionOutcome(request_id, decision, sched.input_len, arrival_s))
            raise RejectedError(decision)
        if request.temperature > 0 and request.seed is None:
            request = request._replace(seed=self._rng.getrandbits(63))
        ticket = self._book(sched, request, blocks, decision)
        for replication in replications:
            self._replicate(replication, request, blocks)
        return ticket

    async def warm_up(self, rounds: int) -> None:
        """Times the engines before the first admission, so that the first predictions are
        made at their measured speed: a fresh conductor would otherwise predict with the
        profile, which on a loaded host can be many times too fast, admit everything in its
        first second and miss the SLO of all of it.

        Each round runs one probe per prefill engine (sent on to the decode engines in
        turn), one after another, as any admitted request runs; the first round's
        measurements are dropped (an engine's first forward passes pay its warm-up). A
        probe's prompt is `WARMUP_PROMPT_BLOCKS` blocks of fresh random tokens, so no cache
        holds it. Probes are not outcomes: no listener hears them and the policy learns
        nothing from them. A failed probe is logged and costs only its measurement.
        """
        rng = random.Random()  # fresh tokens on every start: an engine's cache never has them
        block_tokens = self.namespace.layout.block_tokens
        for round_ in range(rounds):
            if round_ == 1:
                self.cluster.forget_speed()
            for k in range(max(len(self.roles.prefill), len(self.roles.decode))):
                accept = Accept(k % len(self.roles.prefill), k % len(self.roles.decode))
                prompt = tuple(
                    rng.randrange(WARMUP_VOCAB) for _ in range(WARMUP_PROMPT_BLOCKS * block_tokens)
                )
                await self._probe(prompt, accept)

    async def _probe(self, prompt: tuple[int, ...], accept: Accept) -> None:
        request = CompletionRequest(prompt, WARMUP_OUTPUT_TOKENS, 0.0, None, SLO())
        request_id, blocks = next(self._ids), prompt_blocks(self.namespace, prompt)
        self.cluster.snapshot(self.now_s())
        sched = SchedRequest(request_id, self.now_s(), len(prompt), blocks.hash_ids)
        ticket = self._book(sched, request, blocks, accept)
        ticket.is_probe = True
        try:
            async with contextlib.aclosing(self.run(ticket)) as stream:
                async for _ in stream:
                    pass
        except KVStoreError as exc:
            log.warning("event=warmup_failed engine_pair=%s error=%s", accept[:2], exc)

    def _replicate(
        self, replication: Replication, request: CompletionRequest, blocks: PromptBlocks
    ) -> None:
        """Starts the prefetch of a planned copy: the blocks are a prefix of this request's
        prompt (what the policy plans from), sent with the token after them, since an
        engine computes a prompt's last token and caches only the blocks before it."""
        num = len(replication.hash_ids)
        if num > blocks.num_full or blocks.hash_ids[:num] != replication.hash_ids:
            return  # not this prompt's full blocks: nothing here names their tokens
        tokens = request.prompt_token_ids[: num * self.namespace.layout.block_tokens + 1]
        engine = self.engines[self.roles.prefill[replication.target]]
        task = asyncio.get_running_loop().create_task(self._prefetch(engine, tokens))
        self._replicating.add(task)
        task.add_done_callback(self._replicating.discard)
        self._replicated("started", 0)

    async def _prefetch(self, engine: EngineBackend, tokens: Sequence[int]) -> None:
        try:
            loaded = await engine.prefetch(tokens)
        except KVStoreError as exc:
            log.warning("event=replication_failed engine=%s error=%s", engine.address, exc)
            self._replicated("failed", 0)
            return
        if loaded is None:
            self._replicated("unsupported", 0)
        else:
            self._replicated("done", loaded // self.namespace.layout.block_tokens)

    def _replicated(self, outcome: str, num_blocks: int) -> None:
        for listener in self.replication_listeners:
            listener(outcome, num_blocks)

    async def _pool_match(self, blocks: PromptBlocks) -> int:
        if self.store is None or not blocks.keys:
            return 0
        try:  # Locate: this node's prefix, or the whole pool's where the node is in one
            return (await self.store.locate(self.namespace.id, blocks.keys)).num_located
        except KVStoreError as exc:  # a store away is an empty pool, never a failed request
            log.warning("event=pool_match_failed error=%s", type(exc).__name__)
            return 0

    def _book(
        self, sched: SchedRequest, request: CompletionRequest, blocks: PromptBlocks, a: Accept
    ) -> Ticket:
        """Queues the accepted request in the view: prefill work, cache, decode arrival."""
        pre = self.cluster.prefills[a.prefill]
        plan = ttft.estimate(sched, self.cluster, a.prefill).plan
        ahead_s = pre.queued_s()
        pre.enqueue(
            sched.request_id,
            plan.seconds / pre.speed.factor(self.cluster.now_s),  # at the profile's own speed
            sched.input_len - plan.cached_len,
            blocks.hash_ids[: blocks.num_full],
        )
        decode = a.prefill if self.roles.is_colocated else a.decode
        handoff_s = self.cluster.handoff_s(sched.input_len, plan.compute_s)
        reach_s = sched.arrival_s + ahead_s + plan.seconds + handoff_s
        self.cluster.decodes[decode].expect(sched.request_id, reach_s, sched.input_len)
        accept = a._replace(decode=decode)
        work_s = ahead_s + plan.seconds
        latency_s = self.cluster.ttft_latency_s
        return Ticket(
            sched.request_id, request, blocks, accept, sched.arrival_s, work_s + latency_s, work_s
        )

    async def run(self, ticket: Ticket) -> AsyncGenerator[CompletionChunk, None]:
        """Runs an admitted request, streaming its output tokens, each once; the ticket's
        outcome is set and sent to the listeners when the stream ends, however it ends.

        Raises:
            InvalidArgumentError: an engine refused the request.
            UnavailableError: an engine is unreachable or could not publish the prompt.
        """
        # Closing this stream closes the engine's at once (`aclosing`), not when the
        # collector finds them: a stream ended for a stalled reader frees its engines now.
        try:
            async with contextlib.aclosing(self._prefill(ticket)) as prefill:
                async for chunk in prefill:
                    yield chunk
            if ticket.finish_reason == PREFILL_DONE:
                async with contextlib.aclosing(self._decode(ticket)) as decode:
                    async for chunk in decode:
                        yield chunk
        except KVStoreError as exc:
            ticket.finish_reason = f"error:{type(exc).__name__}"
            raise
        finally:
            self.release(ticket)

    async def _prefill(self, t: Ticket) -> AsyncGenerator[CompletionChunk, None]:
        engine = self.engines[self.roles.prefill[t.accept.prefill]]
        dview = self.cluster.decodes[t.accept.decode]
        final: EngineChunk | None = None
        async with contextlib.aclosing(self._generate(engine, t, 0)) as stream:
            async for msg in stream:
                if msg.token_ids and not t.tokens:  # its compute is over: the first token is out
                    now_s = self.now_s()
                    self.cluster.observe_first_token(now_s, now_s - t.arrival_s, t.predicted_work_s)
                    self._prefill_over(t, served=True)
                    if self.roles.is_colocated:
                        dview.start(t.request_id, t.input_len, 0)
                elif msg.token_ids and self.roles.is_colocated:  # decode steps, after the first
                    now_s = self.now_s()
                    gap_s = now_s - t.last_token_s
                    self.cluster.observe_decode(t.accept.decode, now_s, gap_s, len(msg.token_ids))
                if msg.token_ids and self.roles.is_colocated:
                    dview.advance(t.request_id, len(msg.token_ids))
                if msg.token_ids:
                    yield self._out(t, msg.token_ids)
                final = msg if msg.finish_reason else final
        assert final is not None, "an engine stream ended without a finish reason"
        t.finish_reason, t.cached_tokens = final.finish_reason, final.cached_tokens
        t.num_published_tokens = final.num_published_tokens

    async def _decode(self, t: Ticket) -> AsyncGenerator[CompletionChunk, None]:
        engine = self.engines[self.roles.decode[t.accept.decode]]
        dview = self.cluster.decodes[t.accept.decode]
        dview.start(t.request_id, t.input_len, len(t.tokens), is_waiting=True)
        sent = list(t.tokens)  # what the client has: the decode stream repeats it first
        last_s = None  # the engine's previous message (its first follows the KV's load)
        async with contextlib.aclosing(self._generate(engine, t, t.num_published_tokens)) as s:
            async for msg in s:
                new = list(msg.token_ids)
                while sent and new:
                    if new.pop(0) != sent.pop(0):
                        log.warning("event=handoff_mismatch request=%d", t.request_id)
                if msg.token_ids:  # the engine runs it (the repeated first token included)
                    dview.advance(t.request_id, len(new))
                    now_s = self.now_s()
                    if last_s is None:  # the KV is in: the handoff is over
                        self.cluster.observe_handoff(now_s, now_s - t.first_token_s, t.input_len)
                    elif new:
                        self.cluster.observe_decode(
                            t.accept.decode, now_s, now_s - last_s, len(new)
                        )
                    last_s = now_s
                if new:
                    yield self._out(t, new)
                if msg.finish_reason:
                    t.finish_reason = msg.finish_reason

    def _generate(
        self, engine: EngineBackend, t: Ticket, published: int
    ) -> AsyncGenerator[EngineChunk, None]:
        r = t.request
        return engine.generate(r.prompt_token_ids, r.max_tokens, r.temperature, r.seed, published)

    def _out(self, t: Ticket, token_ids: Sequence[int]) -> CompletionChunk:
        now = self.now_s()
        if not t.tokens:
            t.first_token_s = now
        t.last_token_s = now
        t.tokens.extend(token_ids)
        return CompletionChunk(tuple(token_ids))

    def _prefill_over(self, t: Ticket, served: bool = False) -> None:
        self.cluster.snapshot(self.now_s())
        self.cluster.prefills[t.accept.prefill].finish(t.request_id, served)

    def release(self, t: Ticket) -> None:
        """Ends `t`'s bookkeeping and reports its outcome; idempotent."""
        if t.outcome is not None:
            return
        self._prefill_over(t)
        self.cluster.decodes[t.accept.decode].finish(t.request_id)
        if t.finish_reason in ("", PREFILL_DONE):  # the stream stopped before its end
            t.finish_reason = "cancelled"
        if not t.finish_reason.startswith(("error", "cancelled")) and not t.is_probe:
            ended = t.finish_reason != "length"  # else cut by max_tokens: it ran on
            self.policy.observe_output(len(t.tokens), t.input_len, ended)
        t.outcome = self._outcome(t)
        if not t.is_probe:
            self._emit(t.outcome)

    def _emit(self, outcome: CompletionOutcome) -> None:
        for listener in self.listeners:
            listener(outcome)

    def _outcome(self, t: Ticket) -> CompletionOutcome:
        n = len(t.tokens)
        return CompletionOutcome(
            request_id=t.request_id,
            rejected=None,
            input_len=t.input_len,
            arrival_s=t.arrival_s,
            prefill=self.roles.prefill[t.accept.prefill],
            decode=self.roles.decode[t.accept.decode],
            predicted_ttft_s=t.predicted_ttft_s,
            predicted_tbt_s=t.accept.predicted_tbt_s,
            ttft_s=t.first_token_s - t.arrival_s,
            tbt_s=_tbt(t.first_token_s, t.last_token_s, n),
            end_s=t.last_token_s,
            output_token_ids=tuple(t.tokens),
            finish_reason=t.finish_reason,
            cached_tokens=t.cached_tokens,
            prefilled_tokens=t.input_len - t.cached_tokens if n else 0,
        )


def _tbt(first_s: float, last_s: float, num_tokens: int) -> float:
    """Mean gap after the first token; 0 for one token (as the simulator), NaN for none."""
    if num_tokens <= 1:
        return 0.0 if num_tokens else float("nan")
    return (last_s - first_s) / (num_tokens - 1)


@contextlib.contextmanager
def _policy_slo(policy: SchedulingPolicy, slo: SLO) -> Iterator[None]:
    """The policy decides with the request's SLO: its context's for this call only (the
    contract's SLO is per policy; a request may bring its own)."""
    saved = policy.ctx
    policy.ctx = dataclasses.replace(saved, slo=slo)
    try:
        yield
    finally:
        policy.ctx = saved
