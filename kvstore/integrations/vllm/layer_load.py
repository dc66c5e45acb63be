"""A load received layer by layer, straight into vLLM's paged cache, while the model runs.

A store block is every layer of its tokens, layer after layer. Where vLLM keeps each
layer's part of a block in one contiguous run of host memory (its CPU layout), the data
plane's GET in parts (`DataPlaneClient.submit_get_parts`) lands part s of every block in
layer s's page: no staging, no copy. Parts come part-major, so layer 0 of every block is
in before any block's layer 1, and the forward pass's attention of layer s waits only for
layer s (`wait_layer`), while later layers are still on the wire:

    wire:     L0 L0 L0 | L1 L1 L1 | L2 L2 L2 | ...
    forward:           | attn 0   | attn 1   | attn 2 ...

A block's CRC32C is known once its last part is in, after the forward has read its first
layers: `finish` (after the forward) gives the blocks that arrived whole, and the connector
reports the rest to vLLM, which drops that step's output for their requests and recomputes
them (vLLM's contract for a failed synchronous load). So a block that fails its checksum
never yields a token.

Phases (`LoadPhases`, critical path only): `connect`, `submit`, `wait` (the forward blocked
on a layer), `transfer` (`finish` waiting for the rest). Time the load ran beside the
forward is in no phase.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.dataplane.shm.placed_rows import PlacedRows
from kvstore.errors import KVStoreError
from kvstore.integrations.load_phases import LoadResult, PhaseClock
from kvstore.integrations.loaded_prefix import loaded_prefix_len
from kvstore.integrations.vllm.plan import BlockTransfer

Found = concurrent.futures.Future[tuple[bool, ...]]
MAX_TAGGED_PARTS = 1 << 16  # parts one GET can tell apart (`frames.MAX_BLOCKS`)


class LayerLoad:
    """One transfer's blocks, landing layer by layer in `layers[s][block_id]`.

    Args:
        dataplane: the store's data-plane client.
        transfer: the blocks to load and the vLLM blocks they go to.
        layers: per layer, a uint8 array whose row `block_id` is that layer's part of
            vLLM block `block_id` (a view of the paged cache, not a copy).
        wait_s: most a wait blocks; the data plane's own deadline ends a load sooner.
        clock: the load's phases so far (its `connect`).
        placed: `layers` placed in memory shared with the node of `dataplane`
            (`ShmClient.place`): gets name their rows, with no object per part.
    """

    def __init__(
        self,
        dataplane: Any,
        transfer: BlockTransfer,
        layers: Sequence[np.ndarray],
        block_bytes: int,
        wait_s: float,
        clock: PhaseClock,
        placed: PlacedRows | None = None,
    ) -> None:
        self.transfer = transfer
        self.block_bytes = block_bytes
        self._wait_s = wait_s
        self._num_layers = len(layers)
        self._cond = threading.Condition()
        self._landed: list[int] = []  # per GET: layers whose every found block is in
        self.clock = clock
        keys, block_ids = transfer.keys, transfer.block_ids
        per_get = max(MAX_TAGGED_PARTS // len(layers), 1)
        self._gets: list[Found] = []
        for start in range(0, len(keys), per_get):
            ids, some = block_ids[start : start + per_get], keys[start : start + per_get]
            on_part = self._on_part(len(self._gets))
            self._landed.append(0)
            try:
                found = None
                if placed is not None:  # None where a row is not shared
                    ns = transfer.namespace_id
                    found = dataplane.submit_get_placed(ns, some, placed, ids, on_part)
                if found is None:
                    parts = [[layer[b] for b in ids] for layer in layers]
                    found = dataplane.submit_get_parts(
                        transfer.namespace_id, some, parts, block_bytes, on_part
                    )
            except KVStoreError as exc:  # closed under it (another thread's call failed)
                found = failed(exc)
            found.add_done_callback(self._notify)
            self._gets.append(found)
        self.clock.lap("submit")
        self.clock.skip()  # from here the load runs beside the forward pass

    def _on_part(self, get: int) -> Any:
        def landed(part: int) -> None:  # on the data plane's thread
            with self._cond:
                self._landed[get] = part + 1
                self._cond.notify_all()

        return landed

    def _notify(self, _: Found) -> None:
        with self._cond:
            self._cond.notify_all()

    def _has(self, layer: int) -> bool:
        return all(n > layer or get.done() for n, get in zip(self._landed, self._gets, strict=True))

    def wait_layer(self, layer: int) -> None:
        """Returns once layer `layer` of every block has landed, or the load has ended
        (failed: `finish` says which blocks are whole), or `wait_s` has passed."""
        assert 0 <= layer < self._num_layers, f"layer {layer} of {self._num_layers}"
        with self._cond:
            if self._has(layer):
                return
            self.clock.skip()
            self._cond.wait_for(lambda: self._has(layer), self._wait_s)
        self.clock.lap("wait")
        self.clock.skip()

    def finish(self) -> LoadResult:
        """Waits for the whole load (every GET of it: none writes into the pages after);
        the blocks, from the first, that arrived whole, and the error that cut it short
        (None when blocks were only missed)."""
        self.clock.skip()
        results = [outcome(found, self._wait_s) for found in self._gets]
        self.clock.lap("transfer")
        num_ok, error = 0, None
        for flags, error in results:
            num = loaded_prefix_len(flags)
            num_ok += num
            if error is not None or num < len(flags):
                break
        return LoadResult(num_ok, self.clock.done(num_ok, num_ok * self.block_bytes), error)


def failed(exc: BaseException) -> Found:
    """A get that ended in `exc` before it started."""
    found: Found = concurrent.futures.Future()
    found.set_exception(exc)
    return found


def outcome(
    found: Found, timeout_s: float | None = None
) -> tuple[tuple[bool, ...], BaseException | None]:
    """A get's flags, or no flags and the error that ended it."""
    try:
        return found.result(timeout=timeout_s), None
    except Exception as exc:  # whatever broke, this get's blocks were not filled
        return (), exc
