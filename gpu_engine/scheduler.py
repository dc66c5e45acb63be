"""The scheduler: which requests compute how many tokens in the next step, and what a step's
results do to them (nano-vllm's `Scheduler`: `schedule`, then `postprocess`).

Each step computes, for every running request, its last token while decoding or its next
prompt chunk while prefilling, and admits waiting requests while the prefill token budget,
`max_num_seqs` and the page pool allow. Admission reuses the request's cached blocks, then
asks the store (through `KVTransfer`) for the ones after them: when it holds some, the
request waits in LOADING_REMOTE_KV while they are received and the other requests go on;
`schedule` collects finished loads first thing, the one path from LOADING_REMOTE_KV to
RUNNING. `schedule` runs once per step; a step with nothing to compute waits for a load
(`KVTransfer.wait_for_load`) instead of spinning.

An engine's role (`EngineConfig.role`) changes two decisions, each asked of its
`gpu_engine.role.RolePolicy` in one method here: `_admit` (how many store blocks to load: a
decode engine trusts the count a prefill engine published) and `_finish_reason` (a prefill
engine finishes a request at its first token). A prefill engine's finished request then
holds its pages in PUBLISHING_KV until its prompt blocks are committed in the store;
`schedule` collects those publishes too, and hands the requests they finish back in its
batch (`ScheduledBatch.finished`), since they get no token in that step.

`abort` ends a request whose caller is gone, at the first point where nothing else writes
into its pages. A prefetch (`Request.prefetch`) is admitted like any request and finishes
where it would start computing: once its load is over (its blocks now in the prefix
cache), or at admission when the store holds nothing it lacks.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple

import torch

from gpu_engine.block_manager import BlockManager
from gpu_engine.config import EngineConfig, EngineRole
from gpu_engine.errors import PublishError
from gpu_engine.kv_transfer import KVTransfer, LoadResult, PublishResult
from gpu_engine.request import Request, RequestStatus
from gpu_engine.role import ROLE_POLICIES

logger = logging.getLogger(__name__)


class ScheduledBatch(NamedTuple):
    """One step's work: request i computes its next `num_new_tokens[i]` tokens."""

    requests: list[Request]
    num_new_tokens: list[int]
    sample_rows: list[int]  # the i whose chunk ends their uncomputed tokens: they get a token
    finished: list[Request]  # FINISHED since the last step without a token: publish over


class Scheduler:
    """Owns every request from `add` until it is FINISHED; see the module docstring.

    Args:
        config: batching limits and the engine's role.
        block_manager: pages and cached blocks.
        transfer: the store, through the engine's connector.
    """

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, transfer: KVTransfer
    ) -> None:
        self.role: EngineRole = config.engine_role
        self.policy = ROLE_POLICIES[self.role](config.block_tokens)
        self.max_num_seqs = config.max_num_seqs
        self.max_prefill_tokens = config.max_prefill_tokens
        self.block_manager = block_manager
        self.transfer = transfer
        self._block_tokens = config.block_tokens
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._unfinished: dict[int, Request] = {}  # by id, from `add` until FINISHED

    @property
    def has_unfinished(self) -> bool:
        transfer = self.transfer
        return bool(
            self._waiting or self._running or transfer.num_loading or transfer.num_publishing
        )

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests holding pages: RUNNING, LOADING_REMOTE_KV or PUBLISHING_KV."""
        return len(self._running) + self.transfer.num_loading + self.transfer.num_publishing

    def add(self, req: Request) -> None:
        """Queues a WAITING request behind the others."""
        assert req.status is RequestStatus.WAITING, f"request {req.request_id} is {req.status}"
        self._waiting.append(req)
        self._unfinished[req.request_id] = req

    def abort(self, request_id: int) -> bool:
        """Stops computing a request whose caller is gone (finish reason "abort"). A WAITING
        or RUNNING one is FINISHED at once, its pages released; a LOADING_REMOTE_KV one when
        its load is over (the load writes into its pages until then); a PUBLISHING_KV one
        finishes as it would. False if no unfinished request has that id."""
        req = self._unfinished.get(request_id)
        if req is None or req.finish_reason is not None:
            return req is not None
        req.finish_reason = "abort"
        logger.info("event=abort request_id=%d status=%s", request_id, req.status.name)
        if req.status is RequestStatus.WAITING:
            self._waiting.remove(req)
            self._release(req)
        elif req.status is RequestStatus.RUNNING:
            self._running.remove(req)
            self._release(req)
        return True

    def schedule(self) -> ScheduledBatch:
        """This step's batch: finished loads join the running requests, which go first, then
        admissions while the budget lasts; finished publishes finish their requests. May
        preempt the youngest running requests."""
        loaded = [self._on_loaded(load) for load in self.transfer.finished_loads()]
        finished = [req for req in loaded if req is not None]
        finished += [self._on_published(p) for p in self.transfer.finished_publishes()]
        batch = ScheduledBatch([], [], [], finished)
        budget = self.max_prefill_tokens  # decode tokens do not count
        for req in list(self._running):
            if req.status is not RequestStatus.RUNNING:  # preempted to make room
                continue
            num_new = 1 if req.num_uncomputed == 1 else min(req.num_uncomputed, budget)
            if num_new == 0 or not self._reserve(req, req.num_computed + num_new):
                continue
            self._add(batch, req, num_new)
            budget -= num_new if num_new > 1 else 0
        num_admitted = len(self._running) + self.transfer.num_loading
        while self._waiting and budget > 0 and num_admitted < self.max_num_seqs:
            req = self._waiting[0]
            if not self._admit(req):
                break
            self._waiting.popleft()
            num_admitted += 1
            if req.status is RequestStatus.FINISHED:  # a prefetch with nothing to load
                finished.append(req)
            elif req.status is RequestStatus.RUNNING:
                self._running.append(req)
                num_new = min(req.num_uncomputed, budget)
                self._add(batch, req, num_new)
                budget -= num_new
        return batch

    def postprocess(
        self, batch: ScheduledBatch, tokens: list[int], logits: torch.Tensor, now: float
    ) -> None:
        """Applies a computed step: counts every chunk (caching and saving the blocks it
        completed), then appends token i, with its row of `logits` (len(tokens), vocab), to
        request ``batch.sample_rows[i]``, finishing it when its role says (`_finish_reason`)."""
        requests = batch.requests
        for req, num_new in zip(requests, batch.num_new_tokens, strict=True):
            self._commit(req, num_new)
        for i, token, row in zip(batch.sample_rows, tokens, logits, strict=True):
            req = requests[i]
            req.token_ids.append(token)
            req.last_logits = row
            req.first_token_s = req.first_token_s if req.first_token_s is not None else now
            req.last_token_s = now
            req.finish_reason = self._finish_reason(req, token)
            if req.finish_reason is not None:
                self._finish(req)

    # -- scheduling ---------------------------------------------------------------------

    def _add(self, batch: ScheduledBatch, req: Request, num_new: int) -> None:
        if num_new == req.num_uncomputed:
            batch.sample_rows.append(len(batch.requests))
        batch.requests.append(req)
        batch.num_new_tokens.append(num_new)

    def _admit(self, req: Request) -> bool:
        """Gives `req` its pages and starts receiving the store's blocks of it, if any;
        False, nothing held, when the pool cannot hold it now."""
        uncached = self.block_manager.allocate(req)
        if uncached is None:
            return False
        if req.local_cached_tokens is None:
            req.local_cached_tokens = req.num_computed
        num_hits = self.policy.num_store_blocks(req, uncached, self.transfer)
        if num_hits == 0:
            req.store_cached_tokens = req.store_cached_tokens or 0
            req.status = RequestStatus.RUNNING
            if req.prefetch:
                req.finish_reason = "prefetch"
                self._release(req)
            return True
        uncached = uncached._replace(keys=uncached.keys[:num_hits])
        first = uncached.first_block
        blocks = self.block_manager.blocks(req, first, first + num_hits)
        self.transfer.start_load(req, uncached, blocks)
        req.status = RequestStatus.LOADING_REMOTE_KV
        return True

    def _on_loaded(self, load: LoadResult) -> Request | None:
        """LOADING_REMOTE_KV to RUNNING: caches and counts only the blocks that arrived. A
        prefetch is FINISHED instead, and returned (its caller gets an output)."""
        req, num_loaded = load.request, load.num_loaded
        self.block_manager.cache(load.keys[:num_loaded], load.blocks[:num_loaded])
        req.num_computed = (load.first_block + num_loaded) * self._block_tokens
        if req.store_cached_tokens is None:
            req.store_cached_tokens = num_loaded * self._block_tokens
        if req.finish_reason == "abort":  # its caller left while the load was in flight
            self._release(req)
            return None
        if req.prefetch:
            req.finish_reason = "prefetch"
            self._release(req)
            return req
        req.status = RequestStatus.RUNNING
        self._running.append(req)
        return None

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Grows `req` to pages for `num_tokens`, preempting the youngest running requests
        while the pool is short; False if `req` itself had to be preempted."""
        while not self.block_manager.grow(req, num_tokens):
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Back to the queue's front; its full blocks stay in the prefix cache for re-admission."""
        logger.info("event=preempt request_id=%d tokens=%d", req.request_id, len(req.token_ids))
        self._running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        self._waiting.appendleft(req)

    # -- after the forward pass -----------------------------------------------------------

    def _commit(self, req: Request, num_new: int) -> None:
        """Counts `num_new` computed tokens; caches and saves the full blocks they completed."""
        bt = self._block_tokens
        first, req.num_computed = req.num_computed // bt, req.num_computed + num_new
        last = req.num_computed // bt
        if last > first:
            parent, position, keys, blocks = self.block_manager.computed_blocks(req, first, last)
            self.transfer.save(req, parent, position, keys, blocks)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        return self.policy.finish_reason(req, token)

    def _finish(self, req: Request) -> None:
        """Releases `req`, or first publishes its prompt blocks when its role says so."""
        self._running.remove(req)
        if not self.policy.publishes_on_finish:
            self._release(req)
            return
        keys, blocks = self.block_manager.prompt_blocks(req)
        req.status = RequestStatus.PUBLISHING_KV
        self.transfer.start_publish(req, keys, blocks)

    def _on_published(self, publish: PublishResult) -> Request:
        """PUBLISHING_KV to FINISHED; a publish that fell short is the request's error."""
        req, num_keys = publish.request, len(publish.keys)
        req.num_published_tokens = publish.num_published * self._block_tokens
        if publish.num_published < num_keys:
            req.error = PublishError(
                f"request {req.request_id}: {publish.num_published} of {num_keys} prompt "
                "blocks committed in the store",
                req.num_published_tokens,
            )
        self._release(req)
        return req

    def _release(self, req: Request) -> None:
        self.block_manager.free(req)
        req.status = RequestStatus.FINISHED
        del self._unfinished[req.request_id]
