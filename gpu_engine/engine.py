"""The engine: continuous batching of chunked prefill and decode over the paged KV cache.

Each step runs one forward pass over a mix of sequences: every running request that is
decoding computes its last token, prefilling ones compute their next chunk, and new requests
are admitted while the prefill token budget and the page pool allow. On admission a request
reuses the longest prefix of its full prompt blocks found in the local prefix cache, then
asks the connector which of the next ones the store holds. Those are received on the loader
thread while the step loop goes on (the request holds its pages and waits in `_loading`);
once they are in, the request joins the running ones and computes only the rest. A step
with nothing else to run waits for a load instead of spinning.

Token ranges of one request (B = block_tokens):

=====================  =====================================================
[0, local)             blocks matched in the local prefix cache
[local, local+store)   blocks the connector loaded
[.., num_computed)     computed here; every full block is cached and saved
[num_computed, len)    still to compute (one token while decoding)
=====================  =====================================================

At most ``(prompt_len - 1) // B`` blocks are reused, so the last prompt token is always
computed and yields the first token's logits.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from gpu_engine.config import EngineConfig
from gpu_engine.connector_base import ConnectorRequest, KVConnector, NoopConnector
from gpu_engine.errors import InvalidRequestError
from gpu_engine.kv_cache import KVCache
from gpu_engine.model import ForwardBatch, build_model
from gpu_engine.page_pool import PagePool
from gpu_engine.sampling import SamplingParams, sample
from kvstore.keys import block_keys

logger = logging.getLogger(__name__)


class _PendingLoad(NamedTuple):
    """Blocks `first_block...` of a request, being received into its pages."""

    first_block: int
    keys: list[bytes]
    blocks: list[tuple[int, ...]]
    num_loaded: Future[int]


class Usage(NamedTuple):
    """Token counts, as in an OpenAI usage block, with cached tokens split by source."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # local_cached_tokens + store_cached_tokens
    local_cached_tokens: int  # from this engine's prefix cache
    store_cached_tokens: int  # loaded through the connector


class RequestMetrics(NamedTuple):
    arrival_s: float
    ttft_s: float | None  # arrival to first token
    tpot_s: float | None  # mean time per output token after the first


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step that gave it a token."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str | None  # None while running; "length" or "stop"
    usage: Usage
    metrics: RequestMetrics
    logits: torch.Tensor | None  # (vocab,) fp32 on CPU, of the last token; when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """One request's mutable state inside the engine."""

    request_id: int
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    arrival_s: float
    pages: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # chained keys of full blocks, a prefix
    num_computed: int = 0  # tokens whose K/V are in `pages`
    local_cached_tokens: int | None = None  # set on first admission
    store_cached_tokens: int | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    last_logits: torch.Tensor | None = None
    finish_reason: str | None = None
    load: _PendingLoad | None = None  # while its store blocks are being received

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def info(self) -> ConnectorRequest:
        return ConnectorRequest(self.request_id, self.num_prompt_tokens)


class Engine:
    """Runs requests to completion over a paged KV cache; see the module docstring.

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
        self._clock = clock
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._loading: list[Request] = []  # admitted, receiving store blocks
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        self._next_id = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._loading)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Admitted requests: running, or receiving their store blocks."""
        return len(self._running) + len(self._loading)

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None
    ) -> int:
        """Queues a request; returns its id.

        Raises:
            InvalidRequestError: empty prompt, a token outside the vocabulary, or a request
                that could never fit the model's positions or the page pool.
        """
        params = params if params is not None else SamplingParams()
        tokens = [int(t) for t in prompt_token_ids]
        self._check_request(tokens, params)
        request_id = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + request_id
        generator = torch.Generator(device=self.config.device).manual_seed(seed)
        req = Request(request_id, tokens, len(tokens), params, generator, self._clock())
        self._waiting.append(req)
        return request_id

    def step(self) -> list[RequestOutput]:
        """One forward pass; returns an output for every request that got a token."""
        self._finish_loads(block=False)
        scheduled = self._schedule()
        if not scheduled and self._loading:  # nothing to compute until a load is in
            self._finish_loads(block=True)
            scheduled = self._schedule()
        if not scheduled:
            return []
        batch = ForwardBatch.build(
            chunks=[r.token_ids[r.num_computed : r.num_computed + n] for r, n in scheduled],
            starts=[r.num_computed for r, _ in scheduled],
            page_tables=[r.pages for r, _ in scheduled],
            page_tokens=self.config.page_tokens,
            dtype=self.config.torch_dtype,
            device=self.config.device,
        )
        logits = self.model(batch, self.cache)  # (B, vocab)
        for req, num_new in scheduled:
            self._commit(req, num_new)
        return self._emit([r for r, _ in scheduled], logits)

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

    # -- scheduling ---------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, tokens to compute) for this step: running first, then admissions."""
        budget = self.config.max_prefill_tokens  # decode tokens do not count
        scheduled = []
        for req in list(self._running):
            if req not in self._running:  # preempted to make room
                continue
            num_new = 1 if req.num_uncomputed == 1 else min(req.num_uncomputed, budget)
            if num_new == 0 or not self._reserve(req, req.num_computed + num_new):
                continue
            scheduled.append((req, num_new))
            budget -= num_new if num_new > 1 else 0
        while self._waiting and budget > 0 and self.num_running < self.config.max_num_seqs:
            req = self._waiting[0]
            if not self._admit(req):
                break
            self._waiting.popleft()
            if req.load is not None:
                self._loading.append(req)
                continue
            self._running.append(req)
            num_new = min(req.num_uncomputed, budget)
            scheduled.append((req, num_new))
            budget -= num_new
        return scheduled

    def _admit(self, req: Request) -> bool:
        """Gives `req` pages for all its tokens, reusing cached and loaded blocks; False (and
        nothing held) when the pool cannot hold it now."""
        keys = self._keys(req, (len(req.token_ids) - 1) // self.config.block_tokens)
        hits = self.pool.match(keys) if self.config.enable_prefix_cache else []
        reused = [p for block in hits for p in block]
        need = self._num_pages(len(req.token_ids)) - len(reused)
        if need > self.pool.num_available:
            self.pool.release(reused[::-1])
            return False
        req.pages = reused + self.pool.allocate(need)
        req.num_computed = len(hits) * self.config.block_tokens
        if req.local_cached_tokens is None:
            req.local_cached_tokens = req.num_computed
        self._start_load(req, len(hits), keys)
        if req.load is not None and req.load.num_loaded.done():  # inline, or nothing to load
            self._finish_load(req)
        return True

    def _start_load(self, req: Request, first_block: int, all_keys: list[bytes]) -> None:
        """Starts receiving the blocks after `first_block` that the store holds (`req.load`)."""
        parent = all_keys[first_block - 1] if first_block else None
        info = req.info._replace(parent_key=parent)
        keys = all_keys[first_block:]
        keys = keys[: self._lookup(info, keys)] if keys else []
        blocks = [self._block_pages(req, first_block + i) for i in range(len(keys))]
        if keys and self.config.async_load:
            num_loaded = self._loader.submit(self.connector.load, info, keys, blocks)
        else:
            num_loaded = Future()
            try:
                num_loaded.set_result(self.connector.load(info, keys, blocks) if keys else 0)
            except Exception as exc:
                num_loaded.set_exception(exc)
        req.load = _PendingLoad(first_block, keys, blocks, num_loaded)

    def _lookup(self, info: ConnectorRequest, keys: list[bytes]) -> int:
        try:
            num_hits = self.connector.lookup(info, keys)
        except Exception:
            logger.exception("event=connector_lookup_failed request_id=%d", info.request_id)
            return 0
        if not isinstance(num_hits, int) or not 0 <= num_hits <= len(keys):
            logger.error("event=connector_lookup_bad_count count=%r", num_hits)
            return 0
        return num_hits

    def _finish_loads(self, block: bool) -> None:
        """Moves requests whose load is over to the running ones (waiting for one if `block`)."""
        if block and self._loading:
            wait([r.load.num_loaded for r in self._loading if r.load], return_when=FIRST_COMPLETED)
        for req in [r for r in self._loading if r.load and r.load.num_loaded.done()]:
            self._loading.remove(req)
            self._finish_load(req)
            self._running.append(req)

    def _finish_load(self, req: Request) -> None:
        """Caches and counts only the blocks the connector reports complete."""
        load, req.load = req.load, None
        assert load is not None
        try:
            num_loaded = load.num_loaded.result()
        except Exception:
            logger.exception("event=connector_load_failed request_id=%d", req.request_id)
            num_loaded = 0
        if not isinstance(num_loaded, int) or not 0 <= num_loaded <= len(load.keys):
            logger.error("event=connector_load_bad_count count=%r", num_loaded)
            num_loaded = 0
        if self.config.enable_prefix_cache:
            for key, pages in zip(load.keys[:num_loaded], load.blocks, strict=False):
                self.pool.insert(key, pages)
        req.num_computed = (load.first_block + num_loaded) * self.config.block_tokens
        if req.store_cached_tokens is None:
            req.store_cached_tokens = num_loaded * self.config.block_tokens

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Grows `req` to pages for `num_tokens`, preempting the youngest running requests
        when the pool is empty; False if `req` itself had to be preempted."""
        need = self._num_pages(num_tokens) - len(req.pages)
        while need > self.pool.num_available:
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.pool.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        """Back to the queue's front; its full blocks stay in the prefix cache for re-admission."""
        logger.info("event=preempt request_id=%d tokens=%d", req.request_id, len(req.token_ids))
        self._running.remove(req)
        self._release(req)
        self._waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.pool.release(req.pages[::-1])  # tail first: evicted before its parents
        req.pages = []
        req.num_computed = 0

    # -- after the forward pass -----------------------------------------------------------

    def _commit(self, req: Request, num_new: int) -> None:
        """Counts `num_new` computed tokens; caches and saves the full blocks they completed."""
        bt = self.config.block_tokens
        first, req.num_computed = req.num_computed // bt, req.num_computed + num_new
        last = req.num_computed // bt
        if last == first:
            return
        all_keys = self._keys(req, last)
        keys, parent = all_keys[first:last], all_keys[first - 1] if first else None
        blocks = [self._block_pages(req, i) for i in range(first, last)]
        if self.config.enable_prefix_cache:
            for key, pages in zip(keys, blocks, strict=True):
                self.pool.insert(key, pages)
        try:
            self.connector.save(req.info._replace(parent_key=parent), keys, blocks)
        except Exception:
            logger.exception("event=connector_save_failed request_id=%d", req.request_id)

    def _emit(self, reqs: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        """Samples a token for every request whose tokens are all computed."""
        rows = [i for i, r in enumerate(reqs) if r.num_uncomputed == 0]
        if not rows:
            return []
        ready = [reqs[i] for i in rows]
        tokens = sample(logits[rows], [r.params for r in ready], [r.generator for r in ready])
        now = self._clock()
        outputs = []
        for req, row, token in zip(ready, rows, tokens, strict=True):
            self._append(req, token, logits[row], now)
            outputs.append(self._output(req))
        return outputs

    def _append(self, req: Request, token: int, logits: torch.Tensor, now: float) -> None:
        req.token_ids.append(token)
        req.last_logits = logits
        req.first_token_s = req.first_token_s if req.first_token_s is not None else now
        req.last_token_s = now
        if token in req.params.stop_token_ids:
            req.finish_reason = "stop"
        elif req.num_output_tokens >= req.params.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self._running.remove(req)
            self._release(req)

    def _output(self, req: Request) -> RequestOutput:
        local = req.local_cached_tokens or 0
        store = req.store_cached_tokens or 0
        num_out = req.num_output_tokens
        first, last = req.first_token_s, req.last_token_s
        assert first is not None and last is not None, "output before a first token"
        finished = req.finish_reason is not None
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.token_ids[: req.num_prompt_tokens]),
            output_token_ids=tuple(req.token_ids[req.num_prompt_tokens :]),
            finish_reason=req.finish_reason,
            usage=Usage(req.num_prompt_tokens, num_out, local + store, local, store),
            metrics=RequestMetrics(
                req.arrival_s,
                first - req.arrival_s,
                (last - first) / (num_out - 1) if num_out > 1 else None,
            ),
            logits=req.last_logits.cpu() if finished and req.last_logits is not None else None,
        )

    # -- helpers --------------------------------------------------------------------------

    def _keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """The first `num_blocks` chained block keys of `req`, extending the memo."""
        have = len(req.keys)
        if num_blocks > have:
            bt = self.config.block_tokens
            parent = req.keys[-1] if req.keys else None
            tokens = req.token_ids[have * bt : num_blocks * bt]
            req.keys += block_keys(self.namespace, tokens, parent=parent)
        return req.keys[:num_blocks]

    def _block_pages(self, req: Request, block: int) -> tuple[int, ...]:
        ppb = self.config.pages_per_block
        return tuple(req.pages[block * ppb : (block + 1) * ppb])

    def _num_pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_tokens)

    def _check_request(self, tokens: list[int], params: SamplingParams) -> None:
        m = self.config.model_config
        if not tokens:
            raise InvalidRequestError("prompt must have at least one token")
        if min(tokens) < 0 or max(tokens) >= m.vocab_size:
            raise InvalidRequestError(f"token ids must be in [0, {m.vocab_size})")
        total = len(tokens) + params.max_tokens
        if total > m.max_position:
            raise InvalidRequestError(f"{total} tokens exceed max_position {m.max_position}")
        if self._num_pages(total) > self.config.num_pages:
            raise InvalidRequestError(
                f"{total} tokens need more than {self.config.num_pages} pages"
            )
