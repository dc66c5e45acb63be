"""The client's same-host side: one Unix socket and shared-memory regions (`regions`) to
one node (`shm_server`).

Caller buffers from `ShmClient.buffer` are shared with the node, which copies blocks
straight into and out of them; others go through the staging region (the node copies a
get's blocks into it and the client copies them on; a put's are copied into it first). A
get's blocks are checked against the node's CRC32C where the caller will read them (a
failure is a miss, never found); the node commits a put only if its copy matches the sums.

The staging region grows to the largest call, up to the node's limit (stated at hello): a
get larger goes in several calls, a staged put must fit. Calls run one at a time, in the
order they are made (`InOrder`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import mmap
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.dataplane import frames, in_place, shm_messages
from kvstore.dataplane.base import Admission, DataPlaneClient
from kvstore.dataplane.buffers import TransferBuffer, checked_buffers, host_bytes
from kvstore.dataplane.frames import Op, Reply, Request
from kvstore.dataplane.in_order import InOrder
from kvstore.dataplane.landing import Landing, copied_out, summed
from kvstore.dataplane.regions import Region, SharedBuffers, copy_summed, placement
from kvstore.dataplane.ucx_server import STATUS_CODES
from kvstore.results import ReserveResult

log = logging.getLogger("kvstore.dataplane")
T = TypeVar("T")
Handshake = Callable[[bytes], tuple[bytes, Admission]]  # b"" -> node's socket name, mine
KEEPALIVE_S = 30.0  # well inside the node's idle timeout (`ServerSettings.idle_timeout_s`)
FIRST_REGION_BYTES = 64 << 10  # what hello hands over; calls grow it (`_room`)
CALL_BYTES = 16 << 20  # a staged get moves in calls of at most this (or one block), two in flight


class ShmClient(DataPlaneClient):
    """Gets into and puts from caller buffers through shared memory; every call has a
    deadline (the socket's timeout)."""

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
        side. Raises InvalidArgumentError past the node's region limits."""
        return self._calls.run(self._guarded, self._add_buffer, nbytes)

    def _add_buffer(self, nbytes: int) -> np.ndarray:
        region = self._hand_over(self._shared.next_index, nbytes)
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

    def warm_up(self) -> None:
        """Grows the staging region to what the largest staged calls use, and touches every
        page of it: a first large call would pay both (a new file, its page faults)."""
        self._calls.run(self._guarded, self._warm_staging)

    def _warm_staging(self) -> None:
        self._room(min(2 * CALL_BYTES, self._limit)).array[:: mmap.PAGESIZE] = 0

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

    # -- calls ---------------------------------------------------------------------------

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
        bufs = self._checked(keys, blocks, block_bytes, writable=False)
        where = self._shared.where([bufs])
        if where is None and len(keys) * block_bytes > self._limit:
            raise errors.BatchTooLargeError(
                f"a put of {len(keys) * block_bytes} bytes; the node's shared-memory region "
                f"holds at most {self._limit} (max_shm_region_bytes)"
            )
        parents_t = tuple(parents) if parents is not None else None
        return (namespace_id, tuple(keys), bufs, parents_t, block_bytes, where)

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

    def _hand_over(self, index: int, nbytes: int) -> Region:
        """A new region of `nbytes`, handed to the node at `index`."""
        region, fd = Region.create(nbytes)
        try:
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

    def _room(self, nbytes: int) -> Region:
        """The staging region, grown (and handed to the node) to hold `nbytes`."""
        assert self._region is not None
        if nbytes > self._region.size:
            new = self._hand_over(0, min(max(nbytes, 2 * self._region.size), self._limit))
            self._region.close()
            self._region = new
        return self._region

    def _get(
        self,
        namespace_id: bytes,
        keys: tuple[bytes, ...],
        parts: list[list[TransferBuffer]],
        block_bytes: int,
        on_part: Callable[[int], None] | None,
    ) -> tuple[bool, ...]:
        """`parts[s][i]`: where part s of key i lands; `on_part(s)` once every part s has.

        Every block is checked (and copied out of staging) as the node says it landed
        (`Landing`), while the node copies the next ones. Into shared buffers in one call,
        parts part-major (`on_part(s)` as each is in, later ones still being copied);
        through staging in calls of a quarter of the keys (at most CALL_BYTES), two in
        flight, one in each half of the region (`on_part` at the end).
        """
        where = self._shared.where(parts)
        if where is None:
            found = self._get_staged(namespace_id, keys, parts, block_bytes)
            if on_part is not None:
                for part in range(len(parts)):
                    on_part(part)
            return tuple(found)
        offsets = [p for part in where for p in part]
        rid = self._send_get(namespace_id, keys, len(parts), block_bytes, offsets)
        take = functools.partial(summed, parts)
        calling = Landing(rid, len(keys), take, len(parts), on_part)
        return tuple(self._finish(calling, self._reply(len(keys), calling, True)))

    def _get_staged(
        self,
        namespace_id: bytes,
        keys: tuple[bytes, ...],
        parts: list[list[TransferBuffer]],
        block_bytes: int,
    ) -> list[bool]:
        per_call = max(1, min(-(-len(keys) // 4), CALL_BYTES // block_bytes))
        per_call = min(per_call, max(1, self._limit // (2 * block_bytes)))
        calls = [slice(a, a + per_call) for a in range(0, len(keys), per_call)]
        half, segments = per_call * block_bytes, len(parts)
        depth = 2 if len(calls) > 1 and 2 * half <= self._limit else 1
        region = self._room(depth * half)
        size = block_bytes // segments

        def send(k: int) -> int:  # block i of call k whole at i * block_bytes in its half
            n, base = len(keys[calls[k]]), (k % depth) * half
            offsets = [base + i * block_bytes + s * size for s in range(segments) for i in range(n)]
            return self._send_get(namespace_id, keys[calls[k]], segments, block_bytes, offsets)

        sent = [send(k) for k in range(depth)]
        found: list[bool] = []
        for k, call in enumerate(calls):
            take = functools.partial(copied_out, [p[call] for p in parts], region, k % depth * half)
            calling = Landing(sent[k], len(keys[call]), take, segments)
            found += self._finish(calling, self._get_reply(keys, calls[k : k + depth], calling))
            if k + depth < len(calls):
                sent.append(send(k + depth))
        return found

    def _get_reply(self, keys: tuple[bytes, ...], due: list[slice], landing: Landing) -> Reply:
        """The reply to the call of `due[0]`'s keys; after an error reply, the replies to
        the later calls still `due` are read and dropped first (the stream stays in step)."""
        try:
            return self._reply(len(keys[due[0]]), landing, True)
        except errors.KVStoreError:
            for later in due[1:]:
                with contextlib.suppress(errors.KVStoreError):
                    self._reply(len(keys[later]), None, True)
            raise

    def _send_get(
        self,
        namespace_id: bytes,
        keys: tuple[bytes, ...],
        segments: int,
        block_bytes: int,
        offsets: list[int],
    ) -> int:
        req = Request(Op.GET, next(self._ids), namespace_id, keys, block_bytes, segments=segments)
        self._send(req, offsets)
        return req.request_id

    def _finish(self, landing: Landing, reply: Reply) -> list[bool]:
        """Which keys a GET found, with blocks matching the node's CRC32C; counts failures."""
        found = landing.finish(reply)
        failures = sum(map(bool, reply.flags)) - sum(found)
        if failures:
            self.checksum_failures += failures
            log.warning("event=shm_checksum_failure client=%d blocks=%d", self.client_id, failures)
        return found

    def _put(
        self,
        namespace_id: bytes,
        keys: tuple[bytes, ...],
        bufs: list[TransferBuffer],
        parents: tuple[bytes | None, ...] | None,
        block_bytes: int,
        where: list[list[int]] | None,
    ) -> ReserveResult:
        """Shared buffers (`where[0]`): eager, summed while the node copies; else staged."""
        req = Request(Op.PUT, next(self._ids), namespace_id, keys, block_bytes, parents)
        if where is not None:
            self._send(req._replace(checksums=(0,) * len(keys), eager=True), where[0])
            sums = [checksum(b.obj) for b in bufs]
            assert self._sock is not None
            shm_messages.send(self._sock, shm_messages.encode_sums(req.request_id, sums))
        else:
            region, sums = self._room(len(keys) * block_bytes), []
            for i, buf in enumerate(bufs):
                staged = region.array[i * block_bytes : (i + 1) * block_bytes]
                sums.append(copy_summed(staged, np.frombuffer(host_bytes(buf), np.uint8)))
            offsets = [placement(0, i * block_bytes) for i in range(len(keys))]
            self._send(req._replace(checksums=tuple(sums)), offsets)
        reply = self._reply(len(keys))
        if any(f >= len(STATUS_CODES) for f in reply.flags):
            raise ConnectionError("data-plane put reply is malformed")
        return ReserveResult(reply.reservation_id, tuple(STATUS_CODES[f] for f in reply.flags))
