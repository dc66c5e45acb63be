"""The store node's same-host side: blocks copied once, between the store's slots and a
shared-memory region the client handed over (`regions`), on a Unix socket.

Admission, the hello and the deadlines are `sockets.server`'s: the gRPC handshake
(`DataPlaneInfo`, transport "shm") admits the client, which then connects to the node's
abstract Unix socket and sends HELLO with the secret and its region (`sockets.messages`).

Per call, on the connection's own thread (calls of one connection are served in order):

    GET  lease the blocks, copy each found one (or its parts) to the offsets the call
         placed it at, saying which have landed after every MiB or so (LANDED, so the
         client checks them meanwhile), end the lease, reply with the found flags and each
         block's CRC32C (the client checks its copy against them).
    PUT  reserve; copy each reserved block from its offset into its slot and sum the slot
         (the node's copy: the client cannot change it after); commit if every sum
         matches the checksum the call carries (an eager PUT's come in the SUMS message
         behind it, summed while the node copied), else abort; reply with the statuses.
         Blocks already present or in flight are never read.

A put's copies run on the connection's thread and on any idle helper beside it (`crew`:
one core's copy is bound by the misses it keeps in flight, so two copy a batch faster);
the reservation ends only once every copy is done. A get keeps two threads busy all along,
the node's copy and the client's check of each block as it lands, so only a host with
cores beyond those two lends its copy helpers (`get_helpers`): a run of blocks between two
LANDED notes per job (the notes said in order, once every run before one has landed), and
the lease ends only once every copy is done. Gets under GET_SHARED_BYTES stay on the
connection's thread.

The socket is local, so this plane serves only clients on the node's host (in its network
namespace); `kvstore.client` uses it there and UCX elsewhere. Malformed messages get a
typed error reply and change nothing; a message past the size limit ends the connection.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import socket
import threading
import time

import numpy as np

from kvstore import errors
from kvstore.dataplane import frames
from kvstore.dataplane.base import ServerSettings
from kvstore.dataplane.buffers import slot_bytes
from kvstore.dataplane.connections import Connection
from kvstore.dataplane.frames import STATUS_CODES, Op, Reply, Request
from kvstore.dataplane.shm.crew import Crew
from kvstore.dataplane.shm.regions import Region, Regions, copy, copy_summed
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.dataplane.sockets.server import SocketServer
from kvstore.metrics import CallMetrics
from kvstore.results import PutStatus
from kvstore.store import Store
from kvstore.tenancy import Tenants

log = logging.getLogger("kvstore.dataplane")
GET_SHARED_BYTES = 8 << 20  # a smaller get is copied by the connection's thread alone: a
# hand-off to a helper costs tens of microseconds, and 64 x 64 KiB gets (4 MiB, about a
# millisecond) lost a quarter of their bandwidth with one


class ShmServer(SocketServer):
    """Serves `store` to same-host clients over shared memory, a thread per connection."""

    plane = "shm"

    def __init__(
        self,
        store: Store,
        settings: ServerSettings | None = None,
        metrics: CallMetrics | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self._name = b"\0kvstore-" + secrets.token_hex(16).encode()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self._name)
        listener.listen(128)
        self._crew = Crew.for_host()  # copies a put's blocks beside the connection's thread
        self.get_helpers = get_helpers(os.cpu_count() or 1)
        super().__init__(store, listener, settings, metrics, tenants)

    @property
    def address(self) -> bytes:
        return self._name

    def stop(self) -> None:
        super().stop()
        self._crew.shutdown()

    # -- a connection --------------------------------------------------------------------

    def _session(self, sock: socket.socket, claimed: list[Connection]) -> None:
        regions = Regions(self.settings.max_regions)
        try:
            conn = self._hello(sock, regions)
            claimed.append(conn)
            sock.settimeout(self.settings.idle_timeout_s)
            while not self._stopped.is_set():
                data, fds = self._next_message(sock, conn)
                if data[:1] == bytes([socket_messages.Kind.REGION]):
                    self._new_region(sock, regions, data, fds)
                    continue
                socket_messages.close_all(fds)
                if not self._call(sock, conn, regions, data):
                    return  # CLOSE
        finally:
            regions.close()

    def _hello(self, sock: socket.socket, regions: Regions) -> Connection:
        """The connection a socket's HELLO claims (its region put in `regions` at 0); raises
        InvalidArgumentError or PermissionDeniedError (replied to the socket) otherwise."""
        data, fds = socket_messages.receive(sock, self._max_message)
        try:
            client_id, secret = socket_messages.decode_hello(data)
            conn = self._claim(sock, client_id, secret)
            try:
                if len(fds) != 1:
                    raise errors.InvalidArgumentError(f"a hello carries one region, not {len(fds)}")
                region = Region.admit(fds[0], self.settings.max_region_bytes)
            except errors.KVStoreError:  # the secret's holder is broken: its admission ends
                self._drop(client_id)
                raise
            regions.set(0, region)
        except errors.KVStoreError as exc:
            with contextlib.suppress(OSError):
                socket_messages.send(sock, socket_messages.encode_reply(Reply(error=exc)))
            raise
        finally:
            socket_messages.close_all(fds)
        conn.deadline = time.monotonic() + self.settings.idle_timeout_s
        socket_messages.send(sock, socket_messages.encode_reply(self._region_ack()))
        log.info("event=shm_connect client=%d region_bytes=%d", conn.client_id, region.size)
        return conn

    def _region_ack(self) -> Reply:
        return Reply(block_bytes=self.settings.max_region_bytes)

    def _new_region(
        self, sock: socket.socket, regions: Regions, data: memoryview, fds: list[int]
    ) -> None:
        """REGION: the region goes at its index, replacing any there; on an error reply
        the regions stay as they were."""
        try:
            if len(data) != 2 or len(fds) != 1:
                raise errors.InvalidArgumentError("a region message is two bytes and one region")
            regions.set(data[1], Region.admit(fds[0], self.settings.max_region_bytes))
        except errors.KVStoreError as exc:
            socket_messages.send(sock, socket_messages.encode_reply(Reply(error=exc)))
            return
        finally:
            socket_messages.close_all(fds)
        socket_messages.send(sock, socket_messages.encode_reply(self._region_ack()))

    def _call(
        self, sock: socket.socket, conn: Connection, regions: Regions, data: memoryview
    ) -> bool:
        """Serves one CALL; False once the client said CLOSE."""
        start, op, sums = time.perf_counter(), "call", None
        try:
            req, offsets = socket_messages.decode_call(data)
            op = req.op.name.lower()
            if req.op is Op.CLOSE:
                return False
            if req.op is Op.PING:
                return True
            if req.eager:  # its sums follow: read them only once the blocks are copied
                sums = _Sums(sock, req, self._max_message)
            conn.check_block_bytes(req)
            if req.op is Op.GET:
                reply = self._get(sock, conn, regions, req, offsets)
            else:
                reply = self._put(conn, regions, req, offsets, sums)
        except errors.KVStoreError as exc:
            reply = Reply(error=exc)
            if self.metrics is not None:
                self.metrics.rejected.labels("shm", op, type(exc).__name__).inc()
        if sums is not None:
            sums.drain()  # answered early: the sums are read all the same (one reply each)
        socket_messages.send(sock, socket_messages.encode_reply(reply))
        if self.metrics is not None:
            self.metrics.observe("shm", op, time.perf_counter() - start, None)
        return True

    def _get(
        self,
        sock: socket.socket,
        conn: Connection,
        regions: Regions,
        req: Request,
        offsets: tuple[int, ...],
    ) -> Reply:
        size = req.block_bytes // req.segments
        targets = [regions.span(off, size) for off in offsets]  # all checked before a lease
        lease = conn.acquire(req)
        try:
            hits = [i for i, v in enumerate(lease.views) if v is not None]
            flags = frames.flags_of(lease.found)
            blocks = {i: slot_bytes(lease.views[i]) for i in hits}
            units = tuple(flags) * req.segments
            _copy_noting(sock, req, targets, blocks, units, self._crew, self.get_helpers)
            sums = tuple(lease.checksums[i] for i in hits)
        finally:
            lease.release()
        if self.metrics is not None:
            self.metrics.moved("shm", "get", 0, len(hits) * req.block_bytes)
        return Reply(flags, 0, req.block_bytes, checksums=sums)

    def _put(
        self,
        conn: Connection,
        regions: Regions,
        req: Request,
        offsets: tuple[int, ...],
        sums: _Sums | None = None,
    ) -> Reply:
        sources = [regions.span(off, req.block_bytes) for off in offsets]
        res = conn.reserve(req)
        todo = [i for i, s in enumerate(res.statuses) if s is PutStatus.RESERVED]
        try:
            views = res.views()
            copies = [  # summed from the node's copy, which the client cannot touch
                functools.partial(copy_summed, np.frombuffer(views[i], np.uint8), sources[i])
                for i in todo
            ]
            crcs = dict(zip(todo, self._crew.run(copies, len(todo) * req.block_bytes), strict=True))
            checksums = req.checksums if sums is None else sums.read()
            res.commit(checksums or None, written=crcs)
        except BaseException:
            with contextlib.suppress(errors.KVStoreError):
                res.abort()
            raise
        if self.metrics is not None:
            self.metrics.moved("shm", "put", len(todo) * req.block_bytes, 0)
        flags = tuple(STATUS_CODES.index(s) for s in res.statuses)
        return Reply(flags, res.reservation_id, req.block_bytes)


def _copy_noting(
    sock: socket.socket,
    req: Request,
    targets: list[np.ndarray],
    blocks: dict[int, np.ndarray],
    units: tuple[int, ...],
    crew: Crew,
    helpers: int,
) -> None:
    """Copies each found block's parts into `targets`, part-major (unit `s * num_keys + i`,
    part s of key i, found if `units[u]`), and says which units landed (LANDED): after
    every NOTE_BYTES copied, and at the end of each part of at least NOTE_BYTES (layer s of
    every block in). The units between two notes are one job of `crew` (the caller's thread
    and at most `helpers` of the crew's); a note is said once every unit before it has
    landed, whichever thread copied them. Never waits under the lease for a client that
    does not read: a note the socket cannot take at once ends the notes of this call."""
    size, num_keys = req.block_bytes // req.segments, len(req.keys)
    runs = _runs(num_keys, req.segments, list(blocks), size)
    notes = _Notes(sock, req, units, runs)

    def copy_run(k: int) -> None:
        for u in range(*runs[k]):
            part, i = divmod(u, num_keys)
            block = blocks.get(i)
            if block is not None:
                copy(targets[u], block[part * size : (part + 1) * size])
        notes.landed(k)

    jobs = [functools.partial(copy_run, k) for k in range(len(runs))]
    crew.run(jobs, len(blocks) * req.block_bytes, least=GET_SHARED_BYTES, most=helpers)


def get_helpers(cores: int) -> int:
    """How many crew helpers a get's copy takes on a host of `cores`: those beyond the two
    a get keeps busy (the node's copy and the client's check). On two cores a helper took
    the check's core: with copies in pieces (`regions.copy`), 64-block gets ran 9-15% faster
    without one from 256 KiB to 4 MiB, and the vLLM connector's loads (256 blocks in 8 parts
    of 64 KiB) even."""
    return max(0, cores - 2)


def _runs(num_keys: int, segments: int, hits: list[int], size: int) -> list[tuple[int, int]]:
    """The units from one note to the next, in order, as (start, end): a note after every
    NOTE_BYTES of found parts and at the end of each part of NOTE_BYTES or more; the last
    run ends at the last unit."""
    last, part_bytes = segments * num_keys, len(hits) * size
    ends: list[int] = []
    copied = 0
    for s in range(segments):
        for i in hits:
            copied += size
            if copied >= socket_messages.NOTE_BYTES and s * num_keys + i + 1 < last:
                ends.append(s * num_keys + i + 1)
                copied = 0
        end = (s + 1) * num_keys
        if part_bytes >= socket_messages.NOTE_BYTES and (ends[-1] if ends else 0) < end < last:
            ends.append(end)
            copied = 0
    ends.append(last)
    return list(zip([0, *ends[:-1]], ends, strict=True))


class _Notes:
    """The LANDED notes of one GET, said in order as runs of units land on any thread. A
    call of several runs has its last one noted too, so the client checks it while the
    node ends the lease and replies (a call of one run is said by its reply alone)."""

    def __init__(
        self, sock: socket.socket, req: Request, units: tuple[int, ...], runs: list[tuple[int, int]]
    ) -> None:
        self._sock, self._req, self._units, self._runs = sock, req, units, runs
        self._lock = threading.Lock()
        self._landed = [False] * len(runs)
        self._next = 0  # the first run not noted
        self._said = 0  # units noted so far
        self._noting = True

    def landed(self, k: int) -> None:
        """Run `k` is in: notes every run landed since the last note, up to the first one
        still being copied."""
        with self._lock:
            self._landed[k] = True
            j = self._next
            while j < len(self._runs) and self._landed[j]:
                j += 1
            if j == self._next:
                return
            self._next, through = j, self._runs[j - 1][1]
            if self._noting and (through < len(self._units) or len(self._runs) > 1):
                units = self._units[self._said : through]
                landed = socket_messages.encode_landed(self._req.request_id, self._said, units)
                self._noting = socket_messages.try_send(self._sock, landed)
                self._said = through


class _Sums:
    """The SUMS message behind an eager PUT, read once: when the put needs them, or, if it
    ends sooner, before its reply (the stream stays one reply per call)."""

    def __init__(self, sock: socket.socket, req: Request, max_bytes: int) -> None:
        self._sock, self._req, self._max_bytes = sock, req, max_bytes
        self._read = False

    def read(self) -> tuple[int, ...]:
        """The sums; InvalidArgumentError if the next message is not this put's SUMS."""
        self._read = True
        data, fds = socket_messages.receive(self._sock, self._max_bytes)
        socket_messages.close_all(fds)
        return socket_messages.decode_sums(data, self._req)

    def drain(self) -> None:
        if not self._read:
            with contextlib.suppress(errors.InvalidArgumentError):
                self.read()
