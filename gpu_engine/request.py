"""A request inside the engine: its tokens, its pages and its `RequestStatus`.

Status transitions (vLLM v1's `RequestStatus`, in small; the scheduler makes every one):

=================  ==================  =============================================
from               to                  when
=================  ==================  =============================================
WAITING            RUNNING             admitted, nothing to receive from the store
WAITING            LOADING_REMOTE_KV   admitted, the store holds some of its blocks
LOADING_REMOTE_KV  RUNNING             the load is over (whatever it delivered)
RUNNING            WAITING             preempted; its pages are released
RUNNING            FINISHED            stop token or max_tokens; its pages released
RUNNING            PUBLISHING_KV       a prefill engine's request got its first token
PUBLISHING_KV      FINISHED            its prompt blocks are committed (or the wait
                                       is over: `error` says so); pages released
WAITING, RUNNING   FINISHED            aborted: its caller is gone; pages released
LOADING_REMOTE_KV  FINISHED            aborted, once the load writing its pages is over
LOADING_REMOTE_KV  FINISHED            a prefetch, once its load is over (the blocks
                                       stay in the prefix cache)
WAITING            FINISHED            a prefetch with nothing to load
=================  ==================  =============================================

Token ranges (B = block_tokens):

=====================  =====================================================
[0, local)             blocks matched in the local prefix cache
[local, local+store)   blocks the connector loaded
[.., num_computed)     computed here; every full block is cached and saved
[num_computed, len)    still to compute (one token while decoding)
=====================  =====================================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from gpu_engine.errors import PublishError
from gpu_engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued: new, or preempted
    LOADING_REMOTE_KV = enum.auto()  # holds its pages, receiving store blocks into them
    RUNNING = enum.auto()  # scheduled every step until it finishes or is preempted
    PUBLISHING_KV = enum.auto()  # prefill done; holds its pages until its blocks are stored
    FINISHED = enum.auto()  # pages released; `finish_reason` says why


@dataclass(eq=False)
class Request:
    """One request's mutable state; the scheduler owns it from `add` to FINISHED."""

    request_id: int
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    arrival_s: float
    status: RequestStatus = RequestStatus.WAITING
    pages: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # chained keys of full blocks, a prefix
    num_computed: int = 0  # tokens whose K/V are in `pages`
    local_cached_tokens: int | None = None  # set on first admission
    store_cached_tokens: int | None = None  # set when the first admission's load is over
    first_token_s: float | None = None
    last_token_s: float | None = None
    last_logits: torch.Tensor | None = None  # (vocab,) of the last sampled token
    finish_reason: str | None = None  # stop, length, prefill, prefetch, abort: computes no more
    # Leading prompt tokens committed in the store: handed to a decode engine by the
    # conductor, or found by a prefill engine when the request finishes.
    num_published_tokens: int = 0
    error: PublishError | None = None  # a prefill engine's publish fell short
    # Only load the store's blocks of the prompt into the prefix cache, compute nothing:
    # finish reason "prefetch" (a conductor's replication of hot blocks, ahead of need).
    prefetch: bool = False

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
