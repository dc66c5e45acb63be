"""A simulated prefill instance: a FIFO queue served one prompt at a time, and its cache."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.conductor.cost_model import CostModel, PrefillPlan, plan_prefill
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.sim.block_cache import LRUBlockCache
from kvstore.conductor.view import PrefillView


@dataclass
class PrefillJob:
    """A request queued on a prefill instance, with the work predicted when it was queued."""

    request: SchedRequest
    decode: int
    predicted: PrefillPlan  # with the cache the queue ahead leaves (`queued_prefix`)
    plan: PrefillPlan | None = None  # the plan it ran with, once started
    start_s: float = 0.0

    @property
    def predicted_s(self) -> float:
        """Predicted seconds the job keeps the instance busy."""
        return self.predicted.seconds

    @property
    def uncached_len(self) -> int:
        """Prompt tokens it is predicted to compute."""
        return self.request.input_len - self.predicted.cached_len


class SimPrefill(PrefillView):
    """One prefill instance; the simulator starts and finishes its jobs."""

    def __init__(self, cost: CostModel, cache_blocks: int, pool: LRUBlockCache) -> None:
        self.cost = cost
        self.cache = LRUBlockCache(cache_blocks)
        self.pool = pool
        self.queue: deque[PrefillJob] = deque()
        self.running: PrefillJob | None = None
        self.busy_until_s = 0.0
        self._queued_s = 0.0  # predicted work in `queue`, excluding the running job
        self._queued_tokens = 0
        self._queued_blocks: Counter[int] = Counter()  # blocks of the queued and running prompts
        self.now_s = 0.0

    def plan(self, request: SchedRequest, local: int | None = None) -> PrefillPlan:
        """The plan `request` would run with if it started now, or with `local` blocks of
        its prefix cached here."""
        if local is None:
            local = self.cache.prefix(request.hash_ids)
        pooled = self.pool.prefix(request.hash_ids, local)
        return plan_prefill(self.cost, request.input_len, local, pooled)

    def enqueue(self, request: SchedRequest, decode: int) -> PrefillJob:
        """Queues `request`; its predicted work is its plan with the cache the jobs ahead of
        it leave (`queued_prefix`)."""
        predicted = self.plan(request, self.queued_prefix(request.hash_ids))
        job = PrefillJob(request, decode, predicted)
        self.queue.append(job)
        self._queued_s += job.predicted_s
        self._queued_tokens += job.uncached_len
        self._queued_blocks.update(request.hash_ids)
        return job

    def start_next(self, now_s: float) -> PrefillJob | None:
        """Starts the next queued job (its real plan, with the cache as it is now)."""
        assert self.running is None, "one prefill at a time"
        if not self.queue:
            return None
        job = self.queue.popleft()
        self._queued_s -= job.predicted_s
        job.plan = self.plan(job.request)
        job.start_s = now_s
        self.running = job
        self.busy_until_s = now_s + job.plan.seconds
        return job

    def finish(self) -> PrefillJob:
        """Ends the running job: its blocks are now cached here and published to the pool."""
        job = self.running
        assert job is not None, "no prefill running"
        self.running = None
        self._queued_tokens -= job.uncached_len
        for h in job.request.hash_ids:
            self._queued_blocks[h] -= 1
            if not self._queued_blocks[h]:
                del self._queued_blocks[h]  # `in` must miss a block no job holds
        self.cache.insert(job.request.hash_ids)
        self.pool.insert(job.request.hash_ids)
        return job

    def queued_s(self) -> float:
        ahead = max(0.0, self.busy_until_s - self.now_s) if self.running else 0.0
        return ahead + max(0.0, self._queued_s)

    def num_queued(self) -> int:
        return len(self.queue) + (self.running is not None)

    def queued_tokens(self) -> int:
        return self._queued_tokens

    def cached_prefix(self, hash_ids: Sequence[int]) -> int:
        return self.cache.prefix(hash_ids)

    def queued_prefix(self, hash_ids: Sequence[int]) -> int:
        k = 0
        while k < len(hash_ids) and (
            hash_ids[k] in self.cache or hash_ids[k] in self._queued_blocks
        ):
            k += 1
        return k

    @property
    def cache_capacity_blocks(self) -> int:
        return self.cache.capacity_blocks
