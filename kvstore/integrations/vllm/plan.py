"""Scheduler-side bookkeeping of the vLLM connector: which blocks to load and to save.

Pure Python over token ids and vLLM block ids, so it is testable without vLLM. Block
``i`` of a request covers prompt tokens ``[i*B, (i+1)*B)``; its key is ``keys[i]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.keys import ChainPosition, Namespace, block_keys


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move between the store and vLLM's paged cache."""

    req_id: str
    namespace: Namespace
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]  # vLLM block ids, one per key
    parent: bytes | None  # key just before keys[0]; None at the start of a chain
    position: ChainPosition | None = None  # where keys[0] sits in its chain; None: the root
    remote: bool = False  # a load some of whose blocks the scheduler found on other nodes

    @property
    def namespace_id(self) -> bytes:
        return self.namespace.id


def loadable_prefix_len(num_prompt_tokens: int, block_tokens: int) -> int:
    """Most prompt tokens a load may cover: whole blocks, and never the last prompt token,
    which vLLM must compute to produce the first output token."""
    return max(num_prompt_tokens - 1, 0) // block_tokens * block_tokens


@dataclass
class RequestBlocks:
    """A live request's keys, vLLM block ids and how far its blocks have been saved."""

    req_id: str
    namespace: Namespace
    keys: list[bytes]  # one per full prompt block
    block_ids: list[int] = field(default_factory=list)
    num_saved_blocks: int = 0  # blocks [0, n) are in the store or need no save
    num_home: int = 0  # blocks [0, n) are on the node beside the engine (its last match)

    @classmethod
    def from_prompt(cls, req_id: str, namespace: Namespace, tokens: Sequence[int]) -> RequestBlocks:
        return cls(req_id, namespace, block_keys(namespace, list(tokens)))

    def load(self, start: int, stop: int) -> BlockTransfer:
        """Blocks [start, stop) to load: `remote` where the last match found some of them
        on other nodes than the engine's own."""
        return self.transfer(start, stop, remote=stop > self.num_home)

    def transfer(self, start: int, stop: int, remote: bool = False) -> BlockTransfer:
        """Blocks [start, stop) as a transfer; needs their vLLM block ids."""
        assert stop <= len(self.block_ids), f"{self.req_id}: blocks {stop} > allocated"
        return BlockTransfer(
            self.req_id,
            self.namespace,
            tuple(self.keys[start:stop]),
            tuple(self.block_ids[start:stop]),
            self.keys[start - 1] if start > 0 else None,
            ChainPosition.of(self.keys, start),
            remote,
        )

    def take_saves(self, num_computed_tokens: int) -> BlockTransfer | None:
        """Full prompt blocks computed by `num_computed_tokens` and not yet saved."""
        ready = min(num_computed_tokens // self.namespace.block_tokens, len(self.keys))
        ready = min(ready, len(self.block_ids))
        if ready <= self.num_saved_blocks:
            return None
        start, self.num_saved_blocks = self.num_saved_blocks, ready
        return self.transfer(start, ready)
