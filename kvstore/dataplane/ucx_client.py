"""The client's UCX side: one worker and one endpoint to one store node.

The gRPC handshake (a callable, so this module never sees protobuf) trades this worker's
address for the node's, a connection id and the connection's secret, from which every tag
is derived (`frames.Tags`). Calls from any thread run on the client's own UCX loop; several
calls in flight at once are pipelined over the one endpoint. An idle client pings, so the
node keeps the connection. Every block a get receives is checked against the CRC32C the
node sent for it; one that fails is reported missed, never as found.
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
from kvstore.dataplane.base import Admission, DataPlaneClient
from kvstore.dataplane.buffers import TransferBuffer, as_transfer_buffer, host_bytes
from kvstore.dataplane.frames import Op, Reply, Request, RequestTags
from kvstore.dataplane.runtime import UcxRuntime, with_deadline
from kvstore.dataplane.ucx_server import STATUS_CODES
from kvstore.keys import KEY_BYTES
from kvstore.results import PutStatus, ReserveResult

log = logging.getLogger("kvstore.dataplane")
T = TypeVar("T")
Handshake = Callable[[bytes], tuple[bytes, Admission]]  # my worker address -> server's, mine
KEEPALIVE_S = 30.0  # well inside the node's idle timeout (`ServerSettings.idle_timeout_s`)


class UcxClient(DataPlaneClient):
    """Gets into and puts from caller buffers over UCX; every call has a deadline.

    `net_devices`: UCX_NET_DEVICES of this client's worker ("lo" keeps it on loopback).
    """

    def __init__(
        self,
        handshake: Handshake,
        timeout_s: float = 30.0,
        error_handling: bool = False,
        net_devices: str = "",
    ) -> None:
        self.timeout_s = timeout_s
        self.checksum_failures = 0  # received blocks that did not match the node's CRC32C
        self._rt = UcxRuntime(
            "kvstore-ucx-client", {"NET_DEVICES": net_devices} if net_devices else None
        )
        self._ids = itertools.count(1)
        self._ep: Any = None
        try:
            server_address, admission = handshake(self._rt.worker_address)
            self.client_id = admission.client_id
            self._tags = frames.Tags(admission.secret)
            self._ep = self._rt.call(self._connect(server_address, error_handling), timeout_s)
            self._rt.call(self._send_request(self._ping()), timeout_s)
            self._rt.loop.call_soon_threadsafe(self._schedule_ping)
        except BaseException:
            self._abort()
            raise

    async def _connect(self, server_address: bytes, error_handling: bool) -> Any:
        address = self._rt.ucxx.get_ucx_address_from_buffer(server_address)
        return await self._rt.ctx.create_endpoint_from_worker_address(
            address, endpoint_error_handling=error_handling
        )

    @property
    def is_open(self) -> bool:
        return self._ep is not None

    def _ping(self) -> Request:
        return Request(Op.PING, next(self._ids), b"", (), 0)

    def _schedule_ping(self) -> None:
        """Pings every KEEPALIVE_S, on the runtime's loop, until the endpoint closes."""
        if self._ep is not None:
            self._rt.loop.call_later(KEEPALIVE_S, self._ping_now)

    def _ping_now(self) -> None:
        if self._ep is not None:
            ping = with_deadline(self._send_request(self._ping()), self.timeout_s)
            asyncio.ensure_future(ping).add_done_callback(lambda f: f.exception())
            self._schedule_ping()

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
        await self._ep.send(data, tag=self._tags.request, force_tag=True)

    async def _recv_reply(self, tag: int, num_keys: int, with_checksums: bool = False) -> Reply:
        buf = bytearray(frames.reply_bytes(num_keys))
        await self._ep.recv(buf, tag=tag, force_tag=True)
        reply = frames.decode_reply(memoryview(buf), num_keys, with_checksums)
        if reply.error is not None:
            raise reply.error
        return reply

    async def _get(self, req: Request, bufs: list[TransferBuffer]) -> tuple[bool, ...]:
        tags = RequestTags.of(self._tags, req.request_id)
        reply_f = asyncio.ensure_future(self._recv_reply(tags.reply, len(req.keys), True))
        await self._send_request(req)
        reply = await reply_f
        hits = [i for i, f in enumerate(reply.flags) if f]
        if any(f not in (0, 1) for f in reply.flags) or len(reply.checksums) != len(hits):
            raise errors.UnavailableError("data-plane get reply is malformed")
        intact = await asyncio.gather(
            *(
                self._receive_block(bufs[i], tags.block(i), crc)
                for i, crc in zip(hits, reply.checksums, strict=True)
            )
        )
        found = [False] * len(req.keys)
        for i, ok in zip(hits, intact, strict=True):
            found[i] = ok
        return tuple(found)

    async def _receive_block(self, buf: TransferBuffer, tag: int, crc: int) -> bool:
        """Receives one block; whether its bytes match `crc` (summed as it lands, while
        later blocks are still on their way)."""
        await self._ep.recv(buf.obj, tag=tag, force_tag=True)
        if checksum(host_bytes(buf)) == crc:
            return True
        self.checksum_failures += 1
        log.warning("event=ucx_checksum_failure client=%d", self.client_id)
        return False

    async def _put(self, req: Request, bufs: list[TransferBuffer]) -> ReserveResult:
        tags = RequestTags.of(self._tags, req.request_id)
        await self._send_request(req)
        reply = await self._recv_reply(tags.reply, len(req.keys))
        if any(f >= len(STATUS_CODES) for f in reply.flags):
            raise errors.UnavailableError("data-plane put reply is malformed")
        statuses = tuple(STATUS_CODES[f] for f in reply.flags)
        done = asyncio.ensure_future(self._recv_reply(tags.done, 0))
        await asyncio.gather(
            *(
                self._ep.send(bufs[i].obj, tag=tags.block(i), force_tag=True)
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
