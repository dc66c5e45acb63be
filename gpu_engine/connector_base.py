"""The engine's seam to an external KV store: load full blocks on admission, save new ones.

On admission the engine asks `lookup` (in its step loop) how many of the blocks its local
prefix cache missed the store holds; when some, it runs `load` on its loader thread while
the step loop goes on decoding the running requests, and the request joins prefill once the
load returns (its status is LOADING_REMOTE_KV meanwhile: vLLM's WAITING_FOR_REMOTE_KVS, in
small). The engine calls a connector only through `gpu_engine.kv_transfer.KVTransfer`, which
treats a raise, or a count outside ``[0, len(keys)]``, as 0 blocks.

A prefill engine (`EngineRole.PREFILL`) also calls `publish` when a request finishes, off its
step loop, and finishes the request only once it returns: the one call that must not drop.

The engine owns pages and block keys; a connector only moves bytes between the store and
pages it is handed, through `KVCache.write_block` / `read_block` / `block_view`. Every block
is `pages_per_block` pages, passed as a tuple; keys come from `kvstore.keys.block_keys` in
the engine's namespace, so they are the store's keys.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from gpu_engine.kv_cache import KVCache
from kvstore.keys import ChainPosition, Namespace

BlockPages = tuple[int, ...]  # the pages of one block, in token order


class ConnectorRequest(NamedTuple):
    """What a connector may know of a request."""

    request_id: int
    num_prompt_tokens: int
    parent_key: bytes | None = None  # chain key of the block before keys[0]; None: a root
    position: ChainPosition | None = None  # where keys[0] sits in its chain; None: a root


class KVConnector(ABC):
    """Moves full KV blocks between an engine's pages and an outside store.

    `lookup` and `save` come from the engine's step loop. `load` may come from the engine's
    loader thread, one load at a time, and `publish` from its publish thread, one at a time,
    concurrently with each other and with `lookup` and `save` for other blocks; the pages
    either is handed belong to it alone until it returns.
    """

    def bind(self, cache: KVCache, namespace: Namespace) -> None:
        """Called once by the engine before any other call: its pages and its namespace."""
        self.cache = cache
        self.namespace = namespace

    def lookup(self, request: ConnectorRequest, keys: Sequence[bytes]) -> int:
        """How many leading blocks of `keys` the store holds now, n (0 <= n <= len(keys)).

        A hint, asked in the step loop, so it must be quick: the engine loads only those n
        (and `load` may still find fewer). The default claims all of them; errors count as 0.
        """
        return len(keys)

    @abstractmethod
    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        """Fills blocks from the store, in order, and returns how many, n (0 <= n <= len(keys)).

        Called on admission for the blocks `lookup` reported, usually off the step loop; block i
        has key `keys[i]` and goes to `pages[i]`. The engine counts exactly the first n blocks
        as loaded and recomputes the rest (overwriting whatever was written into them), so
        block n and later may be left in any state; every block before n must be complete
        when this returns. Raising is the same as returning 0.
        """

    @abstractmethod
    def save(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> None:
        """Offers blocks this engine just computed: block i has key `keys[i]`, in `pages[i]`.

        Called after the forward pass that completed them. The pages are only guaranteed to
        hold the block during the call: copy out (`read_block(pages, out=staging)`) before
        returning, then publish asynchronously; never stall the step loop on the network.
        Errors are logged by the engine and otherwise ignored.
        """

    def publish(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        """Commits a finished request's full prompt blocks in the store, in order, and
        returns how many leading ones are committed, n (0 <= n <= len(keys)).

        Called by a prefill engine once per request, after `save` offered the blocks it
        computed; block i has key `keys[i]` (a chain from the root) and is in `pages[i]`.
        Unlike `save`, nothing may be dropped: wait (bounded) for the blocks already offered,
        put the ones the store lacks, and count only what the store reports committed. May
        block; the request finishes when it returns. The default commits nothing: 0.
        """
        return 0


class NoopConnector(KVConnector):
    """The default: loads nothing, saves nothing."""

    def lookup(self, request: ConnectorRequest, keys: Sequence[bytes]) -> int:
        return 0

    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        return 0

    def save(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> None:
        return None
