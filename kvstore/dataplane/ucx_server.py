"""The store node's UCX side: one worker, one request loop per connected client.

Per request (all tags from `frames.tag`):

    GET  client -> REQUEST; server leases, -> REPLY (found flags), -> BLOCK i per hit
         straight from the slot (the block's device copy when the node has an HBM tier);
         the lease ends when every send has completed (the client has the bytes) or the
         transfer deadline passes.
    PUT  client -> REQUEST (keys, parents, checksums); server reserves, posts a receive into
         each reserved slot, -> REPLY (statuses); client -> BLOCK i; the server sums each
         slot as its block lands (so summing overlaps the rest of the transfer), compares
         every checksum, commits, -> DONE. A short or altered block aborts the whole reservation.

Requests are handled as concurrent tasks, so a small get never waits behind a large put.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.dataplane import frames
from kvstore.dataplane.base import DataPlaneServer
from kvstore.dataplane.buffers import as_transfer_buffer
from kvstore.dataplane.frames import Kind, Op, Reply, Request
from kvstore.dataplane.runtime import UcxRuntime, with_deadline
from kvstore.results import PutStatus
from kvstore.store import Store

log = logging.getLogger("kvstore.dataplane")
STATUS_CODES = (PutStatus.RESERVED, PutStatus.PRESENT, PutStatus.IN_FLIGHT)


class UcxServer(DataPlaneServer):
    """Serves `store` over a UCX worker on its own thread."""

    def __init__(self, store: Store, timeout_s: float = 30.0, error_handling: bool = False):
        self.store = store
        self.timeout_s = timeout_s
        self.error_handling = error_handling
        self._rt = UcxRuntime("kvstore-ucx-server")
        self._ids = itertools.count(1)
        self._endpoints: dict[int, Any] = {}
        self._loops: dict[int, asyncio.Task[None]] = {}
        self._max_request_bytes = frames.request_bytes(store.config.max_batch_keys)

    @property
    def address(self) -> bytes:
        return self._rt.worker_address

    def connect(self, client_address: bytes) -> int:
        client_id = next(self._ids) % frames.MAX_CLIENTS or next(self._ids)
        self._rt.call(self._accept(client_id, client_address), self.timeout_s)
        log.info("event=ucx_connect client=%d", client_id)
        return client_id

    def stop(self) -> None:
        for client_id in list(self._endpoints):
            self._rt.loop.call_soon_threadsafe(self._drop, client_id)
        self._rt.stop()

    async def _accept(self, client_id: int, client_address: bytes) -> None:
        address = self._rt.ucxx.get_ucx_address_from_buffer(client_address)
        ep = await self._rt.ctx.create_endpoint_from_worker_address(
            address, endpoint_error_handling=self.error_handling
        )
        self._endpoints[client_id] = ep
        self._loops[client_id] = asyncio.create_task(self._serve_client(client_id, ep))

    def _drop(self, client_id: int) -> None:
        """Forgets a client and cancels its in-flight transfers (before slots are freed)."""
        ep = self._endpoints.pop(client_id, None)
        loop_task = self._loops.pop(client_id, None)
        if loop_task is not None and loop_task is not asyncio.current_task():
            loop_task.cancel()
        if ep is not None:
            with contextlib.suppress(Exception):
                ep.abort(period=10**8)

    async def _serve_client(self, client_id: int, ep: Any) -> None:
        pending: set[asyncio.Task[None]] = set()
        while client_id in self._endpoints:
            buf = bytearray(self._max_request_bytes)
            await self._rt.ctx.recv(buf, frames.tag(Kind.REQUEST, client_id))
            try:
                req = frames.decode_request(memoryview(buf))
            except errors.InvalidArgumentError as exc:
                log.warning("event=ucx_bad_request client=%d error=%s", client_id, exc)
                continue
            if req.op is Op.CLOSE:
                log.info("event=ucx_disconnect client=%d", client_id)
                self._drop(client_id)
                return
            task = asyncio.create_task(self._handle(client_id, ep, req))
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def _handle(self, client_id: int, ep: Any, req: Request) -> None:
        try:
            if req.op is Op.GET:
                await self._get(client_id, ep, req)
            else:
                await self._put(client_id, ep, req)
        except errors.DeadlineExceededError:
            log.warning("event=ucx_timeout client=%d op=%s", client_id, req.op.name)
            self._drop(client_id)
        except Exception:
            log.exception("event=ucx_error client=%d op=%s", client_id, req.op.name)
            self._drop(client_id)

    async def _send(self, ep: Any, data: Any, tag: int) -> None:
        await ep.send(data, tag=tag, force_tag=True)

    async def _reply(self, client_id: int, ep: Any, req: Request, reply: Reply, kind: Kind) -> None:
        tag = frames.tag(kind, client_id, req.request_id)
        await with_deadline(self._send(ep, frames.encode_reply(reply), tag), self.timeout_s)

    def _check_block_bytes(self, req: Request) -> None:
        """Same errors as the gRPC path: short blocks are incomplete, long ones too big."""
        block_bytes = self.store.namespace(req.namespace_id).block_bytes
        if req.op is Op.PUT and req.block_bytes < block_bytes:
            raise errors.IncompleteWriteError(
                f"blocks of {req.block_bytes} bytes are not fully written; "
                f"each needs {block_bytes} bytes"
            )
        if req.block_bytes != block_bytes:
            raise errors.PayloadSizeError(
                f"{req.block_bytes}-byte buffers; the namespace's block size is {block_bytes}"
            )

    # -- get -----------------------------------------------------------------------------

    async def _get(self, client_id: int, ep: Any, req: Request) -> None:
        try:
            self._check_block_bytes(req)
            lease = self.store.acquire(req.namespace_id, req.keys, device=True)
        except errors.KVStoreError as exc:
            await self._reply(client_id, ep, req, Reply(error=exc), Kind.REPLY)
            return
        try:
            reply = Reply(frames.flags_of(lease.found), 0, req.block_bytes)
            sends = [
                self._send(
                    ep,
                    frames.encode_reply(reply),
                    frames.tag(Kind.REPLY, client_id, req.request_id),
                )
            ]
            sends += [
                self._send(
                    ep,
                    view if isinstance(view, memoryview) else as_transfer_buffer(view, False).obj,
                    frames.tag(Kind.BLOCK, client_id, req.request_id, i),
                )
                for i, view in enumerate(lease.views)
                if view is not None
            ]
            await with_deadline(asyncio.gather(*sends), self.timeout_s)
        except BaseException:
            self._drop(client_id)  # cancel sends that still read the slots
            raise
        finally:
            self.store.release(lease.lease_id)

    # -- put -----------------------------------------------------------------------------

    async def _put(self, client_id: int, ep: Any, req: Request) -> None:
        try:
            self._check_block_bytes(req)
            reserved = self.store.reserve(req.namespace_id, req.keys, req.parents)
        except errors.KVStoreError as exc:
            await self._reply(client_id, ep, req, Reply(error=exc), Kind.REPLY)
            return
        rid = reserved.reservation_id
        todo = [i for i, s in enumerate(reserved.statuses) if s is PutStatus.RESERVED]
        flags = tuple(STATUS_CODES.index(s) for s in reserved.statuses)
        try:
            receives = [
                asyncio.ensure_future(
                    self._receive_block(
                        ep,
                        self.store.reservation_view(rid, i),
                        frames.tag(Kind.BLOCK, client_id, req.request_id, i),
                    )
                )
                for i in todo
            ]
            await self._reply(client_id, ep, req, Reply(flags, rid, req.block_bytes), Kind.REPLY)
            crcs = await with_deadline(asyncio.gather(*receives), self.timeout_s)
        except BaseException:
            self._drop(client_id)  # cancel receives into the slots before they are freed
            self._abort_quietly(rid)
            raise
        await self._finish_put(client_id, ep, req, rid, dict(zip(todo, crcs, strict=True)))

    async def _receive_block(self, ep: Any, view: memoryview, tag: int) -> int:
        """Receives one block into its slot; returns the slot's CRC32C, summed on arrival
        (on this loop: a block sums in well under a millisecond, and the GIL is let go)."""
        await ep.recv(view, tag=tag, force_tag=True)
        return checksum(view)

    async def _finish_put(
        self, client_id: int, ep: Any, req: Request, rid: int, crcs: dict[int, int]
    ) -> None:
        try:
            for i, crc in crcs.items():
                self.store.mark_written(rid, i, crc)
            await asyncio.to_thread(self.store.commit, rid, req.checksums or None)
        except errors.KVStoreError as exc:
            self._abort_quietly(rid)
            log.warning("event=ucx_put_rejected client=%d error=%s", client_id, exc)
            await self._reply(client_id, ep, req, Reply(error=exc), Kind.DONE)
            return
        await self._reply(client_id, ep, req, Reply(), Kind.DONE)

    def _abort_quietly(self, rid: int) -> None:
        with contextlib.suppress(errors.KVStoreError):
            self.store.abort(rid)
