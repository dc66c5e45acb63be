"""Sampling parameters and the sampler: greedy, or temperature with a seeded generator."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gpu_engine.errors import InvalidRequestError

# softmax(logits / temperature) in float32: a temperature that is not finite, or under this
# floor (vLLM's) but not 0 (greedy), makes the probabilities NaN, and the step fails.
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request.

    Args:
        max_tokens: tokens to generate, at most.
        temperature: 0 for greedy (argmax); otherwise softmax(logits / temperature), finite
            and at least `MIN_TEMPERATURE`.
        seed: seed of this request's generator; None derives one from the engine seed and the
            request id, so runs are reproducible either way.
        stop_token_ids: generation stops after emitting any of these.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive int, got {self.max_tokens}")
        t = self.temperature
        if t != 0 and not MIN_TEMPERATURE <= t < math.inf:  # NaN fails both
            raise InvalidRequestError(
                f"temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE}, got {t}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> list[int]:
    """One token per row of `logits` (B, vocab), row i by `params[i]` and `generators[i]`."""
    tokens = logits.argmax(dim=-1)  # (B,)
    for i, p in enumerate(params):
        if not p.is_greedy:
            probs = torch.softmax(logits[i].float() / p.temperature, dim=-1)  # (vocab,)
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return tokens.tolist()
