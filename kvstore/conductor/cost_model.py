"""The cost model: prefill, decode-step and transfer times from a `CostProfile`."""

from __future__ import annotations

import math
from typing import NamedTuple

from kvstore.conductor.profile import CostProfile


class CostModel:
    """Predicts how long work takes on one instance; pure functions of a profile.

    Token counts are prompt tokens; `cached_len` tokens are already in the instance's KV
    (loaded or local) and are not recomputed, but the new tokens still attend to them.
    """

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile

    def prefill_s(self, input_len: int, cached_len: int = 0) -> float:
        """Seconds to prefill `input_len` tokens whose first `cached_len` are cached.

        Raises:
            ValueError: `cached_len` outside ``0..input_len``.
        """
        if not 0 <= cached_len <= input_len:
            raise ValueError(f"cached_len {cached_len} outside 0..{input_len}")
        p = self.profile
        new = input_len - cached_len
        if new == 0:
            return 0.0
        pairs = input_len * input_len - cached_len * cached_len
        return (
            p.prefill_overhead_s + p.prefill_s_per_token * new + p.prefill_s_per_token_pair * pairs
        )

    def decode_step_s(self, num_seqs: int, context_tokens: float) -> float:
        """Seconds for one decode step of `num_seqs` sequences over `context_tokens` of KV."""
        if num_seqs <= 0:
            return 0.0
        p = self.profile
        return (
            p.decode_step_overhead_s
            + p.decode_s_per_seq * num_seqs
            + p.decode_s_per_context_token * context_tokens
        )

    def max_context_tokens(self, num_seqs: int, tbt_s: float) -> float:
        """The most context tokens `num_seqs` sequences may hold for a step within `tbt_s`,
        capped by the decode instance's KV capacity (0 when even an empty context is over)."""
        p = self.profile
        room = tbt_s - p.decode_step_overhead_s - p.decode_s_per_seq * num_seqs
        if room <= 0:
            return 0.0
        by_time = room / p.decode_s_per_context_token if p.decode_s_per_context_token else math.inf
        return min(by_time, float(p.decode_kv_capacity_tokens))

    def transfer_s(self, num_blocks: int) -> float:
        """Seconds to move `num_blocks` blocks between the pool and an instance."""
        if num_blocks <= 0:
            return 0.0
        p = self.profile
        return p.transfer_latency_s + num_blocks * p.block_bytes / p.pool_bandwidth_bytes_per_s

    def kv_transfer_s(self, num_tokens: int) -> float:
        """Seconds to move the KV of `num_tokens` tokens (prefill -> decode)."""
        return self.transfer_s(math.ceil(num_tokens / self.profile.block_tokens))

    def handoff_s(self, input_len: int, compute_s: float) -> float:
        """Seconds from the end of a prefill until its KV is on the decode instance.

        The KV streams out layer by layer while the prefill computes (Mooncake's layer-wise
        transfer), so only the part of the transfer that outlasts the compute delays decode.
        """
        return max(0.0, self.kv_transfer_s(input_len) - compute_s)

    def tokens(self, num_blocks: int, input_len: int) -> int:
        """Prompt tokens covered by the first `num_blocks` blocks of an `input_len` prompt."""
        return min(num_blocks * self.profile.block_tokens, input_len)

    def load_beats_recompute(self, input_len: int, cached_len: int, more_len: int) -> bool:
        """Whether loading `more_len` further cached tokens beats recomputing them."""
        if more_len <= 0:
            return False
        blocks = math.ceil(more_len / self.profile.block_tokens)
        saved = self.prefill_s(input_len, cached_len) - self.prefill_s(
            input_len, cached_len + more_len
        )
        return self.transfer_s(blocks) < saved


class PrefillPlan(NamedTuple):
    """How an engine prefills one prompt on one instance, and how long that takes.

    The engine uses its local prefix (`local_blocks`), then loads from the pool the blocks
    that continue it (`fetched_blocks`) when loading beats recomputing them, and computes
    the rest.
    """

    local_blocks: int
    fetched_blocks: int
    cached_len: int
    transfer_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        """Transfer, then compute: the instance is busy this long."""
        return self.transfer_s + self.compute_s


def plan_prefill(
    cost: CostModel, input_len: int, local_blocks: int, pool_blocks: int
) -> PrefillPlan:
    """The engine's plan for a prompt of `input_len` tokens with `local_blocks` cached on the
    instance and `pool_blocks` more, continuing them, in the pool."""
    local_len = cost.tokens(local_blocks, input_len)
    more_len = cost.tokens(local_blocks + pool_blocks, input_len) - local_len
    fetched = pool_blocks if cost.load_beats_recompute(input_len, local_len, more_len) else 0
    cached_len = local_len + (more_len if fetched else 0)
    # The last prompt token is always computed: it yields the first output token.
    cached_len = min(cached_len, input_len - 1) if input_len > 0 else 0
    return PrefillPlan(
        local_blocks,
        fetched,
        cached_len,
        cost.transfer_s(fetched),
        cost.prefill_s(input_len, max(cached_len, 0)),
    )
