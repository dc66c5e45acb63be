"""The store node's same-host side: blocks copied once, between the store's slots and a
shared-memory region the client handed over (`regions`), on a Unix socket.

Admission is the UCX plane's: the gRPC handshake (`DataPlaneInfo`, transport "shm") gives
the client a connection id and secret and counts the connection against the same bounds
(`connections`); the client then connects to the node's abstract Unix socket and sends
HELLO with the secret and its region (`shm_messages`). A socket that does not say hello
with a live connection's secret within `hello_timeout_s` is closed; an admission no socket
claims is dropped at the same deadline; a connection silent for `idle_timeout_s` too.

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

The socket is local, so this plane serves only clients on the node's host (in its network
namespace); `kvstore.client` uses it there and UCX elsewhere. Malformed messages get a
typed error reply and change nothing; a message past the size limit ends the connection.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import threading
import time

import numpy as np

from kvstore import errors
from kvstore.dataplane import frames, shm_messages
from kvstore.dataplane.base import Admission, DataPlaneServer, ServerSettings
from kvstore.dataplane.buffers import as_transfer_buffer, host_bytes
from kvstore.dataplane.connections import Connection, Connections
from kvstore.dataplane.frames import Op, Reply, Request
from kvstore.dataplane.regions import Region, Regions, copy, copy_summed
from kvstore.dataplane.ucx_server import STATUS_CODES
from kvstore.metrics import CallMetrics
from kvstore.results import PutStatus
from kvstore.store import Store
from kvstore.tenancy import Tenants

log = logging.getLogger("kvstore.dataplane")
REAP_PERIOD_S = 1.0


class ShmServer(DataPlaneServer):
    """Serves `store` to same-host clients over shared memory, a thread per connection."""

    def __init__(
        self,
        store: Store,
        settings: ServerSettings | None = None,
        metrics: CallMetrics | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.store = store
        self.tenants = tenants or Tenants(store, None)
        self.settings = settings or ServerSettings()
        self.metrics = metrics  # plane "shm"
        self._connections = Connections(self.settings)
        self._max_message = shm_messages.max_message_bytes(store.config.max_batch_keys)
        self._name = b"\0kvstore-" + secrets.token_hex(16).encode()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._name)
        self._listener.listen(128)
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()  # open ones, said hello or not
        self._bound: dict[int, socket.socket] = {}  # connection id -> its socket
        self._serving: set[threading.Thread] = set()  # a thread per open socket
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept_forever, name="kvstore-shm-accept", daemon=True),
            threading.Thread(target=self._reap_forever, name="kvstore-shm-reap", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def address(self) -> bytes:
        return self._name

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def connect(self, client_address: bytes, peer: str, tenant: str = "") -> Admission:
        if client_address:
            raise errors.InvalidArgumentError("an shm client sends no address (it connects)")
        conn = self._connections.admit(peer, self.tenants.scope(tenant))
        log.info("event=shm_admit client=%d peer=%s", conn.client_id, peer)
        return Admission(conn.client_id, conn.tags.secret)

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=self.settings.timeout_s)
        with self._lock:
            open_sockets, serving = list(self._sockets), list(self._serving)
        for sock in open_sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its thread wakes, ends its call, exits
        for thread in serving:
            thread.join(timeout=self.settings.timeout_s)
        for client_id in self._connections.ids():
            self._connections.pop(client_id)

    def reap(self, now: float | None = None) -> int:
        """Drops connections past their deadline: admissions no socket claimed in time and
        silent sockets. Runs every second on its own; returns how many."""
        now = time.monotonic() if now is None else now
        late = self._connections.late(now)
        for client_id in late:
            self._connections.pop(client_id)
            with self._lock:
                sock = self._bound.pop(client_id, None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            log.info("event=shm_disconnect client=%d reason=idle", client_id)
        return len(late)

    def _reap_forever(self) -> None:
        while not self._stopped.wait(REAP_PERIOD_S):
            self.reap()

    def _accept_forever(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # stopped
            thread = threading.Thread(
                target=self._serve, args=(sock,), name="kvstore-shm-conn", daemon=True
            )
            with self._lock:
                crowded = len(self._sockets) >= self.settings.max_connections
                if not crowded:
                    self._sockets.add(sock)
                    self._serving.add(thread)
            if crowded:  # sockets that never say hello are bounded like connections
                sock.close()
                continue
            thread.start()

    # -- a connection --------------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        conn: Connection | None = None
        regions = Regions(self.settings.max_regions)
        try:
            sock.settimeout(self.settings.hello_timeout_s)
            conn = self._hello(sock, regions)
            sock.settimeout(self.settings.idle_timeout_s)
            while not self._stopped.is_set():
                data, fds = shm_messages.receive(sock, self._max_message)
                conn.deadline = time.monotonic() + self.settings.idle_timeout_s
                if data[:1] == bytes([shm_messages.Kind.REGION]):
                    self._new_region(sock, regions, data, fds)
                    continue
                shm_messages.close_all(fds)
                if not self._call(sock, conn, regions, data):
                    return  # CLOSE
        except (OSError, ConnectionError, errors.KVStoreError) as exc:
            # The peer went, fell silent, sent a message past the limit or a bad hello.
            client = conn.client_id if conn is not None else "-"
            log.info("event=shm_disconnect client=%s reason=%s", client, exc)
        except Exception:
            log.exception("event=shm_error")
        finally:
            regions.close()
            if conn is not None:
                self._connections.pop(conn.client_id)
                with self._lock:
                    self._bound.pop(conn.client_id, None)
            with self._lock:
                self._sockets.discard(sock)
                self._serving.discard(threading.current_thread())
            sock.close()

    def _hello(self, sock: socket.socket, regions: Regions) -> Connection:
        """The connection a socket's HELLO claims (its region put in `regions` at 0); raises
        InvalidArgumentError or PermissionDeniedError (replied to the socket) otherwise."""
        data, fds = shm_messages.receive(sock, self._max_message)
        try:
            client_id, secret = shm_messages.decode_hello(data)
            conn = self._connections.get(client_id)
            with self._lock:
                claimed = client_id in self._bound
                if conn is None or claimed or not hmac.compare_digest(secret, conn.tags.secret):
                    raise errors.PermissionDeniedError("no data-plane connection has that secret")
                self._bound[client_id] = sock
            try:
                if len(fds) != 1:
                    raise errors.InvalidArgumentError(f"a hello carries one region, not {len(fds)}")
                region = Region.admit(fds[0], self.settings.max_region_bytes)
            except errors.KVStoreError:  # the secret's holder is broken: its admission ends
                self._connections.pop(client_id)
                with self._lock:
                    self._bound.pop(client_id, None)
                raise
            regions.set(0, region)
        except errors.KVStoreError as exc:
            with contextlib.suppress(OSError):
                shm_messages.send(sock, shm_messages.encode_reply(Reply(error=exc)))
            raise
        finally:
            shm_messages.close_all(fds)
        conn.deadline = time.monotonic() + self.settings.idle_timeout_s
        shm_messages.send(sock, shm_messages.encode_reply(self._region_ack()))
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
            shm_messages.send(sock, shm_messages.encode_reply(Reply(error=exc)))
            return
        finally:
            shm_messages.close_all(fds)
        shm_messages.send(sock, shm_messages.encode_reply(self._region_ack()))

    def _call(
        self, sock: socket.socket, conn: Connection, regions: Regions, data: memoryview
    ) -> bool:
        """Serves one CALL; False once the client said CLOSE."""
        start, op, sums = time.perf_counter(), "call", None
        try:
            req, offsets = shm_messages.decode_call(data)
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
        shm_messages.send(sock, shm_messages.encode_reply(reply))
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
        lease = conn.store.acquire(req.namespace_id, req.keys, True, conn.peer)
        try:
            hits = [i for i, v in enumerate(lease.views) if v is not None]
            flags = frames.flags_of(lease.found)
            blocks = {i: _slot_bytes(lease.views[i]) for i in hits}
            _copy_noting(sock, req, targets, blocks, tuple(flags) * req.segments)
            sums = tuple(lease.checksums[i] for i in hits)
        finally:
            conn.store.release(lease.lease_id)
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
        reserved = conn.store.reserve(req.namespace_id, req.keys, req.parents, conn.peer)
        rid = reserved.reservation_id
        todo = [i for i, s in enumerate(reserved.statuses) if s is PutStatus.RESERVED]
        try:
            views = conn.store.reservation_views(rid, conn.peer) if todo else {}
            crcs = {}
            for i in todo:  # summed from the node's copy, which the client cannot touch
                crcs[i] = copy_summed(np.frombuffer(views[i], np.uint8), sources[i])
            checksums = req.checksums if sums is None else sums.read()
            conn.store.commit(rid, checksums or None, conn.peer, written=crcs)
        except BaseException:
            with contextlib.suppress(errors.KVStoreError):
                conn.store.abort(rid, conn.peer)
            raise
        if self.metrics is not None:
            self.metrics.moved("shm", "put", len(todo) * req.block_bytes, 0)
        flags = tuple(STATUS_CODES.index(s) for s in reserved.statuses)
        return Reply(flags, rid, req.block_bytes)


def _copy_noting(
    sock: socket.socket,
    req: Request,
    targets: list[np.ndarray],
    blocks: dict[int, np.ndarray],
    units: tuple[int, ...],
) -> None:
    """Copies each found block's parts into `targets`, part-major (unit `s * num_keys + i`,
    part s of key i, found if `units[u]`), and says which units landed (LANDED): after
    every NOTE_BYTES copied, and at the end of each part of at least NOTE_BYTES (layer s of
    every block in). Never waits under the lease for a client that does not read: a note
    the socket cannot take at once ends the notes of this call."""
    size, num_keys = req.block_bytes // req.segments, len(req.keys)
    part_bytes, last = len(blocks) * size, len(units)
    said, copied, noting = 0, 0, True

    def note(through: int) -> None:
        nonlocal said, copied, noting
        landed = shm_messages.encode_landed(req.request_id, said, units[said:through])
        noting = shm_messages.try_send(sock, landed)
        said, copied = through, 0

    for s in range(req.segments):
        for i, block in blocks.items():
            copy(targets[s * num_keys + i], block[s * size : (s + 1) * size])
            copied += size
            if noting and copied >= shm_messages.NOTE_BYTES and s * num_keys + i + 1 < last:
                note(s * num_keys + i + 1)
        end = (s + 1) * num_keys
        if noting and part_bytes >= shm_messages.NOTE_BYTES and said < end < last:
            note(end)


class _Sums:
    """The SUMS message behind an eager PUT, read once: when the put needs them, or, if it
    ends sooner, before its reply (the stream stays one reply per call)."""

    def __init__(self, sock: socket.socket, req: Request, max_bytes: int) -> None:
        self._sock, self._req, self._max_bytes = sock, req, max_bytes
        self._read = False

    def read(self) -> tuple[int, ...]:
        """The sums; InvalidArgumentError if the next message is not this put's SUMS."""
        self._read = True
        data, fds = shm_messages.receive(self._sock, self._max_bytes)
        shm_messages.close_all(fds)
        return shm_messages.decode_sums(data, self._req)

    def drain(self) -> None:
        if not self._read:
            with contextlib.suppress(errors.InvalidArgumentError):
                self.read()


def _slot_bytes(view: object) -> np.ndarray:
    """A leased block's bytes on the host: a DRAM slot as is, an HBM block copied off."""
    if isinstance(view, memoryview):
        return np.frombuffer(view, np.uint8)
    return np.asarray(host_bytes(as_transfer_buffer(view, False)), np.uint8).reshape(-1)
