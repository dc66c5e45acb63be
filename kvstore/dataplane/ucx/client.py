"""The client's UCX side: one worker and one endpoint to one store node.

The gRPC handshake (a callable, so this module never sees protobuf) trades this worker's
address for the node's, a connection id and the connection's secret, from which every tag
is derived (`frames.Tags`). Calls from any thread run on the client's own UCX loop; several
calls in flight at once are pipelined over the one endpoint. An idle client pings, so the
node keeps the connection. Every block a get receives is checked against the CRC32C the
node sent for it; one that fails is reported missed, never as found.

A put is eager (`frames.Request.eager`: its blocks follow the request at once, without
waiting a round trip for the reply) once the node has taken a put of that namespace and
block size, unless most blocks of the namespace's last put were present already: then only
the reserved ones are sent, after the reply, so present blocks cost no bandwidth.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvstore import errors
from kvstore.checksum import checksums
from kvstore.dataplane import frames
from kvstore.dataplane.base import Admission, DataPlaneClient
from kvstore.dataplane.buffers import TransferBuffer, checked_buffers, host_bytes
from kvstore.dataplane.frames import STATUS_CODES, Op, Reply, Request, RequestTags
from kvstore.dataplane.ucx import transfers
from kvstore.dataplane.ucx.runtime import UcxRuntime, with_deadline
from kvstore.results import PutStatus, ReserveResult

log = logging.getLogger("kvstore.dataplane")
T = TypeVar("T")
Handshake = Callable[[bytes], tuple[bytes, Admission]]  # my worker address -> server's, mine
KEEPALIVE_S = 30.0  # well inside the node's idle timeout (`ServerSettings.idle_timeout_s`)


class UcxClient(DataPlaneClient):
    """Gets into and puts from caller buffers over UCX; every call has a deadline.

    `net_devices`: UCX_NET_DEVICES of this client's worker ("lo" keeps it on loopback).
    """

    plane = "ucx"

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
        # (namespace, block size) the node took a put of, and whether to send eagerly.
        self._eager: dict[tuple[bytes, int], bool] = {}
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
        """Says CLOSE to the node and closes the endpoint. Never raises: a node that is gone
        (the CLOSE cannot be sent) has nothing left to free."""
        if self._ep is None:
            return
        try:
            close = Request(Op.CLOSE, next(self._ids), b"", (), 0)
            self._rt.call(self._send_request(close), timeout_s=1.0)
        except errors.KVStoreError:
            pass  # the server frees the connection's state at its deadlines anyway
        except Exception as exc:  # UCX's own: the connection was reset, the node is gone
            log.info("event=ucx_close client=%d peer=gone error=%s", self.client_id, exc)
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
        return self._submit(self._get(req, [bufs]))

    def submit_get_parts(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parts: Sequence[Sequence[Any]],
        block_bytes: int,
        on_part: Callable[[int], None] | None = None,
    ) -> concurrent.futures.Future[tuple[bool, ...]]:
        frames.check_segments(len(keys), block_bytes, len(parts))
        bufs = [
            self._checked_buffers(keys, part, block_bytes // len(parts), writable=True)
            for part in parts
        ]
        req = Request(
            Op.GET, next(self._ids), namespace_id, tuple(keys), block_bytes, segments=len(parts)
        )
        return self._submit(self._get(req, bufs, on_part))

    def submit_put(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes | None] | None,
        block_bytes: int,
    ) -> concurrent.futures.Future[ReserveResult]:
        bufs = self._checked_buffers(keys, blocks, block_bytes, writable=False)
        sums = _checksums(bufs)
        parents_t = tuple(parents) if parents is not None else None
        eager = self._eager.get((namespace_id, block_bytes), False)
        req = Request(
            Op.PUT, next(self._ids), namespace_id, tuple(keys), block_bytes, parents_t, sums, eager
        )
        return self._submit(self._put(req, bufs))

    def _checked_buffers(
        self, keys: Sequence[bytes], buffers: Sequence[Any], block_bytes: int, writable: bool
    ) -> list[TransferBuffer]:
        bufs = checked_buffers(keys, buffers, block_bytes, writable)
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
        await transfers.wait_all(self._send_request_with(req, [], []))

    def _send_request_with(self, req: Request, blocks: list[Any], tags: list[int]) -> list[Any]:
        """Posts the request frame and, behind it, `blocks` under `tags`, in one pass."""
        frame = frames.encode_request(req)
        return transfers.post_sends(self._ep, [frame, *blocks], [self._tags.request, *tags])

    def _post_reply(self, tag: int, num_keys: int) -> tuple[transfers.Posted, bytearray]:
        buf = bytearray(frames.reply_bytes(num_keys))
        return transfers.post_receives(self._ep, [buf], [tag])[0], buf

    async def _reply(
        self,
        posted: tuple[transfers.Posted, bytearray],
        num_keys: int,
        with_checksums: bool = False,
    ) -> Reply:
        request, buf = posted
        await transfers.wait_one(request)
        reply = frames.decode_reply(memoryview(buf), num_keys, with_checksums)
        if reply.error is not None:
            raise reply.error
        return reply

    async def _get(
        self,
        req: Request,
        parts: list[list[TransferBuffer]],
        on_part: Callable[[int], None] | None = None,
    ) -> tuple[bool, ...]:
        """`parts[s][i]`: where part s of key i lands (a single part: the whole block)."""
        tags = RequestTags.of(self._tags, req.request_id)
        posted = self._post_reply(tags.reply, len(req.keys))
        sent = self._send_request_with(req, [], [])
        reply = await self._reply(posted, len(req.keys), True)
        await transfers.wait_all(sent)  # done: the node answered it
        hits = [i for i, f in enumerate(reply.flags) if f]
        if any(f not in (0, 1) for f in reply.flags) or len(reply.checksums) != len(hits):
            raise errors.UnavailableError("data-plane get reply is malformed")
        num_keys = len(req.keys)
        targets = [part[i] for part in parts for i in hits]
        receives = transfers.post_receives(
            self._ep,
            [b.obj for b in targets],
            [tags.block(s * num_keys + i) for s in range(len(parts)) for i in hits],
        )
        # Each part is summed as it lands, while the later ones are still on their way; a
        # block's sum continues over its parts in order and is whole with its last part.
        sums = [0] * len(hits)
        for s in range(len(parts)):
            part = slice(s * len(hits), (s + 1) * len(hits))
            sums = await transfers.summed(receives[part], targets[part], host_bytes, sums)
            if on_part is not None:
                on_part(s)
        found = [False] * len(req.keys)
        for i, crc, want in zip(hits, sums, reply.checksums, strict=True):
            found[i] = crc == want
            if crc != want:
                self.checksum_failures += 1
                log.warning("event=ucx_checksum_failure client=%d", self.client_id)
        return tuple(found)

    async def _put(self, req: Request, bufs: list[TransferBuffer]) -> ReserveResult:
        tags = RequestTags.of(self._tags, req.request_id)
        posted = self._post_reply(tags.reply, len(req.keys))
        every = range(len(req.keys)) if req.eager else range(0)
        sends = self._send_request_with(
            req, [bufs[i].obj for i in every], [tags.block(i) for i in every]
        )
        try:
            reply = await self._reply(posted, len(req.keys))
        except errors.KVStoreError:
            await transfers.wait_all(sends)  # the node drains what an eager put sent
            raise
        if any(f >= len(STATUS_CODES) for f in reply.flags):
            raise errors.UnavailableError("data-plane put reply is malformed")
        statuses = tuple(STATUS_CODES[f] for f in reply.flags)
        self._learn(req, statuses)
        done = self._post_reply(tags.done, 0)
        if not req.eager:
            reserved = [i for i, s in enumerate(statuses) if s is PutStatus.RESERVED]
            sends += transfers.post_sends(
                self._ep, [bufs[i].obj for i in reserved], [tags.block(i) for i in reserved]
            )
        await transfers.wait_all(sends)
        await self._reply(done, 0)
        return ReserveResult(reply.reservation_id, statuses)

    def _learn(self, req: Request, statuses: tuple[PutStatus, ...]) -> None:
        """Eager from now on for this namespace and size, unless most blocks were present."""
        num_reserved = statuses.count(PutStatus.RESERVED)
        self._eager[req.namespace_id, req.block_bytes] = 2 * num_reserved >= len(statuses)


def _checksums(bufs: list[TransferBuffer]) -> tuple[int, ...]:
    if any(b.is_device for b in bufs):
        raise errors.InvalidArgumentError("put from device memory is not supported yet")
    return tuple(checksums(b.obj for b in bufs))
