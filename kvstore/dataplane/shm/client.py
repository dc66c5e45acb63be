"""The client's same-host calls, over one `ShmConnection` to a node (`shm.server`).

Caller buffers in memory shared with the node (`buffer`, `share`) get their blocks copied
straight in and out by the node; others go through the staging region (the node copies a
get's blocks into it and the client copies them on; a put's are copied into it first). A
get's blocks are checked against the node's CRC32C where the caller will read them (a
failure is a miss, never found); the node commits a put only if its copy matches the sums.
A get larger than the staging region goes in several calls; a staged put must fit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.dataplane import frames
from kvstore.dataplane.buffers import TransferBuffer, check_keys, host_bytes
from kvstore.dataplane.frames import STATUS_CODES, Op, Reply, Request
from kvstore.dataplane.shm.connection import CALL_BYTES, ShmConnection
from kvstore.dataplane.shm.placed_rows import PlacedRows
from kvstore.dataplane.shm.regions import copy_summed, placement
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.dataplane.sockets.landing import Landing, Take, copied_out, summed
from kvstore.results import ReserveResult

log = logging.getLogger("kvstore.dataplane")


class ShmClient(ShmConnection):
    """Gets into and puts from caller buffers through shared memory."""

    def submit_get_placed(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        placed: PlacedRows,
        rows: Sequence[int],
        on_part: Callable[[int], None] | None = None,
    ) -> concurrent.futures.Future[tuple[bool, ...]] | None:
        """`submit_get_parts` into rows `rows` of `placed` (`place`): part s of key i lands
        in `placed.arrays[s][rows[i]]`. None (nothing sent) unless all are shared."""
        if placed.owner is not self or len(keys) != len(rows):
            raise errors.InvalidArgumentError("placed rows of another connection or keys")
        block_bytes = placed.row_bytes * placed.num_parts
        check_keys(keys)
        frames.check_segments(len(keys), block_bytes, placed.num_parts)
        offsets = placed.select(rows)
        if offsets is None:
            return None
        take = placed.summer(list(rows))
        args = (tuple(keys), placed.num_parts, block_bytes, offsets, take, on_part)
        return self._submit(self._get_shared, namespace_id, *args)

    def _put_args(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        parents: Sequence[bytes | None] | None,
        block_bytes: int,
    ) -> tuple[Any, ...]:
        args = super()._put_args(namespace_id, keys, blocks, parents, block_bytes)
        where = self._shared.where([args[2]])  # the checked buffers
        if where is None and len(keys) * block_bytes > self._limit:
            raise errors.BatchTooLargeError(
                f"a put of {len(keys) * block_bytes} bytes; the node's shared-memory region "
                f"holds at most {self._limit} (max_shm_region_bytes)"
            )
        return (*args, where)

    def _stage(self, bufs: list[TransferBuffer], block_bytes: int) -> list[int]:
        """Copies block i into the staging region at `i * block_bytes`; returns the CRC32C
        of each staged copy. Host blocks are copied on this thread and any idle helper's
        of the connection's crew; device blocks one after another on this one."""
        region = self._room(len(bufs) * block_bytes)

        def stage(i: int) -> int:
            staged = region.array[i * block_bytes : (i + 1) * block_bytes]
            return copy_summed(staged, np.frombuffer(host_bytes(bufs[i]), np.uint8))

        if any(b.is_device for b in bufs):
            return [stage(i) for i in range(len(bufs))]
        jobs = [functools.partial(stage, i) for i in range(len(bufs))]
        return self._crew.run(jobs, len(bufs) * block_bytes)

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
        take = functools.partial(summed, parts)
        return self._get_shared(namespace_id, keys, len(parts), block_bytes, offsets, take, on_part)

    def _get_shared(
        self,
        namespace_id: bytes,
        keys: tuple[bytes, ...],
        segments: int,
        block_bytes: int,
        offsets: list[int],
        take: Take,
        on_part: Callable[[int], None] | None,
    ) -> tuple[bool, ...]:
        """A GET into shared memory at `offsets`, its blocks taken as they land."""
        rid = self._send_get(namespace_id, keys, segments, block_bytes, offsets)
        calling = Landing(rid, len(keys), take, segments, on_part)
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
            socket_messages.send(self._sock, socket_messages.encode_sums(req.request_id, sums))
        else:
            sums = self._stage(bufs, block_bytes)
            offsets = [placement(0, i * block_bytes) for i in range(len(keys))]
            self._send(req._replace(checksums=tuple(sums)), offsets)
        reply = self._reply(len(keys))
        if any(f >= len(STATUS_CODES) for f in reply.flags):
            raise ConnectionError("data-plane put reply is malformed")
        return ReserveResult(reply.reservation_id, tuple(STATUS_CODES[f] for f in reply.flags))
