"""The store node's UCX side: one worker, one request loop per admitted connection.

Admission: a client hands its worker address to `DataPlaneInfo` (gRPC). The address is
checked in a separate process first (`address_check`: UCX aborts on a malformed one), the
connection gets a secret that every tag of it is derived from (`frames.Tags`), and it must
send a frame within `hello_timeout_s` and then at least every `idle_timeout_s` (clients
ping), or it is dropped. Connections are bounded in all and per peer.

Per request (tags from the connection's `frames.Tags`):

    GET  client -> REQUEST; server leases, -> REPLY (found flags and each found block's
         CRC32C), -> BLOCK i per hit straight from the slot (the block's device copy when
         the node has an HBM tier), or its parts in part-major order for a segmented GET
         (`frames`); the lease ends when every send has completed (the client has the
         bytes) or the transfer deadline passes.
    PUT  client -> REQUEST (keys, parents, checksums); server reserves, posts a receive into
         each reserved slot, -> REPLY (statuses); client -> BLOCK i; the server sums each
         slot as its block lands (so summing overlaps the rest of the transfer), compares
         every checksum, commits (one store call for the batch), -> DONE. A short or altered
         block aborts the whole reservation. An eager PUT (`Request.eager`) sends BLOCK i of
         every key right behind REQUEST, without waiting for REPLY: the server receives the
         blocks of keys it did not reserve (present, in flight; all of them if it refuses the
         request) into one scratch buffer and drops them. A request whose block size is not
         the namespace's is never drained: a client sends eagerly only sizes the node took.

Every batch of sends or receives is posted in one pass and awaited together (`transfers`).
Requests are handled as concurrent tasks, so a small get never waits behind a large put. A
frame that is malformed, too large for its buffer or reuses the id of a request in flight
ends the connection: only a holder of the secret can send one, so its client is broken.
Messages under tags no receive will match are dropped by the sweeper (`sweeper`), told
from the ones a connection may still receive by `expected`.

Tenants: a connection is bound at admission to the tenant its authenticated handshake
named, and every frame is for that tenant's `Caller` (`kvstore.tenancy.Tenants.caller`):
the namespace ids a frame names are the tenant's own, mapped as the gRPC calls map them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from kvstore import errors
from kvstore.dataplane import frames
from kvstore.dataplane.base import Admission, DataPlaneServer, ServerSettings
from kvstore.dataplane.buffers import as_transfer_buffer
from kvstore.dataplane.connections import Connection, Connections
from kvstore.dataplane.frames import STATUS_CODES, Op, Reply, Request, RequestTags
from kvstore.dataplane.ucx import transfers
from kvstore.dataplane.ucx.address_check import AddressChecker
from kvstore.dataplane.ucx.expected_tags import ExpectedTags
from kvstore.dataplane.ucx.runtime import UcxRuntime, with_deadline
from kvstore.dataplane.ucx.sweeper import Sweeper, Swept, sweep_forever
from kvstore.metrics import CallMetrics
from kvstore.results import PutStatus
from kvstore.store import Reservation, Store
from kvstore.tenancy import Tenants

log = logging.getLogger("kvstore.dataplane")
SWEEP_PERIOD_S = 0.05  # how often the worker's unmatched messages are looked at (`sweeper`)


class UcxServer(DataPlaneServer):
    """Serves `store` over a UCX worker on its own thread."""

    def __init__(
        self,
        store: Store,
        settings: ServerSettings | None = None,
        metrics: CallMetrics | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.store = store
        self.tenants = tenants or Tenants(None)  # None: a node without tenants
        self.settings = settings or ServerSettings()
        self.metrics = metrics  # plane "ucx": calls, bytes, rejections by error class
        self.timeout_s = self.settings.timeout_s
        ucx_config = {"NET_DEVICES": self.settings.net_devices} if self.settings.net_devices else {}
        self._rt = UcxRuntime("kvstore-ucx-server", ucx_config)
        self._checker = AddressChecker(ucx_config)
        self._connections = Connections(self.settings)
        self._max_request_bytes = frames.request_bytes(store.config.max_batch_keys)
        self._scratch = memoryview(bytearray(0))  # where drained blocks land (`_drain`)
        self._reaper = self._rt.submit(self._reap_forever())
        self._expected = ExpectedTags()  # touched on the loop thread only
        self.sweeper = Sweeper(self._rt.ctx.worker, self._expected.expects, self.timeout_s)
        self._sweeps = self._rt.submit(
            sweep_forever(self.sweeper, time.monotonic, self._on_sweep, SWEEP_PERIOD_S)
        )

    @property
    def address(self) -> bytes:
        return self._rt.worker_address

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def connect(self, client_address: bytes, peer: str, tenant: str = "") -> Admission:
        s = self.settings
        if not 0 < len(client_address) <= s.max_address_bytes:
            raise errors.InvalidArgumentError(
                f"client_address has {len(client_address)} bytes; 1 to {s.max_address_bytes}"
            )
        conn = self._connections.admit(peer, self.store, self.tenants.caller(tenant, peer))
        try:
            self._checker.check(client_address)
            self._rt.call(self._accept(conn, client_address), self.timeout_s)
        except BaseException:
            self._connections.pop(conn.client_id)
            self._rt.loop.call_soon_threadsafe(self._expected.remove, conn.client_id)
            raise
        log.info("event=ucx_connect client=%d peer=%s", conn.client_id, peer)
        return Admission(conn.client_id, conn.tags.secret)

    def stop(self) -> None:
        self._reaper.cancel()
        self._sweeps.cancel()
        for client_id in self._connections.ids():
            self._rt.loop.call_soon_threadsafe(self._drop, client_id, "stopping")
        self._rt.stop()
        self._checker.close()

    async def _accept(self, conn: Connection, client_address: bytes) -> None:
        address = self._rt.ucxx.get_ucx_address_from_buffer(client_address)
        conn.ep = await self._rt.ctx.create_endpoint_from_worker_address(
            address, endpoint_error_handling=self.settings.error_handling
        )
        self._expected.add(conn.client_id, conn.tags, conn.in_flight)
        conn.loop_task = asyncio.create_task(self._serve_client(conn))

    def _drop(self, client_id: int, reason: str) -> None:
        """Forgets a client and cancels its in-flight transfers (before slots are freed)."""
        conn = self._connections.pop(client_id)
        if conn is None:
            return
        log.info("event=ucx_disconnect client=%d reason=%s", client_id, reason)
        self._expected.remove(client_id)
        if conn.loop_task is not None and conn.loop_task is not asyncio.current_task():
            conn.loop_task.cancel()
        if conn.ep is not None:
            with contextlib.suppress(Exception):
                conn.ep.abort(period=10**8)

    def reap(self, now: float | None = None) -> int:
        """Drops connections past their deadline (at `now`, default the monotonic clock);
        returns how many. Runs every second on its own; callable from any thread."""
        now = time.monotonic() if now is None else now
        late = self._connections.late(now)
        for client_id in late:
            self._rt.loop.call_soon_threadsafe(self._drop, client_id, "idle")
        return len(late)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.reap()

    def _on_sweep(self, swept: Swept) -> None:
        """Counts what the sweeper dropped. A message of a live connection that no receive
        took within a transfer's deadline (a block of a request its client never made) ends
        that connection."""
        if self.metrics is not None:
            self.metrics.swept.labels("ucx").inc(swept.num_dropped)
        client_id = None if swept.stale_tag is None else self._expected.owner(swept.stale_tag)
        if client_id is not None:
            log.warning("event=ucx_bad_frame client=%d error=a frame no request reads", client_id)
            self._drop(client_id, "bad_frame")

    async def _serve_client(self, conn: Connection) -> None:
        pending: set[asyncio.Task[None]] = set()
        while True:
            buf = bytearray(self._max_request_bytes)
            try:
                await conn.ep.recv(buf, tag=conn.tags.request, force_tag=True)
                req = frames.decode_request(memoryview(buf))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a frame too large for `buf`, or malformed
                log.warning("event=ucx_bad_frame client=%d error=%s", conn.client_id, exc)
                self._drop(conn.client_id, "bad_frame")
                return
            conn.deadline = time.monotonic() + self.settings.idle_timeout_s
            self._expected.read(conn.client_id, req.request_id)
            if req.op is Op.CLOSE:
                self._drop(conn.client_id, "closed")
                return
            if req.op is Op.PING:
                continue
            if req.request_id in conn.in_flight:
                log.warning("event=ucx_bad_frame client=%d error=request id reused", conn.client_id)
                self._drop(conn.client_id, "bad_frame")
                return
            conn.in_flight.add(req.request_id)
            task = asyncio.create_task(self._handle(conn, req))
            pending.add(task)
            task.add_done_callback(pending.discard)

    async def _handle(self, conn: Connection, req: Request) -> None:
        tags = RequestTags.of(conn.tags, req.request_id)
        start = time.perf_counter()
        try:
            if req.op is Op.GET:
                await self._get(conn, tags, req)
            else:
                await self._put(conn, tags, req)
        except errors.DeadlineExceededError:
            log.warning("event=ucx_timeout client=%d op=%s", conn.client_id, req.op.name)
            self._drop(conn.client_id, "timeout")
        except Exception:
            log.exception("event=ucx_error client=%d op=%s", conn.client_id, req.op.name)
            self._drop(conn.client_id, "error")
        finally:
            conn.in_flight.discard(req.request_id)
            if self.metrics is not None:
                self.metrics.observe("ucx", req.op.name.lower(), time.perf_counter() - start, None)

    async def _reply(self, ep: Any, reply: Reply, tag: int, op: Op) -> None:
        if reply.error is not None and self.metrics is not None:
            error = type(reply.error).__name__
            self.metrics.rejected.labels("ucx", op.name.lower(), error).inc()
        sent = transfers.post_sends(ep, [frames.encode_reply(reply)], [tag])
        await with_deadline(transfers.wait_all(sent), self.timeout_s)

    # -- get -----------------------------------------------------------------------------

    async def _get(self, conn: Connection, tags: RequestTags, req: Request) -> None:
        try:
            conn.check_block_bytes(req)
            lease = conn.acquire(req)
        except errors.KVStoreError as exc:
            await self._reply(conn.ep, Reply(error=exc), tags.reply, Op.GET)
            return
        try:
            hits = [i for i, v in enumerate(lease.views) if v is not None]
            sums = tuple(lease.checksums[i] for i in hits)
            reply = Reply(frames.flags_of(lease.found), 0, req.block_bytes, checksums=sums)
            blocks, block_tags = _parts(lease.views, hits, tags, req)
            # The reply and every block, posted in one pass (`transfers`).
            sends = transfers.post_sends(
                conn.ep, [frames.encode_reply(reply), *blocks], [tags.reply, *block_tags]
            )
            # The sends read the slots: they must end (or be cancelled) while the lease holds.
            deadline_s = min(self.timeout_s, 0.9 * self.store.config.lease_timeout_s)
            await with_deadline(transfers.wait_all(sends), deadline_s)
            if self.metrics is not None:
                self.metrics.moved("ucx", "get", 0, len(hits) * req.block_bytes)
        except BaseException:
            self._drop(conn.client_id, "get_failed")  # cancel sends that still read the slots
            raise
        finally:
            lease.release()

    # -- put -----------------------------------------------------------------------------

    async def _put(self, conn: Connection, tags: RequestTags, req: Request) -> None:
        try:
            conn.check_block_bytes(req)  # a wrong size is never drained (module docstring)
        except errors.KVStoreError as exc:
            await self._reply(conn.ep, Reply(error=exc), tags.reply, Op.PUT)
            return
        try:
            res = conn.reserve(req)
        except errors.KVStoreError as exc:
            await self._refuse_put(conn, tags, req, exc)
            return
        todo = [i for i, s in enumerate(res.statuses) if s is PutStatus.RESERVED]
        flags = tuple(STATUS_CODES.index(s) for s in res.statuses)
        try:
            views = res.views()
            slots = [views[i] for i in todo]
            receives = transfers.post_receives(conn.ep, slots, [tags.block(i) for i in todo])
            drains = self._drain(conn, tags, req, set(todo))
            reply = Reply(flags, res.reservation_id, req.block_bytes)
            await self._reply(conn.ep, reply, tags.reply, Op.PUT)
            crcs = await with_deadline(self._land(receives, slots, drains), self.timeout_s)
        except BaseException:
            self._drop(conn.client_id, "put_failed")  # cancel receives into the slots first
            _abort_quietly(res)
            raise
        await self._finish_put(conn, tags, req, res, dict(zip(todo, crcs, strict=True)))

    def _drain(
        self, conn: Connection, tags: RequestTags, req: Request, kept: set[int]
    ) -> list[Any]:
        """For an eager put: receives of the blocks it sent that no slot takes, into scratch
        memory (one buffer of the block size, shared: its bytes are never read)."""
        if not req.eager:
            return []
        dropped = [i for i in range(len(req.keys)) if i not in kept]
        if len(self._scratch) < req.block_bytes:
            self._scratch = memoryview(bytearray(req.block_bytes))
        scratch = self._scratch[: req.block_bytes]
        return transfers.post_receives(
            conn.ep, [scratch] * len(dropped), [tags.block(i) for i in dropped]
        )

    async def _land(self, receives: list[Any], slots: list[Any], drains: list[Any]) -> list[int]:
        """Every block in: the CRC32C of each slot, summed as it lands; drains done too."""
        crcs = await transfers.summed(receives, slots)
        await transfers.wait_all(drains)
        return crcs

    async def _refuse_put(
        self, conn: Connection, tags: RequestTags, req: Request, exc: errors.KVStoreError
    ) -> None:
        """Replies `exc`; an eager client sent its blocks anyway: they are drained first."""
        drains = self._drain(conn, tags, req, set())
        await self._reply(conn.ep, Reply(error=exc), tags.reply, Op.PUT)
        try:
            await with_deadline(transfers.wait_all(drains), self.timeout_s)
        except BaseException:
            self._drop(conn.client_id, "put_failed")
            raise

    async def _finish_put(
        self,
        conn: Connection,
        tags: RequestTags,
        req: Request,
        res: Reservation,
        crcs: dict[int, int],
    ) -> None:
        try:
            # The sums are known: a short bookkeeping pass under the store's lock, inline.
            res.commit(req.checksums or None, written=crcs)
        except errors.KVStoreError as exc:
            _abort_quietly(res)
            log.warning("event=ucx_put_rejected client=%d error=%s", conn.client_id, exc)
            await self._reply(conn.ep, Reply(error=exc), tags.done, Op.PUT)
            return
        if self.metrics is not None:
            self.metrics.moved("ucx", "put", len(crcs) * req.block_bytes, 0)
        await self._reply(conn.ep, Reply(), tags.done, Op.PUT)


def _abort_quietly(res: Reservation) -> None:
    with contextlib.suppress(errors.KVStoreError):
        res.abort()


def _parts(
    views: Sequence[Any], hits: list[int], tags: RequestTags, req: Request
) -> tuple[list[Any], list[int]]:
    """What a GET sends after its reply, and under which tags: each found block whole, or,
    for a segmented GET, part s of every found block before part s + 1 (`frames`)."""
    if req.segments == 1:
        return [_sendable(views[i]) for i in hits], [tags.block(i) for i in hits]
    size, num_keys = req.block_bytes // req.segments, len(req.keys)
    parts, part_tags = [], []
    for s in range(req.segments):
        for i in hits:
            parts.append(_sendable(views[i][s * size : (s + 1) * size]))
            part_tags.append(tags.block(s * num_keys + i))
    return parts, part_tags


def _sendable(view: Any) -> Any:
    """A leased block as ucxx sends it: a DRAM memoryview as is, a device tensor wrapped."""
    return view if isinstance(view, memoryview) else as_transfer_buffer(view, False).obj
