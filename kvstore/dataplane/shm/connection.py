"""One same-host data-plane connection, client side: the Unix socket to one node
(`shm.server`, over `sockets.connection`), the staging region and the memory shared with it
(`regions`); `ShmClient` makes its calls over it.

The staging region grows to the largest call, up to the node's limit (stated at hello).
"""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Sequence

import numpy as np

from kvstore.dataplane.base import Admission
from kvstore.dataplane.shm import in_place
from kvstore.dataplane.shm.crew import Crew
from kvstore.dataplane.shm.placed_rows import PlacedRows
from kvstore.dataplane.shm.regions import Region, SharedBuffers
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.dataplane.sockets.connection import Handshake, SocketConnection

FIRST_REGION_BYTES = 64 << 10  # what hello hands over; calls grow it (`_room`)
CALL_BYTES = 16 << 20  # a staged get moves in calls of at most this (or one block), two in flight


class ShmConnection(SocketConnection):
    """The connection under `ShmClient`'s calls."""

    plane = "shm"

    def __init__(self, handshake: Handshake, timeout_s: float = 30.0) -> None:
        self._region: Region | None = None  # staging, index 0; grown by `_room`
        self._shared = SharedBuffers()
        self._limit = 0
        self._crew = Crew.for_host()  # copies a staged put's blocks beside the caller's thread
        super().__init__(handshake, timeout_s)

    def _connect(self, server_address: bytes) -> socket.socket:
        return socket_messages.connect(server_address, self.timeout_s)

    def _hello(self, admission: Admission) -> None:
        assert self._sock is not None
        self._region, fd = Region.create(FIRST_REGION_BYTES)
        hello = socket_messages.encode_hello(admission.client_id, admission.secret)
        try:
            socket_messages.send(self._sock, hello, [fd])
        finally:
            os.close(fd)
        self._limit = self._reply(0).block_bytes

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
        super()._abort()
        self._crew.shutdown()
        if self._region is not None:  # unmapped now, or when a call still on it ends
            self._region.close()

    # -- protocol (the lock held) --------------------------------------------------------

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
        socket_messages.send(self._sock, bytes([socket_messages.Kind.REGION, index]), [fd])
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
