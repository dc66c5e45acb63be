"""The store node's TCP side: blocks move on the connection's own stream socket, straight
between the store's slots and the socket, for clients on any host (`tcp.client`).

UCX over TCP pays a message (and a tag match) per block, and a rendezvous for large ones;
a stream has no message boundary to pay for, so small blocks cost what large ones cost
per byte, and a block is one kernel copy on each side.

Admission, the hello and the deadlines are `sockets.server`'s: the gRPC handshake
(`DataPlaneInfo`, transport "tcp") admits the client, which then connects to the node's
TCP listener and sends HELLO with the secret (`sockets.messages`, no region). Per call, in
order (calls of one connection are served one at a time), the messages of `sockets.messages`
without placements, and raw block bytes between them:

    GET  client -> CALL; the node leases the blocks, -> REPLY (found flags and each found
         block's CRC32C), -> the bytes of every found block, one after another (part-major
         for a GET in parts: part 0 of each, then part 1, ...), straight from the slots;
         the lease ends when the socket has taken them all or the transfer deadline
         passes. The client checks every block against its CRC32C.
    PUT  eager: client -> CALL -> the bytes of every block -> SUMS. The node reserves,
         receives each reserved block straight into its slot and sums the slot, receives
         the others (present, in flight, or all when the call is refused) into scratch and
         drops them, commits if every sum matches SUMS, else aborts; -> REPLY (statuses
         or the error). Not eager (a client whose last put of the namespace was mostly
         present, so present blocks cost no bandwidth): client -> CALL with the sums; the
         node reserves, -> REPLY (statuses or the error); client -> the bytes of the
         reserved blocks only; the node commits or aborts as above, -> REPLY (DONE: no
         flags, or the error).

A CALL that does not decode ends the connection after its error reply: whether block bytes
follow it is unknown, so the stream is out of step (only a holder of the secret can send
one, so its client is broken). Every other refusal is a typed error reply on a stream kept
in step.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import time

from kvstore import errors
from kvstore.dataplane import frames
from kvstore.dataplane.base import ServerSettings
from kvstore.dataplane.buffers import slot_bytes
from kvstore.dataplane.connections import Connection
from kvstore.dataplane.frames import STATUS_CODES, Op, Reply, Request
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.dataplane.sockets.server import SocketServer
from kvstore.dataplane.tcp import streams
from kvstore.metrics import CallMetrics
from kvstore.results import PutStatus
from kvstore.store import Store
from kvstore.tenancy import Tenants

log = logging.getLogger("kvstore.dataplane")


class TcpServer(SocketServer):
    """Serves `store` over TCP on `settings.host`, port `settings.tcp_port` (0: a free
    one), a thread per connection."""

    plane = "tcp"

    def __init__(
        self,
        store: Store,
        settings: ServerSettings | None = None,
        metrics: CallMetrics | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        settings = settings or ServerSettings()
        family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        listener = socket.create_server(
            (settings.host, settings.tcp_port), family=family, backlog=128
        )
        port = listener.getsockname()[1]
        self._address = f"{settings.host}:{port}".encode()
        # Where bytes nobody keeps land: written by every connection at once, read by none.
        self._scratch = bytearray(streams.SCRATCH_BYTES)
        super().__init__(store, listener, settings, metrics, tenants)

    @property
    def address(self) -> bytes:
        """The listener's host and port ("host:port"); a client replaces a wildcard host
        with the host it reached the node's gRPC service at."""
        return self._address

    # -- a connection --------------------------------------------------------------------

    def _session(self, sock: socket.socket, claimed: list[Connection]) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = self._hello(sock)
        claimed.append(conn)
        sock.settimeout(self.settings.idle_timeout_s)
        while not self._stopped.is_set():
            data, _ = self._next_message(sock, conn)
            if not self._call(sock, conn, data):
                return  # CLOSE

    def _hello(self, sock: socket.socket) -> Connection:
        """The connection a socket's HELLO claims; raises InvalidArgumentError or
        PermissionDeniedError (replied to the socket) otherwise."""
        data, _ = socket_messages.receive(sock, self._max_message)
        try:
            conn = self._claim(sock, *socket_messages.decode_hello(data))
        except errors.KVStoreError as exc:
            with contextlib.suppress(OSError):
                socket_messages.send(sock, socket_messages.encode_reply(Reply(error=exc)))
            raise
        conn.deadline = time.monotonic() + self.settings.idle_timeout_s
        socket_messages.send(sock, socket_messages.encode_reply(Reply()))
        log.info("event=tcp_connect client=%d", conn.client_id)
        return conn

    def _call(self, sock: socket.socket, conn: Connection, data: memoryview) -> bool:
        """Serves one CALL; False once the client said CLOSE. Raises (ending the
        connection) for a CALL that does not decode, after replying its error."""
        start = time.perf_counter()
        try:
            req, _ = socket_messages.decode_call(data, placed=False)
        except errors.KVStoreError as exc:
            socket_messages.send(sock, socket_messages.encode_reply(Reply(error=exc)))
            log.info("event=tcp_bad_frame client=%d error=%s", conn.client_id, exc)
            raise
        op = req.op.name.lower()
        if req.op is Op.CLOSE:
            return False
        if req.op is Op.PING:
            return True
        try:
            if req.op is Op.GET:
                self._get(sock, conn, req)  # sends its own reply, then the bytes
            else:
                reply = self._put(sock, conn, req)
                socket_messages.send(sock, socket_messages.encode_reply(reply))
        except errors.KVStoreError as exc:
            socket_messages.send(sock, socket_messages.encode_reply(Reply(error=exc)))
            if self.metrics is not None:
                self.metrics.rejected.labels("tcp", op, type(exc).__name__).inc()
        if self.metrics is not None:
            self.metrics.observe("tcp", op, time.perf_counter() - start, None)
        return True

    def _get(self, sock: socket.socket, conn: Connection, req: Request) -> None:
        """Replies, then sends the found blocks' bytes (a refusal raises before either)."""
        conn.check_block_bytes(req)
        lease = conn.acquire(req)
        try:
            hits = [i for i, v in enumerate(lease.views) if v is not None]
            sums = tuple(lease.checksums[i] for i in hits)
            reply = Reply(frames.flags_of(lease.found), 0, req.block_bytes, checksums=sums)
            size = req.block_bytes // req.segments
            blocks = [slot_bytes(lease.views[i]).data for i in hits]
            units = [b[s * size : (s + 1) * size] for s in range(req.segments) for b in blocks]
            deadline = time.monotonic() + self.settings.timeout_s  # for a client not reading
            streams.send_all(
                sock,
                [memoryview(socket_messages.framed(socket_messages.encode_reply(reply))), *units],
                deadline,
            )
        finally:
            lease.release()
        if self.metrics is not None:
            self.metrics.moved("tcp", "get", 0, len(hits) * req.block_bytes)

    def _put(self, sock: socket.socket, conn: Connection, req: Request) -> Reply:
        """Receives a PUT's blocks, commits if every sum matches, and returns its last reply.

        Eager: every block and then SUMS follow the call (into scratch where not reserved,
        all of them when refused: the stream stays in step); the reply has the statuses.
        Not eager: the call carries the sums; the statuses go back first, then only the
        reserved blocks follow, and the last reply (DONE) says whether they were committed.
        """
        deadline = time.monotonic() + self.settings.timeout_s
        try:
            conn.check_block_bytes(req)
            res = conn.reserve(req)
        except errors.KVStoreError:
            if req.eager:
                streams.drain(sock, len(req.keys) * req.block_bytes, self._scratch, deadline)
                self._read_sums(sock, req)
            raise
        flags = tuple(STATUS_CODES.index(s) for s in res.statuses)
        statuses = Reply(flags, res.reservation_id, req.block_bytes)
        todo = {i for i, s in enumerate(res.statuses) if s is PutStatus.RESERVED}
        try:
            if not req.eager:
                socket_messages.send(sock, socket_messages.encode_reply(statuses))
            views = res.views()
            crcs: dict[int, int] = {}
            for in_todo, group in itertools.groupby(range(len(req.keys)), todo.__contains__):
                run = list(group)  # of blocks in a row, all reserved or none
                if not in_todo:
                    if req.eager:
                        streams.drain(sock, len(run) * req.block_bytes, self._scratch, deadline)
                    continue
                slots = [memoryview(views[i]).cast("B") for i in run]
                landed = [0] * len(run)  # summed from the node's copy, as it lands
                streams.receive_summed(sock, slots, landed, deadline)
                crcs.update(zip(run, landed, strict=True))
            sums = self._read_sums(sock, req) if req.eager else req.checksums
            res.commit(sums, written=crcs)
        except BaseException:
            with contextlib.suppress(errors.KVStoreError):
                res.abort()
            raise
        if self.metrics is not None:
            self.metrics.moved("tcp", "put", len(todo) * req.block_bytes, 0)
        return statuses if req.eager else Reply()

    def _read_sums(self, sock: socket.socket, req: Request) -> tuple[int, ...]:
        """The SUMS message behind an eager PUT's blocks; InvalidArgumentError if the next
        message is not exactly that."""
        try:
            data, _ = socket_messages.receive(sock, self._max_message)
        except errors.InvalidArgumentError as exc:  # past the limit: the stream is out of step
            raise ConnectionError(str(exc)) from exc
        return socket_messages.decode_sums(data, req)
