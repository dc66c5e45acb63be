"""The `shm-ceiling` row of the `dataplane` suite: the least work a checked same-host
transfer does, with no store, no protocol and no Python per call, in two processes.

What every shm get and put must do, and nothing else:

- get: the node copies each block from its own memory into a region the client shares
  (a memfd, as `ShmClient.buffer` makes), and says so, one byte per block on a Unix
  socket; the client sums each block where it landed (CRC32C, the check every get makes).
- put: the client says go, then sums its blocks and sends the sums (an eager put); the
  node copies each block from the region into its own memory, summing its copy piece by
  piece (`copy_summed`), on its thread and an idle helper's as a kvstore node does
  (`crew`), then reads the sums and says done.

Both sides run at once on their own cores, block by block: about as close as two
processes can pipeline a copy and a check. On a host with two cores the two passes share
them (and memory bandwidth). A kvstore shm transfer does this work and more, so it beats
this row only by the run's noise; the suite prints kvstore's ratio to it beside the ratio
to memcpy, and this row's own ratio to memcpy.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import struct
from typing import Any

import numpy as np

from kvstore.bench.dataplane_peers import Cell, _recv_into, _timed
from kvstore.checksum import checksum
from kvstore.dataplane.shm.crew import Crew
from kvstore.dataplane.shm.regions import Region, copy, copy_summed

_CELL = struct.Struct("<cQQ")  # op, batch, block_bytes; one per cell, then b"g" per batch


def _receive(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    _recv_into(sock, memoryview(data))
    return bytes(data)


def serve_node(name_queue: Any) -> None:
    """The node's side: on an abstract Unix socket (its name put in `name_queue`), takes
    the driver's region, then serves the cells the driver names."""
    name = b"\0kvstore-ceiling-" + secrets.token_hex(8).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(name)
        listener.listen(1)
        name_queue.put(name)
        sock, _ = listener.accept()
    with sock:
        _serve(sock)


def _serve(sock: socket.socket) -> None:
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    size = os.fstat(fds[0]).st_size
    region = Region(fds[0], size)
    os.close(fds[0])
    slots, crew = np.ones(0, np.uint8), Crew.for_host()
    while True:
        try:
            op, batch, block = _CELL.unpack(_receive(sock, _CELL.size))
        except ConnectionError:
            return
        if len(slots) < batch * block:  # the store's memory, touched once
            slots = np.ones(batch * block, np.uint8)
        sock.sendall(b"k")
        mine = [slots[i * block : (i + 1) * block] for i in range(batch)]
        theirs = [region.array[i * block : (i + 1) * block] for i in range(batch)]
        while _receive(sock, 1) == b"g":
            if op == b"G":
                for i in range(batch):
                    copy(theirs[i], mine[i])
                    sock.sendall(b"b")
            else:
                pairs = zip(mine, theirs, strict=True)
                crew.run([functools.partial(copy_summed, m, t) for m, t in pairs], batch * block)
                _receive(sock, 4 * batch)  # the client's sums
                sock.sendall(b"d")


def drive(name: bytes, reps: dict[Cell, int]) -> dict[Cell, list[float]]:
    """Times `reps[cell]` batches of every cell against the node serving at `name`; the
    region holds the largest batch."""
    largest = max(size * batch for _, size, batch in reps)
    region, fd = Region.create(largest)
    region.array[:] = 1
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(name)
            socket.send_fds(sock, [b"r"], [fd])
            return {cell: _drive_cell(sock, region, cell, n) for cell, n in reps.items()}
    finally:
        os.close(fd)


def _drive_cell(sock: socket.socket, region: Region, cell: Cell, reps: int) -> list[float]:
    op, block, batch = cell
    sock.sendall(_CELL.pack(op[0].upper().encode(), batch, block))
    _receive(sock, 1)
    blocks = [region.array[i * block : (i + 1) * block] for i in range(batch)]

    def get() -> None:
        sock.sendall(b"g")
        for b in blocks:
            _receive(sock, 1)
            checksum(b)

    def put() -> None:
        sock.sendall(b"g")
        sums = [checksum(b) for b in blocks]
        sock.sendall(struct.pack(f"<{batch}I", *sums))
        _receive(sock, 1)

    times = _timed(get if op == "get" else put, reps)
    sock.sendall(b"s")  # the node waits for the next cell
    return times
