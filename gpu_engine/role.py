"""Engine roles: what BOTH, PREFILL and DECODE engines decide differently, one `RolePolicy`
each, chosen from `ROLE_POLICIES` by `EngineConfig.role`.

A role changes three things the scheduler asks (`gpu_engine.scheduler`); everything else
(batching, chunked prefill, the prefix cache, loads and saves) is the same for all three:

=======  =====================================  =================================  ==========
role     store blocks to load (`_admit`)        finish (`_finish_reason`)          on finish
=======  =====================================  =================================  ==========
both     what the store's lookup reports        stop token or max_tokens           release
prefill  as both                                at the first token: "prefill"      publish
decode   the published count it was handed      as both                            release
         (no lookup); without one, as both
=======  =====================================  =================================  ==========

"publish": a prefill request holds its pages (PUBLISHING_KV) until its full prompt blocks
are committed in the store (`KVTransfer.start_publish`), so a decode engine can load them.
A decode engine trusts the count a prefill engine reported instead of asking the store on
its step loop; blocks the store lost meanwhile are simply not loaded, and recomputed.
"""

from __future__ import annotations

from types import MappingProxyType

from gpu_engine.block_manager import Uncached
from gpu_engine.config import EngineRole
from gpu_engine.kv_transfer import KVTransfer
from gpu_engine.request import Request

PREFILL_DONE = "prefill"  # finish reason of a prefill engine's request: decode continues


class RolePolicy:
    """The BOTH role; PREFILL and DECODE override one decision each.

    Args:
        block_tokens: tokens per block, the unit of store counts.

    Attributes:
        publishes_on_finish: a finished request waits for its prompt blocks' publish.
    """

    publishes_on_finish = False

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens

    def num_store_blocks(self, req: Request, uncached: Uncached, transfer: KVTransfer) -> int:
        """How many leading blocks of `uncached` to load from the store (0: none)."""
        return transfer.lookup(req, uncached) if uncached.keys else 0

    def finish_reason(self, req: Request, token: int) -> str | None:
        """Why `req` finishes with `token`, just appended; None: it goes on."""
        if token in req.params.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= req.params.max_tokens:
            return "length"
        return None


class PrefillPolicy(RolePolicy):
    """Finishes every request at its first token, once its prompt blocks are published."""

    publishes_on_finish = True

    def finish_reason(self, req: Request, token: int) -> str | None:
        return super().finish_reason(req, token) or PREFILL_DONE


class DecodePolicy(RolePolicy):
    """Loads the blocks a prefill engine published without asking the store first."""

    def num_store_blocks(self, req: Request, uncached: Uncached, transfer: KVTransfer) -> int:
        if not req.num_published_tokens:  # handed no count: find out, as BOTH does
            return super().num_store_blocks(req, uncached, transfer)
        num_published = req.num_published_tokens // self.block_tokens
        return max(0, min(len(uncached.keys), num_published - uncached.first_block))


ROLE_POLICIES: MappingProxyType[EngineRole, type[RolePolicy]] = MappingProxyType(
    {
        EngineRole.BOTH: RolePolicy,
        EngineRole.PREFILL: PrefillPolicy,
        EngineRole.DECODE: DecodePolicy,
    }
)
