"""The client's TCP calls, over one stream socket to a node (`tcp.server`, over
`sockets.connection`).

A get's blocks are received straight into the caller's buffers (host memory; device
buffers through a host copy) and checked against the node's CRC32C as they land: a block
that does not match is a miss, never found. A put sends the caller's buffers as they are
and sums each one while the node receives it (SUMS follows the blocks), or, where most
blocks of the namespace's last put were present, sums them first and sends only those the
node reserved; either way the node commits only if its copy matches.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import numpy as np

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.dataplane.base import Admission
from kvstore.dataplane.buffers import TransferBuffer, host_bytes, write_host_bytes
from kvstore.dataplane.frames import STATUS_CODES, Op, Reply, Request
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.dataplane.sockets.connection import Handshake, SocketConnection
from kvstore.dataplane.tcp import streams
from kvstore.results import PutStatus, ReserveResult

log = logging.getLogger("kvstore.dataplane")
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


class TcpClient(SocketConnection):
    """Gets into and puts from caller buffers on a TCP stream to the node's tcp plane;
    `host` is where this process reached the node's gRPC service (used where the node
    listens on every interface)."""

    plane = "tcp"
    placed = False

    def __init__(self, handshake: Handshake, timeout_s: float = 30.0, host: str = "") -> None:
        self._host = host
        # (namespace, block size) -> whether to send a put's blocks behind it at once: yes,
        # unless most blocks of its last put were present (`tcp.server`'s two puts).
        self._eager: dict[tuple[bytes, int], bool] = {}
        super().__init__(handshake, timeout_s)

    def _connect(self, server_address: bytes) -> socket.socket:
        host, sep, port = server_address.decode("ascii", "replace").rpartition(":")
        if not sep or not port.isdigit():
            raise errors.UnavailableError(f"the node's tcp address {server_address!r} is malformed")
        if host in _WILDCARDS and self._host:
            host = self._host
        sock = socket.create_connection((host.strip("[]"), int(port)), self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _hello(self, admission: Admission) -> None:
        assert self._sock is not None
        socket_messages.send(
            self._sock, socket_messages.encode_hello(admission.client_id, admission.secret)
        )
        self._reply(0)

    # -- protocol (the lock held) --------------------------------------------------------

    def _get(
        self,
        namespace_id: bytes,
        keys: tuple[bytes, ...],
        parts: list[list[TransferBuffer]],
        block_bytes: int,
        on_part: Callable[[int], None] | None,
    ) -> tuple[bool, ...]:
        """`parts[s][i]`: where part s of key i lands; `on_part(s)` once every part s has.
        Each block is checked when its last part has landed."""
        assert self._sock is not None
        deadline = time.monotonic() + self.timeout_s
        segments = len(parts)
        req = Request(Op.GET, next(self._ids), namespace_id, keys, block_bytes, segments=segments)
        self._send(req, ())
        reply = self._reply(len(keys), None, True)
        hits = [i for i, flag in enumerate(reply.flags) if flag]
        into = [[_Landing(parts[s][i]) for i in hits] for s in range(segments)]
        crcs = [0] * len(hits)
        for s in range(segments):
            streams.receive_summed(
                self._sock, [landing.view for landing in into[s]], crcs, deadline
            )
            for landing in into[s]:
                landing.done()
            if on_part is not None:
                on_part(s)
        found = [False] * len(keys)
        for k, i in enumerate(hits):
            found[i] = crcs[k] == reply.checksums[k]
        failures = len(hits) - sum(found)
        if failures:
            self.checksum_failures += failures
            log.warning("event=tcp_checksum_failure client=%d blocks=%d", self.client_id, failures)
        return tuple(found)

    def _put(
        self,
        namespace_id: bytes,
        keys: tuple[bytes, ...],
        bufs: list[TransferBuffer],
        parents: tuple[bytes | None, ...] | None,
        block_bytes: int,
    ) -> ReserveResult:
        """Eager: the call, every block (summed a piece at a time once the socket has taken
        it, while the node receives it), then their SUMS. Otherwise: the call with the
        sums, then only the blocks the node reserved."""
        assert self._sock is not None
        deadline = time.monotonic() + self.timeout_s
        req = Request(Op.PUT, next(self._ids), namespace_id, keys, block_bytes, parents)
        views = [memoryview(host_bytes(b)).cast("B") for b in bufs]
        if self._eager.get((namespace_id, block_bytes), False):
            self._send(req._replace(checksums=(0,) * len(keys), eager=True), ())
            sums = [0] * len(views)
            streams.send_summed(self._sock, views, sums, deadline)
            socket_messages.send(self._sock, socket_messages.encode_sums(req.request_id, sums))
            return self._learn(req, self._reply(len(keys)))
        self._send(req._replace(checksums=tuple(checksum(v) for v in views)), ())
        result = self._learn(req, self._reply(len(keys)))
        reserved = [views[i] for i, s in enumerate(result.statuses) if s is PutStatus.RESERVED]
        streams.send_all(self._sock, reserved, deadline)
        self._reply(0)  # DONE: committed, or the error
        return result

    def _learn(self, req: Request, reply: Reply) -> ReserveResult:
        """The statuses of a put's reply; eager from now on for its namespace and block size
        unless most of its blocks were present."""
        if any(f >= len(STATUS_CODES) for f in reply.flags):
            raise ConnectionError("data-plane put reply is malformed")
        statuses = tuple(STATUS_CODES[f] for f in reply.flags)
        reserved = statuses.count(PutStatus.RESERVED)
        self._eager[req.namespace_id, req.block_bytes] = 2 * reserved >= len(statuses)
        return ReserveResult(reply.reservation_id, statuses)


class _Landing:
    """Where one part of a block is received: the caller's host memory itself, or for a
    device buffer a host copy written to the device once the part is in (`done`)."""

    def __init__(self, buf: TransferBuffer) -> None:
        self._buf = buf
        self.view: memoryview = np.empty(buf.nbytes, np.uint8).data if buf.is_device else buf.obj

    def done(self) -> None:
        if self._buf.is_device:
            write_host_bytes(self._buf, np.frombuffer(self.view, np.uint8))
