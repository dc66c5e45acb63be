"""What the client's socket-served data-plane connections share (`shm.connection`,
`tcp.client`): the handshake, the socket to one node and the hello on it, the calls' checks
on the caller's thread, calls run one at a time in the order they are made (`InOrder`),
keep-alive pings, and the exchange of messages (`sockets.messages`). A timeout or a broken
socket closes the connection.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import socket
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore import errors
from kvstore.dataplane import frames
from kvstore.dataplane.base import Admission, DataPlaneClient
from kvstore.dataplane.buffers import TransferBuffer, checked_buffers
from kvstore.dataplane.frames import Op, Reply, Request
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.dataplane.sockets.in_order import InOrder
from kvstore.dataplane.sockets.landing import Landing
from kvstore.results import ReserveResult

T = TypeVar("T")
Handshake = Callable[[bytes], tuple[bytes, Admission]]  # b"" -> node's address, mine
KEEPALIVE_S = 30.0  # well inside the node's idle timeout (`ServerSettings.idle_timeout_s`)
# A node sheds silent sockets to make room (`kvstore.bounds.UnprovenSockets`); where a flood
# beside this client shed its socket before the hello was read, the admission is unclaimed
# and a new socket claims it.
HELLO_ATTEMPTS = 3


class SocketConnection(DataPlaneClient):
    """A connection to a node's socket-served plane `plane`; every exchange has a deadline
    (the socket's timeout). Subclasses connect (`_connect`) and say hello (`_hello`)."""

    plane = ""
    placed = True  # whether a CALL says where each block it moves is (`sockets.messages`)

    def __init__(self, handshake: Handshake, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.checksum_failures = 0  # received blocks that did not match the node's CRC32C
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # one exchange on the socket at a time
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._calls = InOrder(f"kvstore-{self.plane}-client")
        try:
            server_address, admission = handshake(b"")
            self.client_id = admission.client_id
            self._claim(server_address, admission)
        except OSError as exc:
            self._abort()
            raise errors.UnavailableError(f"{self.plane} data plane unreachable: {exc}") from exc
        except BaseException:
            self._abort()
            raise
        threading.Thread(
            target=self._ping_forever, name=f"kvstore-{self.plane}-ping", daemon=True
        ).start()

    def _claim(self, server_address: bytes, admission: Admission) -> None:
        """Connects and says hello, on a new socket where the node closed one unheard."""
        for attempt in range(1, HELLO_ATTEMPTS + 1):
            try:
                self._sock = self._connect(server_address)
                self._hello(admission)
                return
            except ConnectionError:
                sock, self._sock = self._sock, None
                if sock is not None:
                    sock.close()
                if attempt == HELLO_ATTEMPTS:
                    raise

    @abstractmethod
    def _connect(self, server_address: bytes) -> socket.socket:
        """A socket connected to the node's plane at `server_address`, with a timeout."""

    @abstractmethod
    def _hello(self, admission: Admission) -> None:
        """Claims `admission` on the new socket and reads the node's answer."""

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        """Says CLOSE to the node and closes the socket; never raises."""
        if self._sock is None:
            return
        with contextlib.suppress(OSError, errors.KVStoreError), self._lock:
            self._send(Request(Op.CLOSE, next(self._ids), b"", (), 0), ())
        self._abort()

    def submit_get_into(
        self, namespace_id: bytes, keys: Sequence[bytes], buffers: Sequence[Any], block_bytes: int
    ) -> concurrent.futures.Future[tuple[bool, ...]]:
        bufs = self._checked(keys, buffers, block_bytes, writable=True)
        return self._submit(self._get, namespace_id, tuple(keys), [bufs], block_bytes, None)

    def get_into(
        self, namespace_id: bytes, keys: Sequence[bytes], buffers: Sequence[Any], block_bytes: int
    ) -> tuple[bool, ...]:
        """`submit_get_into`, waited for: on this thread when no call is queued."""
        bufs = self._checked(keys, buffers, block_bytes, writable=True)
        args = (namespace_id, tuple(keys), [bufs], block_bytes, None)
        return self._calls.run(self._guarded, self._get, *args)

    def submit_get_parts(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parts: Sequence[Sequence[Any]],
        block_bytes: int,
        on_part: Callable[[int], None] | None = None,
    ) -> concurrent.futures.Future[tuple[bool, ...]]:
        frames.check_segments(len(keys), block_bytes, len(parts))
        size = block_bytes // len(parts)
        bufs = [self._checked(keys, part, size, writable=True) for part in parts]
        return self._submit(self._get, namespace_id, tuple(keys), bufs, block_bytes, on_part)

    def submit_put(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes | None] | None,
        block_bytes: int,
    ) -> concurrent.futures.Future[ReserveResult]:
        args = self._put_args(namespace_id, keys, blocks, parents, block_bytes)
        return self._submit(self._put, *args)

    def put(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes | None] | None,
        block_bytes: int,
    ) -> ReserveResult:
        """`submit_put`, waited for: on this thread when no call is queued."""
        args = self._put_args(namespace_id, keys, blocks, parents, block_bytes)
        return self._calls.run(self._guarded, self._put, *args)

    def _put_args(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes | None] | None,
        block_bytes: int,
    ) -> tuple[Any, ...]:
        """What `_put` is called with, checked on the caller's thread."""
        bufs = self._checked(keys, blocks, block_bytes, writable=False)
        parents_t = tuple(parents) if parents is not None else None
        return (namespace_id, tuple(keys), bufs, parents_t, block_bytes)

    @abstractmethod
    def _get(
        self,
        namespace_id: bytes,
        keys: tuple[bytes, ...],
        parts: list[list[TransferBuffer]],
        block_bytes: int,
        on_part: Callable[[int], None] | None,
    ) -> tuple[bool, ...]:
        """A GET (the lock held): part s of key i lands in `parts[s][i]`; `on_part(s)` once
        every part s has."""

    @abstractmethod
    def _put(self, *args: Any) -> ReserveResult:
        """A PUT (the lock held), with what `_put_args` gave."""

    def _abort(self) -> None:
        self._closed.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._calls.shutdown()

    def _ping_forever(self) -> None:
        while not self._closed.wait(KEEPALIVE_S):
            with contextlib.suppress(Exception), self._lock:
                if self._sock is not None:
                    self._send(Request(Op.PING, next(self._ids), b"", (), 0), ())

    def _checked(
        self, keys: Sequence[bytes], buffers: Sequence[Any], block_bytes: int, writable: bool
    ) -> list[TransferBuffer]:
        bufs = checked_buffers(keys, buffers, block_bytes, writable)
        if self._sock is None:
            raise errors.UnavailableError("data-plane connection is closed")
        return bufs

    def _submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        return self._calls.submit(self._guarded, fn, *args)

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a call; a timeout or a broken socket closes the connection and raises a
        typed error (a call's own error, the node's reply, leaves it open)."""
        try:
            with self._lock:
                if self._sock is None:
                    raise errors.UnavailableError("data-plane connection is closed")
                return fn(*args)
        except TimeoutError as exc:
            self._abort()
            raise errors.DeadlineExceededError(f"data-plane call timed out: {exc}") from exc
        except (OSError, ConnectionError) as exc:
            self._abort()
            raise errors.UnavailableError(f"data-plane connection failed: {exc!r}") from exc

    # -- protocol (the lock held) --------------------------------------------------------

    def _send(self, req: Request, offsets: Sequence[int]) -> None:
        assert self._sock is not None
        socket_messages.send(self._sock, socket_messages.encode_call(req, offsets, self.placed))

    def _reply(self, num_keys: int, landing: Landing | None = None, get: bool = False) -> Reply:
        """The reply to the oldest call not answered (of `num_keys` keys); a GET's (`get`)
        LANDED notes before it go to `landing` (none: dropped, for a call drained after an
        error). Anything else the node sends breaks the stream (ConnectionError)."""
        assert self._sock is not None
        noted = landing.note if landing is not None else None
        reply = socket_messages.receive_reply(self._sock, num_keys, get, noted)
        if reply.error is not None:
            raise reply.error
        return reply
