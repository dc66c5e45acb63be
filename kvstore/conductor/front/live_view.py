"""The live cluster view: `ClusterView` over the engines a conductor drives, built from the
conductor's own bookkeeping, so the same policy objects decide live as in the simulator.

- Prefill (`LivePrefill`): the requests the conductor has sent to the engine and not yet
  seen finish, each with its work as the profile predicts it. The engine is taken to serve
  them first-in first-out (the cost model's view): the work ahead of a new request is that
  of every request still there, less the time the engine has spent since its last first
  token on the oldest, all scaled by the measured prefill factor (`speed`). A request that
  finishes takes its own work out of the queue, however long it took, so errors of the
  prediction never pile up. Its local prefix cache is approximated by the full-block ids
  the conductor sent it, an LRU set bounded by the engine's cache capacity (as sgl-router's
  approximate radix tree).
- Decode (`LiveDecode`): requests streaming from the engine (running: context = prompt +
  tokens generated so far, counted from the stream), those handed over but not yet
  streaming again (waiting: loading their KV or waiting for pages, holding none), and those
  routed there still in prefill (incoming, with the predicted time their KV reaches it).
- The pool: `pool_prefix` answers from the store's match of the request being decided
  (`set_pool_match`, one Match call per request, before `decide`); chains that were not
  matched in this snapshot count as absent.
- The cost model: the profile scaled by the engines' measured speed (`speed.SpeedRatio`,
  prefill from busy time per first token, decode from the gaps between streamed tokens),
  set at each `snapshot`. The view's `cost` is the model policies were built with, so they
  predict with the measured speed too.
- What the TTFT predictions leave out (`latency.FixedLatency`): the median lateness of
  recent first tokens (`observe_first_token`), added to every TTFT prediction
  (`ttft_latency_s`).
- The handoff (`handoff_s`): from a request's first token to the decode engine's first
  message, the whole transfer of its KV at the speed measured over recent handoffs
  (`observe_handoff`).

Block ids: the engine namespace's block keys (`kvstore.keys.block_keys`, the keys engines
publish under) as 64-bit ints, one per full block, plus one id for a trailing partial block
(`hash_ids` covers the whole prompt, as a trace's does); the partial block is never cached
or pooled, as engines keep only full blocks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.decode_load import current_load
from kvstore.conductor.front.latency import FixedLatency
from kvstore.conductor.front.speed import MAX_AGE_S, WINDOW, SpeedRatio
from kvstore.conductor.profile import CostProfile
from kvstore.conductor.sim.block_cache import LRUBlockCache
from kvstore.conductor.view import ClusterView, DecodeView, IncomingSeq, PrefillView, RunningSeq
from kvstore.keys import Namespace, block_keys, tokens_to_bytes


def block_id(key: bytes) -> int:
    """A block key as the int policies see (its first 8 bytes, big-endian)."""
    return int.from_bytes(key[:8], "big")


class PromptBlocks(NamedTuple):
    """A prompt's block keys (full blocks) and the policy's ids (full blocks + partial)."""

    keys: list[bytes]
    hash_ids: tuple[int, ...]

    @property
    def num_full(self) -> int:
        return len(self.keys)


def prompt_blocks(namespace: Namespace, prompt: Sequence[int]) -> PromptBlocks:
    """The keys engines of `namespace` publish `prompt` under, and the ids of its blocks."""
    keys = block_keys(namespace, prompt)
    ids = [block_id(k) for k in keys]
    rest = prompt[len(keys) * namespace.block_tokens :]
    if rest:  # the partial block: chained like a full one, never stored
        parent = keys[-1] if keys else namespace.id
        digest = hashlib.blake2b(parent + tokens_to_bytes(list(rest)), digest_size=32).digest()
        ids.append(block_id(digest))
    return PromptBlocks(keys, tuple(ids))


class _Job(NamedTuple):
    work_s: float  # predicted at the profile's speed
    uncached_len: int


class LivePrefill(PrefillView):
    """One prefill engine as the conductor has loaded it.

    `speed`: the measured prefill factor (each first token here is an observation of it);
    a `LiveCluster` shares one among its prefill engines.
    """

    def __init__(self, cache_blocks: int) -> None:
        self.cache = LRUBlockCache(cache_blocks)
        self.speed = SpeedRatio()
        self._jobs: OrderedDict[int, _Job] = OrderedDict()
        self._busy_since_s = 0.0  # the last first token, or the start of the busy period
        self.now_s = 0.0

    def enqueue(
        self, request_id: int, work_s: float, uncached_len: int, full_ids: Sequence[int]
    ) -> None:
        """The conductor sent `request_id` here, with `work_s` of work at the profile's
        speed: it joins the queue, and its full blocks the approximate cache (the engine
        will hold them once it ran it)."""
        if not self._jobs:
            self._busy_since_s = self.now_s
        self._jobs[request_id] = _Job(work_s, uncached_len)
        self.cache.insert(full_ids)

    def finish(self, request_id: int, served: bool = False) -> None:
        """`request_id` left the queue: `served` when its first token came out (the time
        since the engine's last first token is then its measured work), else it failed or
        was cancelled. Idempotent."""
        job = self._jobs.pop(request_id, None)
        if job is None:
            return
        if served:
            self.speed.observe(self.now_s, self.now_s - self._busy_since_s, job.work_s)
        self._busy_since_s = self.now_s

    def queued_s(self) -> float:
        if not self._jobs:
            return 0.0
        oldest, *rest = (job.work_s for job in self._jobs.values())
        factor = self.speed.factor(self.now_s)
        started = max(0.0, factor * oldest - (self.now_s - self._busy_since_s))
        return started + factor * sum(rest)

    def num_queued(self) -> int:
        return len(self._jobs)

    def queued_tokens(self) -> int:
        return sum(job.uncached_len for job in self._jobs.values())

    def cached_prefix(self, hash_ids: Sequence[int]) -> int:
        return self.cache.prefix(hash_ids)

    @property
    def cache_capacity_blocks(self) -> int:
        return self.cache.capacity_blocks


class _Seq(NamedTuple):
    input_len: int
    generated: int
    is_waiting: bool


class LiveDecode(DecodeView):
    """One decode engine (or a "both" engine's decode side) as the conductor has loaded it."""

    def __init__(self, capacity_tokens: int) -> None:
        self._capacity = capacity_tokens
        self._incoming: dict[int, IncomingSeq] = {}
        self._running: dict[int, _Seq] = {}

    def expect(self, request_id: int, reach_s: float, input_len: int) -> None:
        """`request_id` was routed here; its KV is predicted to arrive at `reach_s`."""
        self._incoming[request_id] = IncomingSeq(reach_s, input_len)

    def start(
        self, request_id: int, input_len: int, generated: int, is_waiting: bool = False
    ) -> None:
        """`request_id` is on the engine now, `generated` tokens out; `is_waiting` until the
        engine streams it again (it loads its KV and waits for pages first)."""
        self._incoming.pop(request_id, None)
        self._running[request_id] = _Seq(input_len, generated, is_waiting)

    def advance(self, request_id: int, num_tokens: int) -> None:
        """The engine streamed `num_tokens` more of `request_id` (0: only that it runs)."""
        seq = self._running[request_id]
        self._running[request_id] = _Seq(seq.input_len, seq.generated + num_tokens, False)

    def finish(self, request_id: int) -> None:
        """`request_id` is gone from here (finished, failed, or never came)."""
        self._incoming.pop(request_id, None)
        self._running.pop(request_id, None)

    def running(self) -> list[RunningSeq]:
        return [
            RunningSeq(s.input_len + s.generated, s.generated, s.is_waiting)
            for s in self._running.values()
        ]

    def incoming(self) -> list[IncomingSeq]:
        return list(self._incoming.values())

    def context_tokens(self) -> int:
        """KV the engine holds: a waiting sequence holds none yet."""
        return sum(s.input_len + s.generated for s in self._running.values() if not s.is_waiting)

    @property
    def kv_capacity_tokens(self) -> int:
        return self._capacity


class LiveCluster(ClusterView):
    """The conductor's engines at `now_s`; `snapshot` before each decision.

    `cost`: the model the policy was built with. Its profile, as given, is the base; each
    snapshot replaces it with the base scaled by the engines' measured speed (the prefill
    factor shared by every prefill engine, the decode factor by every decode engine), each
    over the last `speed_window` observations (0: the base stays) of the last
    `speed_max_age_s`.
    """

    def __init__(
        self,
        cost: CostModel,
        prefills: Sequence[LivePrefill],
        decodes: Sequence[LiveDecode],
        speed_window: int = WINDOW,
        speed_max_age_s: float = MAX_AGE_S,
    ) -> None:
        if not prefills or not decodes:
            raise ValueError("a cluster needs a prefill and a decode instance")
        self._cost = cost
        self._base_cost = CostModel(cost.profile)
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self.prefill_speed = SpeedRatio(speed_window, speed_max_age_s)
        self.decode_speed = SpeedRatio(speed_window, speed_max_age_s)
        self.handoff_speed = SpeedRatio(speed_window, speed_max_age_s)
        self.latency = FixedLatency(speed_window, speed_max_age_s)
        self._latency_s = 0.0  # at the last snapshot
        self._speeds = (1.0, 1.0)  # the factors the cost model is scaled by
        for p in self.prefills:
            p.speed = self.prefill_speed
        self._now_s = 0.0
        self._pooled: frozenset[int] = frozenset()

    def snapshot(self, now_s: float) -> None:
        """Moves the view's clock to `now_s` (never backwards), forgets the pool match and
        scales the cost model by the speed measured so far."""
        self._now_s = max(self._now_s, now_s)
        for p in self.prefills:
            p.now_s = self._now_s
        self._pooled = frozenset()
        self._latency_s = self.latency.seconds(self._now_s)
        speeds = self.prefill_speed.factor(self._now_s), self.decode_speed.factor(self._now_s)
        if speeds != self._speeds:  # a new profile only when a factor moved
            self._speeds = speeds
            self._cost.profile = self.base_profile.scaled(*speeds)

    def forget_speed(self) -> None:
        """Drops every speed measurement so far: predictions are the profile's again until
        new ones come (the conductor's warm-up drops the engines' first, cold ones)."""
        window, max_age_s = self.prefill_speed.window, self.prefill_speed.max_age_s
        self.prefill_speed = SpeedRatio(window, max_age_s)
        self.decode_speed = SpeedRatio(window, max_age_s)
        self.handoff_speed = SpeedRatio(window, max_age_s)
        self.latency = FixedLatency(window, max_age_s)
        self._latency_s = 0.0
        for p in self.prefills:
            p.speed = self.prefill_speed

    @property
    def base_profile(self) -> CostProfile:
        """The profile as given, before any scaling."""
        return self._base_cost.profile

    def observe_decode(self, decode: int, now_s: float, gap_s: float, num_tokens: int) -> None:
        """At `now_s`, decode instance `decode` streamed `num_tokens` tokens of a request
        `gap_s` after its previous ones: that many steps of the batch it holds now."""
        load = current_load(self.decodes[decode])
        step_s = self._base_cost.decode_step_s(max(1, load.num_seqs), load.context_tokens)
        self.decode_speed.observe(now_s, gap_s, num_tokens * step_s)

    def observe_first_token(self, now_s: float, ttft_s: float, predicted_s: float) -> None:
        """At `now_s`, a request's first token came `ttft_s` after its arrival, where its
        queue and prefill were predicted (at the measured speed) to take `predicted_s`."""
        self.latency.observe(now_s, ttft_s, predicted_s)

    @property
    def ttft_latency_s(self) -> float:
        """The median lateness of recent first tokens (`latency`), at the last snapshot."""
        return self._latency_s

    def observe_handoff(self, now_s: float, handoff_s: float, input_len: int) -> None:
        """At `now_s`, a decode engine streamed its first message for a request of
        `input_len` prompt tokens, `handoff_s` after the request's first token."""
        self.handoff_speed.observe(now_s, handoff_s, self._base_cost.kv_transfer_s(input_len))

    def handoff_s(self, input_len: int, compute_s: float) -> float:
        """The whole transfer of the prompt's KV at the measured speed: these engines
        publish a prompt's KV once it is computed and the decode engine loads it before its
        first step, so none of it overlaps the prefill (`CostModel.handoff_s` assumes
        layer-wise transfer, which does)."""
        factor = self.handoff_speed.factor(self._now_s)
        return factor * self._base_cost.kv_transfer_s(input_len)

    def set_pool_match(self, hash_ids: Sequence[int], num_matched: int) -> None:
        """The store holds the first `num_matched` of `hash_ids` (this snapshot only)."""
        self._pooled = frozenset(hash_ids[:num_matched])

    @property
    def now_s(self) -> float:
        return self._now_s

    @property
    def prefill(self) -> Sequence[LivePrefill]:
        return self.prefills

    @property
    def decode(self) -> Sequence[LiveDecode]:
        return self.decodes

    @property
    def cost(self) -> CostModel:
        return self._cost

    def pool_prefix(self, hash_ids: Sequence[int], start: int = 0) -> int:
        k = start
        while k < len(hash_ids) and hash_ids[k] in self._pooled:
            k += 1
        return k - start
