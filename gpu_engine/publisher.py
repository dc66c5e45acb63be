"""The engine's block publisher: `kvstore.client.publishing`'s, shared with the vLLM connector.

Bounded staging, drop counting and cut-chain tracking live there; this module keeps the
engine's imports as they were.
"""

from kvstore.client.publishing.publisher import (
    MAX_CUT_CHAINS,
    BlockPublisher,
    PublishStats,
    PutChain,
    ReadBlock,
    ReadBlocks,
)

__all__ = [
    "MAX_CUT_CHAINS",
    "BlockPublisher",
    "PublishStats",
    "PutChain",
    "ReadBlock",
    "ReadBlocks",
]
