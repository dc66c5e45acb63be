"""The engine: continuous batching of chunked prefill and decode over the paged KV cache.

`step` is nano-vllm's loop: the scheduler picks this step's batch (`Scheduler.schedule`), the
model computes it in one forward pass, the sampler picks a token for every request whose
tokens are all computed, and the scheduler applies the results (`Scheduler.postprocess`).
What differs between the roles (both, prefill, decode) is in `gpu_engine.role`.

Rooms: requests and their `RequestStatus` in `gpu_engine.request`, queues and preemption in
`gpu_engine.scheduler`, pages and cached blocks in `gpu_engine.block_manager` over
`gpu_engine.page_pool`, the connector's calls and loads in flight in `gpu_engine.kv_transfer`,
what a step returns in `gpu_engine.outputs`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from gpu_engine.block_manager import BlockManager
from gpu_engine.config import EngineConfig
from gpu_engine.connector_base import KVConnector, NoopConnector
from gpu_engine.errors import InvalidRequestError
from gpu_engine.kv_cache import KVCache
from gpu_engine.kv_transfer import KVTransfer
from gpu_engine.model import ForwardBatch, build_model
from gpu_engine.outputs import RequestMetrics, RequestOutput, Usage
from gpu_engine.page_pool import PagePool
from gpu_engine.request import Request
from gpu_engine.sampling import SamplingParams, sample
from gpu_engine.scheduler import ScheduledBatch, Scheduler

__all__ = ["Engine", "RequestMetrics", "RequestOutput", "Usage"]


class Engine:
    """Runs requests to completion over a paged KV cache; see the module docstring.

    Not thread-safe: one thread calls it (`gpu_engine.runner.EngineRunner`).

    Args:
        config: model, pages and batching limits.
        connector: the store seam; default `NoopConnector`.
        clock: seconds, monotonic; injected so tests control time.
    """

    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        m = config.model_config
        self.model = build_model(
            m, config.seed, config.weights_path or None, config.device, config.torch_dtype
        )
        self.cache = KVCache(
            config.num_pages,
            m.num_layers,
            config.page_tokens,
            m.num_kv_heads,
            m.head_dim,
            config.block_tokens,
            config.torch_dtype,
            config.device,
        )
        self.pool = PagePool(config.num_pages, config.pages_per_block)
        self.namespace = config.namespace
        self.connector = connector if connector is not None else NoopConnector()
        self.connector.bind(self.cache, self.namespace)
        blocks = BlockManager(
            self.pool,
            self.namespace,
            config.block_tokens,
            config.page_tokens,
            config.enable_prefix_cache,
        )
        self.transfer = KVTransfer(self.connector, config.async_load)
        self.scheduler = Scheduler(config, blocks, self.transfer)
        self._clock = clock
        self._next_id = 0

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        """Admitted requests: running, or receiving their store blocks."""
        return self.scheduler.num_running

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        num_published_tokens: int = 0,
        prefetch: bool = False,
    ) -> int:
        """Queues a request; returns its id.

        Args:
            prompt_token_ids: the prompt.
            params: how to sample; default `SamplingParams()`.
            num_published_tokens: leading prompt tokens a prefill engine reported committed
                in the store (its output's `num_published_tokens`), a multiple of
                block_tokens; a decode engine loads those blocks without asking the store.
            prefetch: only load the store's blocks of the prompt that the prefix cache
                lacks into it, and compute nothing (finish reason "prefetch"; its usage
                counts what it loaded). Only its full blocks before the last token count.

        Raises:
            InvalidRequestError: empty prompt, a token outside the vocabulary, a request
                that could never fit the model's positions or the page pool, or a published
                count that is not whole blocks of the prompt.
        """
        params = params if params is not None else SamplingParams()
        tokens = [int(t) for t in prompt_token_ids]
        self._check_request(tokens, params, num_published_tokens)
        request_id = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + request_id
        generator = torch.Generator(device=self.config.device).manual_seed(seed)
        req = Request(request_id, tokens, len(tokens), params, generator, self._clock())
        req.num_published_tokens = num_published_tokens
        req.prefetch = prefetch
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: int) -> bool:
        """Stops computing a request whose caller is gone; `Scheduler.abort` says when its
        pages are released. It gets no more outputs. False if it is not unfinished here."""
        return self.scheduler.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One forward pass; returns an output for every request that got a token, and for
        every request that finished without one (a prefill engine's, once published)."""
        batch = self.scheduler.schedule()
        published = [RequestOutput.of(req) for req in batch.finished]
        if not batch.requests:  # nothing to compute until a load or a publish is over
            if not published:
                self.transfer.wait_for_transfer()
            return published
        logits = self.model(self._forward_batch(batch), self.cache)  # (B, vocab)
        rows = batch.sample_rows
        ready = [batch.requests[i] for i in rows]
        tokens = sample(logits[rows], [r.params for r in ready], [r.generator for r in ready])
        now = self._clock() if ready else 0.0  # the clock times tokens only
        self.scheduler.postprocess(batch, tokens, logits[rows], now)
        return published + [RequestOutput.of(req) for req in ready]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs `prompts` to completion; outputs in the order of `prompts`."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        finished: dict[int, RequestOutput] = {}
        while self.has_unfinished:
            finished.update((o.request_id, o) for o in self.step() if o.finished)
        return [finished[i] for i in ids]

    def close(self) -> None:
        """Stops the loader thread once the load in flight, if any, is over."""
        self.transfer.close()

    def _forward_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        reqs, nums = batch.requests, batch.num_new_tokens
        chunks = [
            r.token_ids[r.num_computed : r.num_computed + n]
            for r, n in zip(reqs, nums, strict=True)
        ]
        return ForwardBatch.build(
            chunks=chunks,
            starts=[r.num_computed for r in reqs],
            page_tables=[r.pages for r in reqs],
            page_tokens=self.config.page_tokens,
            dtype=self.config.torch_dtype,
            device=self.config.device,
        )

    def _check_request(
        self, tokens: list[int], params: SamplingParams, num_published_tokens: int
    ) -> None:
        m = self.config.model_config
        if not tokens:
            raise InvalidRequestError("prompt must have at least one token")
        if min(tokens) < 0 or max(tokens) >= m.vocab_size:
            raise InvalidRequestError(f"token ids must be in [0, {m.vocab_size})")
        total = len(tokens) + params.max_tokens
        if total > m.max_position:
            raise InvalidRequestError(f"{total} tokens exceed max_position {m.max_position}")
        if -(-total // self.config.page_tokens) > self.config.num_pages:
            raise InvalidRequestError(
                f"{total} tokens need more than {self.config.num_pages} pages"
            )
        bt = self.config.block_tokens
        if not 0 <= num_published_tokens <= len(tokens) or num_published_tokens % bt:
            raise InvalidRequestError(
                f"num_published_tokens must be whole blocks ({bt} tokens) of the prompt, "
                f"got {num_published_tokens} for {len(tokens)} tokens"
            )
