"""What an admission decision returns: where to run a request, or why not and when to retry.

A live front turns `Reject` into HTTP 429 with ``Retry-After: ceil(retry_after_s)`` (or no
header when `retry_after_s` is None: the request cannot fit however long it waits) and the
reason in the body; gRPC into RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class RejectReason(StrEnum):
    """Which objective or limit a rejected request was predicted to miss."""

    TTFT = "ttft"  # predicted time to first token over the SLO
    TBT = "tbt"  # predicted time between tokens over the SLO
    DECODE_MEMORY = "decode_memory"  # no decode instance can hold its KV
    BUSY = "busy"  # every instance over a busy threshold (Dynamo)
    SHED = "shed"  # dropped by saturation-based shedding (llm-d)


class Accept(NamedTuple):
    """Run the request: prefill on `prefill`, decode on `decode` (instance indexes).

    `predicted_ttft_s` and `predicted_tbt_s` are the policy's predictions, None where the
    policy makes none.
    """

    prefill: int
    decode: int
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None


class Reject(NamedTuple):
    """Refuse the request now.

    Attributes:
        reason: what it was predicted to miss.
        predicted: the predicted value (seconds for TTFT/TBT, tokens for memory), if any.
        limit: the objective or limit it was compared with, if any.
        retry_after_s: seconds after which the predicted load lets it fit; None when it
            never fits (e.g. a prompt whose prefill alone exceeds the TTFT SLO).
    """

    reason: RejectReason
    predicted: float | None = None
    limit: float | None = None
    retry_after_s: float | None = None


Decision = Accept | Reject
