"""Block bytes on a stream socket (the tcp plane): many buffers per system call, each byte
copied once, by the kernel, between the socket and the caller's memory.

Every function raises ConnectionError if the peer closes the stream, and TimeoutError
(an OSError) once `deadline` (monotonic seconds) has passed with bytes still to move: a
peer that takes or sends a byte now and then cannot stretch a transfer past it. The
socket's own timeout is as it was when they return.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence

from kvstore.checksum import checksum

SCRATCH_BYTES = 1 << 20  # what bytes nobody keeps are received into, a piece at a time
# Bytes moved between two passes of summing: summed right after the socket moved them, they
# are still in the core's cache (a pass over memory the copy just left costs about as
# much as the copy did).
PIECE_BYTES = 256 << 10
_MAX_IOV = 512  # buffers per sendmsg/recvmsg_into (Linux takes up to IOV_MAX, 1024)
# Bytes per system call at most. While a call copies, the socket is the caller's and the
# peer's ACKs wait in its backlog; in calls of 1 MiB, gets of 64 blocks of 256 KiB to 16 MiB
# went 18-21% faster than in one call over the whole batch (calls of 512 KiB-2 MiB alike,
# of 256 KiB no faster).
CALL_BYTES = 1 << 20


def pieces(views: Sequence[memoryview]) -> Iterator[list[tuple[int, memoryview]]]:
    """`views` cut into runs of at most PIECE_BYTES, in order: each run a list of (index
    into `views`, a slice of that view); a view longer than PIECE_BYTES spans several."""
    run: list[tuple[int, memoryview]] = []
    room = PIECE_BYTES
    for i, view in enumerate(views):
        while view.nbytes:
            piece, view = view[:room], view[room:]
            run.append((i, piece))
            room -= piece.nbytes
            if not room:
                yield run
                run, room = [], PIECE_BYTES
    if run:
        yield run


def send_summed(
    sock: socket.socket, views: Sequence[memoryview], sums: list[int], deadline: float
) -> None:
    """Sends every byte of `views`, in order, adding each piece to `sums[i]` (the CRC32C
    of view i so far) once the socket has taken it."""
    _summed(sock, views, sums, deadline, sock.sendmsg)


def receive_summed(
    sock: socket.socket, views: Sequence[memoryview], sums: list[int], deadline: float
) -> None:
    """Fills every byte of `views`, in order, adding each piece to `sums[i]` (the CRC32C of
    view i so far) as soon as it has landed."""

    def receive(buffers: list[memoryview]) -> int:
        got = sock.recvmsg_into(buffers)[0]
        if got == 0:
            raise ConnectionError("the peer closed the connection")
        return got

    _summed(sock, views, sums, deadline, receive)


def send_all(sock: socket.socket, views: Sequence[memoryview], deadline: float) -> None:
    """Sends every byte of `views`, in order."""
    with _until(sock, deadline) as wait:
        _move_all(views, wait, sock.sendmsg)


def drain(sock: socket.socket, nbytes: int, scratch: bytearray, deadline: float) -> None:
    """Receives `nbytes` into `scratch`, a piece at a time, and keeps none of them."""
    into = memoryview(scratch)
    with _until(sock, deadline) as wait:
        while nbytes:
            wait()
            got = sock.recv_into(into, min(nbytes, len(into)))
            if got == 0:
                raise ConnectionError("the peer closed the connection")
            nbytes -= got


def _summed(
    sock: socket.socket,
    views: Sequence[memoryview],
    sums: list[int],
    deadline: float,
    move: Callable[[list[memoryview]], int],
) -> None:
    """Moves `views` a run of pieces at a time (`move`: one system call over some buffers,
    returning the bytes moved), summing each run while it is in cache."""
    with _until(sock, deadline) as wait:
        for run in pieces(views):
            _move_all([piece for _, piece in run], wait, move)
            for i, piece in run:
                sums[i] = checksum(piece, sums[i])


def _move_all(
    views: Sequence[memoryview], wait: Callable[[], None], move: Callable[[list[memoryview]], int]
) -> None:
    """Calls `move` until every byte of `views` has moved, `wait()` before each call."""
    pending = [v for v in views if v.nbytes]
    while pending:
        wait()
        pending = _advance(pending, move(_first_bytes(pending, CALL_BYTES)))


def _first_bytes(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first `nbytes` of `views` (fewer where they hold fewer), in at most _MAX_IOV
    buffers, the last one cut short where it runs past."""
    out: list[memoryview] = []
    for view in views[:_MAX_IOV]:
        out.append(view[:nbytes])
        nbytes -= out[-1].nbytes
        if not nbytes:
            break
    return out


@contextlib.contextmanager
def _until(sock: socket.socket, deadline: float) -> Iterator[Callable[[], None]]:
    """A `wait()` that sets the socket's timeout to what is left until `deadline` (raising
    TimeoutError if nothing is); the socket's timeout is put back after."""
    saved = sock.gettimeout()

    def wait() -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the transfer deadline passed")
        sock.settimeout(left)

    try:
        yield wait
    finally:
        sock.settimeout(saved)


def _advance(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """`views` without their first `nbytes` bytes."""
    i = 0
    while nbytes and nbytes >= views[i].nbytes:
        nbytes -= views[i].nbytes
        i += 1
    rest = views[i:]
    if nbytes:
        rest[0] = rest[0][nbytes:]
    return rest
