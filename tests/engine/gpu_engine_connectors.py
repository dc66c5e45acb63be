"""Stand-ins for the store behind the engine's `KVConnector` seam, shared by the engine's
tests: an in-memory store, one that fails in chosen ways, and one that holds a load until
the test lets it through."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from gpu_engine.connector_base import BlockPages, ConnectorRequest, KVConnector


class DictConnector(KVConnector):
    """An in-memory stand-in for the store, keyed by block key; shareable between engines.
    Its saves are synchronous, so a publish only adds the blocks still missing."""

    def __init__(self, blocks: dict[bytes, object], as_bytes: bool = False) -> None:
        self.blocks = blocks
        self.as_bytes = as_bytes
        self.num_saved = 0

    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        for i, (key, block_pages) in enumerate(zip(keys, pages, strict=True)):
            if key not in self.blocks:
                return i
            self.cache.write_block(block_pages, self.blocks[key])  # type: ignore[arg-type]
        return len(keys)

    def save(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> None:
        for key, block_pages in zip(keys, pages, strict=True):
            block = self.cache.read_block(block_pages).clone()
            self.blocks.setdefault(
                key, block.view(torch.uint8).numpy().tobytes() if self.as_bytes else block
            )
            self.num_saved += 1

    def publish(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        self.save(request, keys, pages)
        return len(keys)


class FlakyConnector(DictConnector):
    """Loads at most `limit` blocks, scribbles garbage on the rest, or raises, or lies."""

    def __init__(self, blocks: dict[bytes, object], mode: str, limit: int = 0) -> None:
        super().__init__(blocks)
        self.mode, self.limit = mode, limit

    def lookup(self, request: ConnectorRequest, keys: Sequence[bytes]) -> int:
        if self.mode == "lookup_raise":
            raise ConnectionError("store unreachable")
        return len(keys) + 1 if self.mode == "lookup_bad_count" else len(keys)

    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        for block_pages in pages:
            self.cache.write_block(block_pages, torch.full(self.cache.block_shape, 7.0))
        if self.mode == "raise":
            raise ConnectionError("store unreachable")
        if self.mode == "bad_count":
            return len(keys) + 1
        return super().load(request, keys[: self.limit], pages[: self.limit])


class GatedConnector(DictConnector):
    """Loads only once `gate` is set, so a test sees the engine while a load is in flight;
    `lookup` reports at most `max_hits` blocks."""

    def __init__(self, blocks: dict[bytes, object], max_hits: int = 1 << 30) -> None:
        super().__init__(blocks)
        self.gate = threading.Event()
        self.max_hits = max_hits
        self.loaded_keys: list[bytes] = []

    def lookup(self, request: ConnectorRequest, keys: Sequence[bytes]) -> int:
        return min(self.max_hits, len(keys))

    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        self.loaded_keys += keys
        return super().load(request, keys, pages)
