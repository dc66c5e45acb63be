"""The client's UCX side: one worker and one endpoint to one store node.

The gRPC handshake (a callable, so this module never sees protobuf) trades this worker's
address for the node's and a connection id. Calls from any thread run on the client's
own UCX loop; several calls in flight at once are pipelined over the one endpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.dataplane import frames
from kvstore.dataplane.base import DataPlaneClient
from kvstore.dataplane.buffers import TransferBuffer, as_transfer_buffer
from kvstore.dataplane.frames import Kind, Op, Reply, Request
from kvstore.dataplane.runtime import UcxRuntime, with_deadline
from kvstore.dataplane.ucx_server import STATUS_CODES
from kvstore.keys import KEY_BYTES
from kvstore.results import PutStatus, ReserveResult

log = logging.getLogger("kvstore.dataplane")
T = TypeVar("T")
Handshake = Callable[[bytes], tuple[bytes, int]]  # my worker address -> (server's, my id)


class UcxClient(DataPlaneClient):
    """Gets into and puts from caller buffers over UCX; every call has a deadline."""

    def __init__(
        self, handshake: Handshake, timeout_s: float = 30.0, error_handling: bool = False
    ) -> None:
        self.timeout_s = timeout_s
        self._rt = UcxRuntime("kvstore-ucx-client")
        self._ids = itertools.count()
        self._ep: Any = None
        try:
            server_address, self.client_id = handshake(self._rt.worker_address)
            self._ep = self._rt.call(self._connect(server_address, error_handling), timeout_s)
        except BaseException:
            self._rt.stop()
            raise

    async def _connect(self, server_address: bytes, error_handling: bool) -> Any:
        address = self._rt.ucxx.get_ucx_address_from_buffer(server_address)
        return await self._rt.ctx.create_endpoint_from_worker_address(
            address, endpoint_error_handling=error_handling
        )

    @property
    def is_open(self) -> bool:
        return self._ep is not None

    def close(self) -> None:
        if self._ep is None:
            return
        try:
            close = Request(Op.CLOSE, next(self._ids), b"", (), 0)
            self._rt.call(self._send_request(close), timeout_s=1.0)
        except errors.KVStoreError:
            pass  # the server frees the connection's state at its deadlines anyway
        finally:
            self._abort()

    def _abort(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            self._rt.loop.call_soon_threadsafe(lambda: ep.abort(period=10**8))
        self._rt.stop()

    # -- calls ---------------------------------------------------------------------------

    def submit_get_into(
        self, namespace_id: bytes, keys: Sequence[bytes], buffers: Sequence[Any], block_bytes: int
    ) -> concurrent.futures.Future[tuple[bool, ...]]:
        bufs = self._checked_buffers(keys, buffers, block_bytes, writable=True)
        req = Request(Op.GET, next(self._ids), namespace_id, tuple(keys), block_bytes)
        return self._submit(self._get(req, bufs))

    def submit_put(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes | None] | None,
        block_bytes: int,
    ) -> concurrent.futures.Future[ReserveResult]:
        bufs = self._checked_buffers(keys, blocks, block_bytes, writable=False)
        checksums = tuple(_checksum(b) for b in bufs)
        parents_t = tuple(parents) if parents is not None else None
        req = Request(
            Op.PUT, next(self._ids), namespace_id, tuple(keys), block_bytes, parents_t, checksums
        )
        return self._submit(self._put(req, bufs))

    def _checked_buffers(
        self, keys: Sequence[bytes], buffers: Sequence[Any], block_bytes: int, writable: bool
    ) -> list[TransferBuffer]:
        if len(keys) != len(buffers):
            raise errors.InvalidArgumentError(f"{len(buffers)} buffers for {len(keys)} keys")
        frames.check_num_blocks(len(keys))
        bad = [i for i, k in enumerate(keys) if len(k) != KEY_BYTES]
        if bad:
            raise errors.BadKeyError(f"keys {bad[:8]} are not {KEY_BYTES} bytes long")
        bufs = [as_transfer_buffer(b, writable) for b in buffers]
        wrong = [i for i, b in enumerate(bufs) if b.nbytes != block_bytes]
        if wrong:
            raise errors.PayloadSizeError(
                f"buffers {wrong[:8]} are not {block_bytes} bytes (the namespace's block size)"
            )
        if self._ep is None:
            raise errors.UnavailableError("data-plane connection is closed")
        return bufs

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return self._rt.submit(self._guarded(coro))

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` under the deadline; a timeout or transport error closes the endpoint
        (cancelling receives into caller buffers) and raises a typed error."""
        try:
            return await with_deadline(coro, self.timeout_s)
        except errors.KVStoreError as exc:
            if isinstance(exc, errors.DeadlineExceededError):
                self._fail()
            raise
        except Exception as exc:
            self._fail()
            raise errors.UnavailableError(f"data-plane transfer failed: {exc!r}") from exc

    def _fail(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            ep.abort(period=10**8)

    # -- protocol ------------------------------------------------------------------------

    async def _send_request(self, req: Request) -> None:
        data = frames.encode_request(req)
        await self._ep.send(data, tag=frames.tag(Kind.REQUEST, self.client_id), force_tag=True)

    async def _recv_reply(self, req: Request, kind: Kind, num_keys: int) -> Reply:
        buf = bytearray(frames.reply_bytes(num_keys))
        tag = frames.tag(kind, self.client_id, req.request_id)
        await self._ep.recv(buf, tag=tag, force_tag=True)
        reply = frames.decode_reply(memoryview(buf), num_keys)
        if reply.error is not None:
            raise reply.error
        return reply

    def _block_tag(self, req: Request, index: int) -> int:
        return frames.tag(Kind.BLOCK, self.client_id, req.request_id, index)

    async def _get(self, req: Request, bufs: list[TransferBuffer]) -> tuple[bool, ...]:
        reply = asyncio.ensure_future(self._recv_reply(req, Kind.REPLY, len(req.keys)))
        await self._send_request(req)
        found = tuple(bool(f) for f in (await reply).flags)
        await asyncio.gather(
            *(
                self._ep.recv(bufs[i].obj, tag=self._block_tag(req, i), force_tag=True)
                for i, hit in enumerate(found)
                if hit
            )
        )
        return found

    async def _put(self, req: Request, bufs: list[TransferBuffer]) -> ReserveResult:
        await self._send_request(req)
        reply = await self._recv_reply(req, Kind.REPLY, len(req.keys))
        statuses = tuple(STATUS_CODES[f] for f in reply.flags)
        done = asyncio.ensure_future(self._recv_reply(req, Kind.DONE, 0))
        await asyncio.gather(
            *(
                self._ep.send(bufs[i].obj, tag=self._block_tag(req, i), force_tag=True)
                for i, s in enumerate(statuses)
                if s is PutStatus.RESERVED
            )
        )
        await done
        return ReserveResult(reply.reservation_id, statuses)


def _checksum(buf: TransferBuffer) -> int:
    if buf.is_device:
        raise errors.InvalidArgumentError("put from device memory is not supported yet")
    return checksum(buf.obj)
