"""Worker-side loads of the vLLM connector: store blocks into vLLM's paged KV cache.

Every fixed cost is paid once, at start-up (`warm_up`): the data-plane connection and its
own first-call costs (`DataPlaneClient.warm_up`: over shared memory, its staging region
grown to size and touched), a staging pool of `num_buffers` host blocks allocated and
touched once (no page faults on a request's critical path; on the host, in memory shared
with a node on the same host, so gets land in it with no copy on this side), the numpy
views the transport takes, and one transfer into every staging block (the first receive
into a buffer costs more than later ones: measured 2-3x on a 2-core host, the transport's
own set-up for that memory) of a block of the process's own under a random key, removed
after. A load runs in chunks of half the pool, pipelined: while chunk k is copied into the
paged layers, chunk k+1 is already landing in the other half.

    pool:  [ half 0 | half 1 ]      chunk k lands in half k % 2
    time:  get 0 | get 1        | get 2 ...
                 | scatter 0    | scatter 1 ...

Where vLLM's pages keep each layer's part of a block contiguous in host memory (its CPU
layout), loads need neither pool nor scatter: each layer's part lands straight in its page
(a GET in parts, `layer_load`). With a node on this host the warm-up also shares those
pages with it in place (`Client.share`: same addresses, same bytes, moved onto memory the
node maps, every page mapped on both sides as it is shared), so the node copies each part
straight into vLLM's page and this side only checks it. `load` does that before
the forward pass; `start_layers` beside it, layer by layer.

With a pool (`PoolClient`), a load whose blocks are all on the node beside the engine goes
as above; one the scheduler found partly on other nodes (`BlockTransfer.remote`) goes
through the staging pool before the forward pass, each chunk read by the pool client
(what the node beside the engine holds first, the rest from every node that holds it, at
once), then copied into vLLM's pages.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstore.client import Client
from kvstore.client.pool_client import PoolClient
from kvstore.dataplane.shm.client import ShmClient
from kvstore.dataplane.shm.placed_rows import PlacedRows
from kvstore.errors import KVStoreError, NotFoundError
from kvstore.integrations.load_phases import LoadPhases, LoadResult, PhaseClock
from kvstore.integrations.loaded_prefix import loaded_prefix_len
from kvstore.integrations.vllm.blocks import PagedBlocks
from kvstore.integrations.vllm.layer_load import Found, LayerLoad, failed, outcome
from kvstore.integrations.vllm.log_routing import CONNECTOR_LOG
from kvstore.integrations.vllm.plan import BlockTransfer
from kvstore.keys import KEY_BYTES, ChainPosition

log = logging.getLogger(CONNECTOR_LOG)
WARM_UP_IN_FLIGHT = 8  # gets at once; ucxx warns when many more wait on its futures pool
LAYER_WAIT_MARGIN_S = 5.0  # a layer wait outlasts the data plane's deadline by this much


class _Chunk(NamedTuple):
    start: int  # index of its first block in the load
    half: int  # which half of the pool it lands in
    found: Found


class BlockLoader:
    """Loads blocks through a fixed staging pool; one load at a time (the worker's thread).

    Args:
        client: the store client (its data plane, or its gRPC path where it has none).
        paged: vLLM's paged KV tensors.
        num_buffers: staging blocks (even, >= 2); a chunk is half of them.
        by_layer: let `start_layers` load layer by layer where the layout allows.
        share_pages: share vLLM's pages with a node on this host where the layout allows
            (`warm_up`), so loads land in them straight; off, loads go through the pool.
        pool: the pool `client`'s node belongs to: reads the loads the scheduler found
            partly on other nodes.
    """

    def __init__(
        self,
        client: Client,
        paged: PagedBlocks,
        num_buffers: int,
        by_layer: bool = False,
        share_pages: bool = True,
        pool: PoolClient | None = None,
    ) -> None:
        assert num_buffers >= 2 and num_buffers % 2 == 0, "the pool is two equal halves"
        self._client = client
        self._pool_client = pool
        self._paged = paged
        self.chunk_blocks = num_buffers // 2
        self._pool = paged.empty(num_buffers)  # (num_buffers, layers, layer_elems)
        self._buffers = PagedBlocks.as_buffers(self._pool)  # one uint8 view per block
        self._is_cuda = paged.layers[0].is_cuda
        self._layer_rows = paged.layer_rows()  # None where no layer's block is contiguous
        self._by_layer, self._share_pages = by_layer, share_pages
        self.shared_bytes = 0  # of vLLM's pages, shared with a node on this host (`warm_up`)
        self._shared_with: Any = None  # the data-plane connection they are shared over
        self._placed: PlacedRows | None = None  # the pages' rows placed in it, once

    def start_layers(self, transfer: BlockTransfer) -> LayerLoad | None:
        """Starts `transfer` straight into vLLM's pages, layer by layer, beside the forward
        pass (`layer_load`), where the path and the layout allow: the data plane, and
        host pages that keep each layer's part of a block contiguous. None elsewhere: then
        `load`, before the forward pass."""
        if not self._by_layer or self._is_remote(transfer):
            return None
        return self._start_parts(transfer)

    def _is_remote(self, transfer: BlockTransfer) -> bool:
        return self._pool_client is not None and transfer.remote

    def _start_parts(self, transfer: BlockTransfer) -> LayerLoad | None:
        if self._layer_rows is None:
            return None
        clock = PhaseClock()
        try:
            dataplane = self._client.data_plane()
        except KVStoreError:  # transport "ucx" and no data plane now: `load` says so
            return None
        clock.lap("connect")
        if dataplane is None:
            return None
        if self._shared_with is not None and dataplane is not self._shared_with:
            self._share_again(dataplane)  # a new connection (the node restarted)
            clock.lap("share")
        wait_s = self._client.timeout_s + LAYER_WAIT_MARGIN_S
        placed = self._placed if self._shared_with is dataplane else None
        rows, block_bytes = self._layer_rows, self._paged.block_bytes
        return LayerLoad(dataplane, transfer, rows, block_bytes, wait_s, clock, placed)

    def _share_again(self, dataplane: Any) -> None:
        """Shares the pages with the node of a new connection, as `warm_up` did with the
        last one (whose node is gone): otherwise every load would go through staging."""
        assert self._layer_rows is not None
        self._shared_with = dataplane
        try:
            self._share_pages_with(dataplane)
        except KVStoreError as exc:  # loads still land, through the plane's staging
            log.warning("event=share_failed error=%s", type(exc).__name__)
        log.info("event=pages_shared_again bytes=%d", self.shared_bytes)

    def _share_pages_with(self, dataplane: Any) -> None:
        """Shares vLLM's pages with the node of `dataplane` (none on another host) and
        places their rows there once for every load (`PlacedRows`)."""
        assert self._layer_rows is not None
        self._placed = None
        self.shared_bytes = self._client.share(self._layer_rows)  # 0 on another host
        if self.shared_bytes and isinstance(dataplane, ShmClient):
            self._placed = dataplane.place(self._layer_rows)

    def warm_up(self, namespace_id: bytes | None = None) -> LoadPhases:
        """Connects the data plane, touches every staging page and, given a registered
        namespace of the same block size, receives a block into every staging block;
        returns what each took. Raises what the store raised."""
        clock = PhaseClock()
        dataplane = self._client.data_plane()  # None on the gRPC path: nothing to connect
        clock.lap("connect")
        if dataplane is not None:
            dataplane.warm_up()
        if dataplane is not None and self._layer_rows is not None and self._share_pages:
            self._share_pages_with(dataplane)
            self._shared_with = dataplane if self.shared_bytes else None
            clock.lap("share")
        if not self._is_cuda:  # with a node on this host, gets land in the pool uncopied
            self._pool = _host_pool(self._client, self._pool)
            self._buffers = PagedBlocks.as_buffers(self._pool)
        self._pool.view(torch.uint8).fill_(0)  # first touch, here rather than mid-load
        clock.lap("stage")
        num_bytes = self._pool.numel() * self._pool.element_size()
        if dataplane is not None and namespace_id is not None:
            # The staging blocks only: vLLM's shared pages were mapped as they were shared.
            self._receive_into_staging(dataplane, namespace_id)
            clock.lap("transfer")
        return clock.done(0, num_bytes)

    def _receive_into_staging(self, dataplane: Any, namespace_id: bytes) -> None:
        """One block of the process's own, received into each staging block by pipelined
        gets (a call's keys are distinct), then removed: it takes one block of the store's
        space, briefly. First receives into memory cost more than later ones (page faults;
        the transport's own set-up): paid here, not mid-load."""
        key = secrets.token_bytes(KEY_BYTES)  # no other process's block, nor a prompt's
        self._client.put(namespace_id, [key], [self._buffers[0]])
        try:
            block_bytes = self._buffers[0].nbytes
            for start in range(0, len(self._buffers), WARM_UP_IN_FLIGHT):
                gets = [
                    dataplane.submit_get_parts(namespace_id, [key], [[block]], block_bytes)
                    for block in self._buffers[start : start + WARM_UP_IN_FLIGHT]
                ]
                if not all(all(get.result()) for get in gets):
                    raise NotFoundError("the warm-up block went missing (evicted?)")
        finally:
            self._client.remove(namespace_id, [key])

    def load(self, transfer: BlockTransfer) -> LoadResult:
        """Receives `transfer`'s blocks and writes the received prefix into its vLLM blocks.

        Stops at the first block not found; waits for every transfer it started before it
        returns, so the pool is free again.
        """
        remote = self._is_remote(transfer)
        if self.shared_bytes and not remote:  # straight into vLLM's pages, shared with the node
            direct = self._start_parts(transfer)
            if direct is not None:
                return direct.finish()
        clock = PhaseClock()
        try:
            dataplane = None if remote else self._client.data_plane()
        except KVStoreError as exc:  # transport "ucx" and no data plane now
            return LoadResult(0, clock.done(0, 0), exc)
        clock.lap("connect")
        pending: deque[_Chunk] = deque()
        for k in range(min(2, self._num_chunks(transfer))):
            pending.append(self._submit(dataplane, transfer, k))
        clock.lap("submit")
        num_ok, error = 0, None
        while pending:
            chunk = pending.popleft()
            found, error = outcome(chunk.found)
            clock.lap("transfer")
            num_chunk = loaded_prefix_len(found)
            self._scatter(transfer, chunk, num_chunk)
            clock.lap("scatter")
            num_ok += num_chunk
            if num_chunk < len(found) or error is not None:
                _drain(pending)  # the pool is reused by the next load
                clock.lap("transfer")
                break
            k = chunk.start // self.chunk_blocks + 2
            if k < self._num_chunks(transfer):
                pending.append(self._submit(dataplane, transfer, k))
                clock.lap("submit")
        return LoadResult(num_ok, clock.done(num_ok, num_ok * self._paged.block_bytes), error)

    def _num_chunks(self, transfer: BlockTransfer) -> int:
        return -(-len(transfer.keys) // self.chunk_blocks)

    def _half(self, half: int, num: int) -> slice:
        start = half * self.chunk_blocks
        return slice(start, start + num)

    def _submit(self, dataplane: Any, transfer: BlockTransfer, k: int) -> _Chunk:
        start = k * self.chunk_blocks
        keys = transfer.keys[start : start + self.chunk_blocks]
        buffers = self._buffers[self._half(k % 2, len(keys))]
        if dataplane is None and self._is_remote(transfer):
            assert self._pool_client is not None
            found = _get_from_pool(self._pool_client, transfer, start, buffers)
            return _Chunk(start, k % 2, found)
        return _Chunk(start, k % 2, _get(self._client, dataplane, transfer, keys, buffers))

    def _scatter(self, transfer: BlockTransfer, chunk: _Chunk, num: int) -> None:
        if not num:
            return
        block_ids = transfer.block_ids[chunk.start : chunk.start + num]
        self._paged.scatter(self._pool[self._half(chunk.half, num)], block_ids)
        if self._is_cuda:  # the copy reads the pinned half; the next get overwrites it
            torch.cuda.current_stream(self._paged.layers[0].device).synchronize()


def _get(
    client: Client,
    dataplane: Any,
    transfer: BlockTransfer,
    keys: Sequence[bytes],
    buffers: Sequence[np.ndarray],
) -> Found:
    """The data plane's pipelined get; on the gRPC path, a get done before it returns."""
    if dataplane is None:
        return _done(lambda: client.get_into(transfer.namespace_id, keys, buffers))
    try:
        block_bytes = buffers[0].nbytes
        return dataplane.submit_get_into(transfer.namespace_id, keys, buffers, block_bytes)
    except Exception as exc:  # reported through the future, as the data plane's own are
        return failed(exc)


def _get_from_pool(
    pool: PoolClient, transfer: BlockTransfer, start: int, buffers: Sequence[np.ndarray]
) -> Found:
    """Blocks `start`.. of `transfer` (as many as `buffers`), read by the pool client before
    it returns (what no node gives back is a miss)."""
    keys = transfer.keys[start : start + len(buffers)]
    position = ChainPosition.of(transfer.keys, start, transfer.position)
    return _done(lambda: pool.get_into(transfer.namespace_id, keys, buffers, position))


def _done(get: Callable[[], tuple[bool, ...]]) -> Found:
    """A blocking get, done now, as a future: its hits, or what it raised."""
    try:
        found = get()
    except Exception as exc:  # reported through the future, as the data plane's own are
        return failed(exc)
    done: Found = concurrent.futures.Future()
    done.set_result(found)
    return done


def _host_pool(client: Client, pool: torch.Tensor) -> torch.Tensor:
    """A pool like `pool` in `client.buffer` memory: shared with a node on this host."""
    memory = torch.from_numpy(client.buffer(pool.numel() * pool.element_size()))
    return memory.view(pool.dtype).reshape(pool.shape)


def _drain(pending: deque[_Chunk]) -> None:
    while pending:
        outcome(pending.popleft().found)
