"""One same-host data-plane connection, client side: the Unix socket to one node
(`shm_server`), the staging region and the memory shared with it (`regions`), and the
exchange of messages; `ShmClient` makes its calls over it.

The staging region grows to the largest call, up to the node's limit (stated at hello).
Calls run one at a time, in the order they are made (`InOrder`); a timeout or a broken
socket closes the connection.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import mmap
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvstore import errors
from kvstore.dataplane import in_place, shm_messages
from kvstore.dataplane.base import Admission, DataPlaneClient
from kvstore.dataplane.buffers import TransferBuffer, checked_buffers
from kvstore.dataplane.frames import Op, Reply, Request
from kvstore.dataplane.in_order import InOrder
from kvstore.dataplane.landing import Landing
from kvstore.dataplane.placed import PlacedRows
from kvstore.dataplane.regions import Region, SharedBuffers

T = TypeVar("T")
Handshake = Callable[[bytes], tuple[bytes, Admission]]  # b"" -> node's socket name, mine
KEEPALIVE_S = 30.0  # well inside the node's idle timeout (`ServerSettings.idle_timeout_s`)
FIRST_REGION_BYTES = 64 << 10  # what hello hands over; calls grow it (`_room`)
CALL_BYTES = 16 << 20  # a staged get moves in calls of at most this (or one block), two in flight


class ShmConnection(DataPlaneClient):
    """The connection under `ShmClient`'s calls; every exchange has a deadline (the
    socket's timeout)."""

    def __init__(self, handshake: Handshake, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.checksum_failures = 0  # received blocks that did not match the node's CRC32C
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # one exchange on the socket at a time
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._region: Region | None = None  # staging, index 0; grown by `_room`
        self._shared = SharedBuffers()
        self._limit = 0
        self._calls = InOrder("kvstore-shm-client")
        try:
            server_address, admission = handshake(b"")
            self.client_id = admission.client_id
            self._sock = shm_messages.connect(server_address, timeout_s)
            self._region, fd = Region.create(FIRST_REGION_BYTES)
            hello = shm_messages.encode_hello(admission.client_id, admission.secret)
            try:
                shm_messages.send(self._sock, hello, [fd])
            finally:
                os.close(fd)
            self._limit = self._reply(0).block_bytes
        except OSError as exc:
            self._abort()
            raise errors.UnavailableError(f"shm data plane unreachable: {exc}") from exc
        except BaseException:
            self._abort()
            raise
        threading.Thread(target=self._ping_forever, name="kvstore-shm-ping", daemon=True).start()

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

    def buffer(self, nbytes: int) -> np.ndarray:
        """`nbytes` of memory shared with the node: blocks a get places there are copied
        straight in by the node, and a put's are copied straight out, with no copy on this
        side. Its pages are touched here, on both sides, not on a first call. Raises
        InvalidArgumentError past the node's region limits."""
        return self._calls.run(self._guarded, self._add_buffer, nbytes)

    def _add_buffer(self, nbytes: int) -> np.ndarray:
        region = self._hand_over(self._shared.next_index, nbytes, touched=True)
        self._shared.add(region)
        return region.array

    def share(self, arrays: Sequence[np.ndarray]) -> int:
        """Shares host memory this process already has with the node, in place (`in_place`:
        nothing may write `arrays` meanwhile), so blocks there move as `buffer`'s do; returns
        the bytes shared. Raises InvalidArgumentError past the node's region limits."""
        return self._calls.run(self._guarded, self._share, arrays)

    def _share(self, arrays: Sequence[np.ndarray]) -> int:
        return in_place.share(arrays, self._limit, self._add_file, self._shared.overlaps)

    def _add_file(self, fd: int, windows: Sequence[in_place.Window]) -> None:
        self._send_region(self._shared.next_index, fd)
        self._shared.add_windows(windows)

    def place(self, arrays: Sequence[np.ndarray]) -> PlacedRows:
        """`arrays`' rows, checked and placed once for many `submit_get_placed` calls."""
        return self._calls.run(self._guarded, PlacedRows.of, self, arrays, self._shared)

    def warm_up(self) -> None:
        """Grows the staging region to what the largest staged calls use, and touches every
        page of it: a first large call would pay both (a new file, its page faults)."""
        self._calls.run(self._guarded, self._warm_staging)

    def _warm_staging(self) -> None:
        self._room(min(2 * CALL_BYTES, self._limit), touched=True).array[:: mmap.PAGESIZE] = 0

    def _abort(self) -> None:
        self._closed.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._calls.shutdown()
        if self._region is not None:  # unmapped now, or when a call still on it ends
            self._region.close()

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
        shm_messages.send(self._sock, shm_messages.encode_call(req, offsets))

    def _reply(self, num_keys: int, landing: Landing | None = None, get: bool = False) -> Reply:
        """The reply to the oldest call not answered (of `num_keys` keys); a GET's (`get`)
        LANDED notes before it go to `landing` (none: dropped, for a call drained after an
        error). Anything else the node sends breaks the stream (ConnectionError)."""
        assert self._sock is not None
        noted = landing.note if landing is not None else None
        reply = shm_messages.receive_reply(self._sock, num_keys, get, noted)
        if reply.error is not None:
            raise reply.error
        return reply

    def _hand_over(self, index: int, nbytes: int, touched: bool = False) -> Region:
        """A new region of `nbytes`, handed to the node at `index`; `touched`: every page of
        it written first, so the node maps them all at once (`regions.prefault`)."""
        region, fd = Region.create(nbytes)
        try:
            if touched:
                region.array[:: mmap.PAGESIZE] = 0
            self._send_region(index, fd)
        except BaseException:
            region.close()
            raise
        finally:
            os.close(fd)
        return region

    def _send_region(self, index: int, fd: int) -> None:
        assert self._sock is not None
        shm_messages.send(self._sock, bytes([shm_messages.Kind.REGION, index]), [fd])
        self._reply(0)

    def _room(self, nbytes: int, touched: bool = False) -> Region:
        """The staging region, grown (and handed to the node, `touched` if asked) to hold
        `nbytes`."""
        assert self._region is not None
        if nbytes > self._region.size:
            size = min(max(nbytes, 2 * self._region.size), self._limit)
            new = self._hand_over(0, size, touched)
            self._region.close()
            self._region = new
        return self._region
