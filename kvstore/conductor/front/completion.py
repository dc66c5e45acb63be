"""A completion as the conductor serves it: the request, its streamed pieces, its outcome,
and the refusal a rejected request raises. Neither HTTP nor protobuf types pass this line."""

from __future__ import annotations

import math
from typing import NamedTuple

from kvstore.conductor.decision import Reject
from kvstore.conductor.slo import SLO
from kvstore.errors import InvalidArgumentError, ResourceExhaustedError

UINT32_END = 2**32  # token ids and max_tokens travel to engines as uint32, the seed as uint64
UINT64_END = 2**64
# Engines sample softmax(logits / temperature) in float32: a temperature that is not finite,
# or under this floor (vLLM's) but not 0 (greedy), makes the probabilities NaN, and the
# engine's step fails for every request in its batch.
MIN_TEMPERATURE = 0.01


class CompletionRequest(NamedTuple):
    """One completion to route and run.

    Attributes:
        prompt_token_ids: the prompt, tokenized.
        max_tokens: output tokens to generate (the engine stops at max_tokens).
        temperature: 0 samples greedily.
        seed: seeds sampling; None with temperature > 0 lets the conductor draw one, so
            the prefill and decode engines sample the same first token.
        slo: the objectives the request is admitted against and judged on.
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    seed: int | None
    slo: SLO


def check(request: CompletionRequest) -> CompletionRequest:
    """`request`, when the engines can run it as asked; else InvalidArgumentError naming the
    field (the front ends' checks of their own fields come first)."""
    r = request
    if not all(0 <= t < UINT32_END for t in r.prompt_token_ids):
        raise InvalidArgumentError(f"prompt: token ids must be in [0, {UINT32_END})")
    if not 1 <= r.max_tokens < UINT32_END:
        raise InvalidArgumentError(f"max_tokens must be in [1, {UINT32_END}): {r.max_tokens}")
    if r.seed is not None and not 0 <= r.seed < UINT64_END:
        raise InvalidArgumentError(f"seed must be in [0, {UINT64_END}): {r.seed}")
    if r.temperature != 0 and not MIN_TEMPERATURE <= r.temperature < math.inf:
        raise InvalidArgumentError(
            f"temperature must be 0 or finite and >= {MIN_TEMPERATURE}: {r.temperature}"
        )
    return request


class CompletionChunk(NamedTuple):
    """New output tokens, in order; each token reaches the client once."""

    token_ids: tuple[int, ...]


class CompletionOutcome(NamedTuple):
    """How a request went; `rejected` is None for a served one.

    Times are seconds on the conductor's clock; `prefilled_tokens` is the prompt tokens the
    prefill computed rather than loaded or reused.
    """

    request_id: int
    rejected: Reject | None
    input_len: int
    arrival_s: float
    prefill: int = -1  # engine index into the conductor's engines, -1: none
    decode: int = -1
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    ttft_s: float = float("nan")
    tbt_s: float = float("nan")
    end_s: float = float("nan")
    output_token_ids: tuple[int, ...] = ()
    finish_reason: str = ""
    cached_tokens: int = 0
    prefilled_tokens: int = 0


class RejectedError(ResourceExhaustedError):
    """The conductor refused a request up front (HTTP 429, gRPC RESOURCE_EXHAUSTED).

    Attributes:
        reject: the policy's decision: reason, predicted value, limit, retry-after.
    """

    def __init__(self, reject: Reject) -> None:
        super().__init__(describe(reject))
        self.reject = reject


def describe(reject: Reject) -> str:
    """One line on why: the reason, and the prediction against its limit when known."""
    text = f"rejected: {reject.reason.value}"
    if reject.predicted is not None and reject.limit is not None:
        text += f" predicted {reject.predicted:.4g} over limit {reject.limit:.4g}"
    if reject.retry_after_s is not None:
        text += f", retry after {reject.retry_after_s:.3g} s"
    return text
