"""What the engine hands back after a step: `RequestOutput`, its `Usage` and its metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpu_engine.errors import PublishError
from gpu_engine.request import Request, RequestStatus


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
    finish_reason: str | None  # None until FINISHED; length, stop, prefill or prefetch
    usage: Usage
    metrics: RequestMetrics
    logits: torch.Tensor | None  # (vocab,) fp32 on CPU, of the last token; when finished
    # Leading prompt tokens committed in the store: a prefill engine's, once finished (the
    # count to hand the decode engine); a decode engine's, as it was handed them.
    num_published_tokens: int = 0
    error: PublishError | None = None  # a prefill engine's publish fell short

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, req: Request) -> RequestOutput:
        """The output of `req` right after it got a token, or after a prefetch finished
        (no token: no TTFT)."""
        local, store = req.local_cached_tokens or 0, req.store_cached_tokens or 0
        num_out = req.num_output_tokens
        first, last = req.first_token_s, req.last_token_s
        assert req.prefetch or (first is not None and last is not None), "output before a token"
        ttft = tpot = None
        if first is not None and last is not None:
            ttft = first - req.arrival_s
            tpot = (last - first) / (num_out - 1) if num_out > 1 else None
        is_finished = req.status is RequestStatus.FINISHED
        logits = req.last_logits if is_finished else None
        return cls(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.token_ids[: req.num_prompt_tokens]),
            output_token_ids=tuple(req.token_ids[req.num_prompt_tokens :]),
            finish_reason=req.finish_reason if is_finished else None,
            usage=Usage(req.num_prompt_tokens, num_out, local + store, local, store),
            metrics=RequestMetrics(req.arrival_s, ttft, tpot),
            logits=logits.cpu() if logits is not None else None,
            num_published_tokens=req.num_published_tokens,
            error=req.error,
        )
