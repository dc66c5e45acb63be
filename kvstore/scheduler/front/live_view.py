"""The live cluster view: `ClusterView` over the engines a conductor drives, built from the
conductor's own bookkeeping, so the same policy objects decide live as in the simulator.

- Prefill (`LivePrefill`): the requests the conductor has sent to the engine and not yet
  seen finish, each with the work predicted when it was routed. The engine is taken to
  serve them first-in first-out (the cost model's view): it is free, by prediction, at
  `free_at_s`; a finish resets that to the real time when nothing is left, so errors of
  the prediction do not pile up. Its local prefix cache is approximated by the full-block
  ids the conductor sent it, an LRU set bounded by the engine's cache capacity (as
  sgl-router's approximate radix tree).
- Decode (`LiveDecode`): requests streaming from the engine (running: context = prompt +
  tokens generated so far, counted from the stream), those handed over but not yet
  streaming again (waiting: loading their KV or waiting for pages, holding none), and those
  routed there still in prefill (incoming, with the predicted time their KV reaches it).
- The pool: `pool_prefix` answers from the store's match of the request being decided
  (`set_pool_match`, one Match call per request, before `decide`); chains that were not
  matched in this snapshot count as absent.

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

from kvstore.keys import Namespace, block_keys, tokens_to_bytes
from kvstore.scheduler.cost_model import CostModel
from kvstore.scheduler.sim.block_cache import LRUBlockCache
from kvstore.scheduler.view import ClusterView, DecodeView, IncomingSeq, PrefillView, RunningSeq


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
    predicted_s: float
    uncached_len: int


class LivePrefill(PrefillView):
    """One prefill engine as the conductor has loaded it."""

    def __init__(self, cache_blocks: int) -> None:
        self.cache = LRUBlockCache(cache_blocks)
        self._jobs: OrderedDict[int, _Job] = OrderedDict()
        self.free_at_s = 0.0
        self.now_s = 0.0

    def enqueue(
        self, request_id: int, predicted_s: float, uncached_len: int, full_ids: Sequence[int]
    ) -> None:
        """The conductor sent `request_id` here: its predicted work joins the queue and its
        full blocks the approximate cache (the engine will hold them once it ran it)."""
        self._jobs[request_id] = _Job(predicted_s, uncached_len)
        self.free_at_s = max(self.now_s, self.free_at_s) + predicted_s
        self.cache.insert(full_ids)

    def finish(self, request_id: int) -> None:
        """The engine finished (or failed) `request_id`."""
        if self._jobs.pop(request_id, None) is not None and not self._jobs:
            self.free_at_s = self.now_s

    def queued_s(self) -> float:
        return max(0.0, self.free_at_s - self.now_s)

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
    """The conductor's engines at `now_s`; `snapshot` before each decision."""

    def __init__(
        self, cost: CostModel, prefills: Sequence[LivePrefill], decodes: Sequence[LiveDecode]
    ) -> None:
        if not prefills or not decodes:
            raise ValueError("a cluster needs a prefill and a decode instance")
        self._cost = cost
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self._now_s = 0.0
        self._pooled: frozenset[int] = frozenset()

    def snapshot(self, now_s: float) -> None:
        """Moves the view's clock to `now_s` (never backwards) and forgets the pool match."""
        self._now_s = max(self._now_s, now_s)
        for p in self.prefills:
            p.now_s = self._now_s
        self._pooled = frozenset()

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
