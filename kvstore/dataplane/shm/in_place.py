"""Memory a process already has, moved in place onto files it can share with a node.

`ShmClient.buffer` makes new memory shared with the node; memory a framework allocated
itself (vLLM's paged KV cache) cannot be made again. Its pages are moved instead, at the
same addresses: their bytes are copied into a memfd, then the memfd is mapped over the
same range (`MAP_FIXED`, its pages mapped at once rather than one fault each on first
touch), so every pointer into it stays valid and reads see the same bytes, and the node,
which maps the same file (`regions.prefault`), copies blocks straight into it.

    before:  [ anonymous pages of the KV cache ]
    after:   [ memfd pages, offsets 0..n       ]   the node maps the memfd too

Only whole pages inside the arrays move: the partial pages at their ends may hold other
allocations, which another thread could write while they are copied. A block that touches
them goes through staging. Nothing may write the arrays while they move (vLLM hands its
KV cache to a connector before the first step). Moves go in steps of `STEP_BYTES`, so at
most that much memory is held twice.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvstore import errors
from kvstore.dataplane.buffers import address_of

PAGE = mmap.PAGESIZE
STEP_BYTES = 64 << 20
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip


class Window(NamedTuple):
    """`nbytes` at `address` in this process, mapped from byte `offset` of a shared file."""

    address: int
    nbytes: int
    offset: int


def share(
    arrays: Sequence[np.ndarray],
    file_bytes: int,
    hand_over: Callable[[int, list[Window]], None],
    shared: Callable[[int, int], bool],
) -> int:
    """Moves the whole pages inside `arrays` onto files of at most `file_bytes` each,
    handing each file over (`hand_over(fd, its windows)`; the fd is closed after) as soon
    as it is made; returns the bytes moved. A run of pages any of which is `shared(address,
    nbytes)` already is left as it is. ResourceExhaustedError if memory for a file
    cannot be had (the windows moved before stay moved, and as they were)."""
    moved = 0
    spans = [span for span in interiors(arrays) if not shared(*span)]
    for windows in layout(spans, file_bytes):
        try:
            fd = move(windows)
        except OSError as exc:  # this process's memory, not the connection, failed
            raise errors.ResourceExhaustedError(f"memory not shared: {exc}") from exc
        try:
            hand_over(fd, windows)
        finally:
            os.close(fd)
        moved += sum(w.nbytes for w in windows)
    return moved


def interiors(arrays: Sequence[np.ndarray]) -> list[tuple[int, int]]:
    """The whole pages inside the memory of `arrays` (each one contiguous run of bytes), as
    (address, nbytes), ordered; arrays that touch or overlap count as one run."""
    runs: list[list[int]] = []
    for start, end in sorted((address_of(a), address_of(a) + a.nbytes) for a in arrays):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        elif end > start:
            runs.append([start, end])
    pages = ((-(-start // PAGE) * PAGE, end // PAGE * PAGE) for start, end in runs)
    return [(start, end - start) for start, end in pages if end > start]


def layout(spans: Sequence[tuple[int, int]], file_bytes: int) -> list[list[Window]]:
    """`spans` laid out over files of at most `file_bytes` each: one list of windows per
    file. A span goes whole into the file being filled, or else into a new one; only a
    span larger than a file is split (at whole files), since a block across two files
    cannot be placed in one and goes through staging."""
    assert file_bytes >= PAGE, f"files of {file_bytes} bytes hold no page"
    room = file_bytes // PAGE * PAGE
    files: list[list[Window]] = [[]]
    used = 0
    for address, nbytes in spans:
        if used and nbytes > room - used:
            files.append([])
            used = 0
        while nbytes:
            if used == room:
                files.append([])
                used = 0
            take = min(nbytes, room - used)
            files[-1].append(Window(address, take, used))
            address, nbytes, used = address + take, nbytes - take, used + take
    return [f for f in files if f]


def move(windows: Sequence[Window]) -> int:
    """Moves the memory of `windows` onto one new memfd (sealed against shrinking, as a
    node requires) at their offsets; returns its fd, which the caller closes."""
    size = max(w.offset + w.nbytes for w in windows)
    fd = os.memfd_create("kvstore-in-place", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        for w in windows:
            for step in range(0, w.nbytes, STEP_BYTES):
                _move_step(fd, w.address + step, min(STEP_BYTES, w.nbytes - step), w.offset + step)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _move_step(fd: int, address: int, nbytes: int, offset: int) -> None:
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    done = 0
    while done < nbytes:
        done += os.pwrite(fd, view[done:], offset + done)
    flags = mmap.MAP_SHARED | _MAP_FIXED | mmap.MAP_POPULATE  # first touches paid here
    got = _libc.mmap(address, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
    if got == _MAP_FAILED or got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mapping over {nbytes} bytes at {address:#x}: {os.strerror(err)}")
