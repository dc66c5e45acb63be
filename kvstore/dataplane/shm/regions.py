"""Shared-memory regions of the same-host data plane (`shm.server`, `shm.client`).

A client makes a memfd file, seals it against shrinking and hands it to the node over a
Unix socket; both map it, and the node copies blocks straight between the region and the
store's slots: one copy per block, as CMA makes, but into memory the client chose to share
rather than into its whole address space.

What makes mapping a hostile client's file safe for the node:

- only shared memory (a memfd on shmem) is taken: a disk file could fail a read, and
  hugetlbfs memory a write, with SIGBUS, which would end the node;
- it must be sealed against shrinking (`F_SEAL_SHRINK`), or a client truncating it under
  the node's mapping would fault the node the same way;
- its size is bounded, and the node touches only the ranges a request names, each checked
  against that size (`Region.span`).
- the pages it maps ahead of any request are only those the file already holds
  (`prefault`), through a call that fails rather than faults: the node allocates nothing a
  request has not named.

The client may still change its region while the node copies; that spoils only its own
call: a put's checksum is taken over the node's copy, a get's over the client's.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import fcntl
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.config import parse_bytes
from kvstore.dataplane.buffers import TransferBuffer, address_of

TMPFS_MAGIC = 0x01021994  # statfs f_type of shmem, where a plain memfd lives
_STATFS_BYTES = 256  # more than struct statfs on any Linux ABI; f_type comes first
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _filesystem_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ctypes.c_long.from_buffer(buf).value)


class Region:
    """A mapped shared-memory file: `array` is its bytes (uint8), writable by both sides."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self._map, np.uint8)

    @classmethod
    def create(cls, size: int) -> tuple[Region, int]:
        """A new region of `size` bytes and its file (sealed; the caller closes the fd)."""
        fd = os.memfd_create("kvstore-dataplane", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            return cls(fd, size), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def admit(cls, fd: int, max_bytes: int) -> Region:
        """Maps a client's file if it is one the node can safely touch; raises
        InvalidArgumentError (saying what is wrong) otherwise. Never closes `fd`."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise errors.InvalidArgumentError(
                "region is not a memfd (it cannot be sealed)"
            ) from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise errors.InvalidArgumentError("region is not sealed against shrinking")
        if _filesystem_type(fd) != TMPFS_MAGIC:
            raise errors.InvalidArgumentError("region is not plain shared memory (hugetlb?)")
        size = os.fstat(fd).st_size
        if not 0 < size <= max_bytes:
            raise errors.InvalidArgumentError(
                f"region of {size} bytes; 1 to {max_bytes} (max_shm_region_bytes)"
            )
        try:
            region = cls(fd, size)
        except (OSError, ValueError) as exc:  # e.g. sealed against writes since
            raise errors.InvalidArgumentError(f"region cannot be mapped: {exc}") from None
        prefault(region.array)
        return region

    def span(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) of the region; InvalidArgumentError if outside."""
        if not (offset >= 0 and nbytes > 0 and offset + nbytes <= self.size):
            raise errors.InvalidArgumentError(
                f"range [{offset}, {offset + nbytes}) is outside the {self.size}-byte region"
            )
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        """Unmaps the region; views of it must not be used after."""
        del self.array
        with contextlib.suppress(BufferError):  # a view still held: unmapped when it goes
            self._map.close()


def prefault(array: np.ndarray) -> None:
    """Maps every page of `array`'s mapping that its file already holds (a shared region),
    ready for writing.

    A first write to a page of a shared mapping faults once per 4 KiB page (reads fault
    around, 16 pages at a time): copying 128 MiB into pages mapped but never touched here
    costs about four times the copy itself. Paid here, once per region, the cost leaves the
    calls. Pages the file does not hold yet stay holes: filling them is the memory's owner's
    call, not the mapper's. Best effort: a kernel without MADV_POPULATE_WRITE (before 5.14)
    faults them as the calls touch them."""
    address, nbytes = address_of(array), array.nbytes
    held = np.empty(-(-nbytes // mmap.PAGESIZE), np.uint8)
    if not nbytes or _libc.mincore(address, nbytes, held.ctypes.data) != 0:
        return
    edges = np.flatnonzero(np.diff(held & 1, prepend=0, append=0))
    for first, end in edges.reshape(-1, 2) * mmap.PAGESIZE:
        length = min(int(end), nbytes) - int(first)
        if _libc.madvise(address + int(first), length, _MADV_POPULATE_WRITE) != 0:
            return


def _piece_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Half a core's L2 cache (512 KiB where Linux does not say): how much `copy` and
    `copy_summed` move per call.

    A piece fits the L2 with room to spare, so `copy_summed` sums it from there; and glibc
    copies it with `rep movsb`, which it stops using at the L2's size on AMD for a vector
    loop: on a Zen 4 host (1 MiB of L2) 64 MiB copied in pieces of 512 KiB took 4.7 ms, in
    pieces of 1 MiB 6.1."""
    with contextlib.suppress(OSError, errors.InvalidArgumentError):
        for cache in sorted(caches.glob("index*")):
            kind = (cache / "type").read_text().strip()
            if (cache / "level").read_text().strip() == "2" and kind != "Instruction":
                return max(64 << 10, parse_bytes((cache / "size").read_text().strip()) // 2)
    return 512 << 10


PIECE_BYTES = _piece_bytes()
INDEX_SHIFT = 56  # a placement: region index in its top byte, offset in the rest
OFFSET_MASK = (1 << INDEX_SHIFT) - 1


def placement(index: int, offset: int) -> int:
    """Where a block is: byte `offset` of region `index` (`Regions`), as one u64."""
    return index << INDEX_SHIFT | offset


class Regions:
    """The regions of one connection by index: 0 is the client's staging region, the others
    hold caller buffers (`ShmClient.buffer`); at most `max_regions` of them."""

    def __init__(self, max_regions: int) -> None:
        self.max_regions = max_regions
        self._by_index: dict[int, Region] = {}

    def __len__(self) -> int:
        return len(self._by_index)

    def set(self, index: int, region: Region) -> None:
        """Puts `region` at `index`, replacing (and unmapping) the one there."""
        if not 0 <= index < self.max_regions:
            region.close()
            raise errors.InvalidArgumentError(
                f"region index {index}; 0 to {self.max_regions - 1} (max_shm_regions)"
            )
        old = self._by_index.pop(index, None)
        if old is not None:
            old.close()
        self._by_index[index] = region

    def span(self, where: int, nbytes: int) -> np.ndarray:
        """The bytes a placement names; InvalidArgumentError if no region holds them."""
        region = self._by_index.get(where >> INDEX_SHIFT)
        if region is None:
            raise errors.InvalidArgumentError(f"no region {where >> INDEX_SHIFT} was handed over")
        return region.span(where & OFFSET_MASK, nbytes)

    def close(self) -> None:
        for region in self._by_index.values():
            region.close()
        self._by_index.clear()


class SharedBuffers:
    """Where a client's memory shared with the node lies: regions 1, 2, ... of its
    connection, each mapped here in one piece (`ShmClient.buffer`) or in windows over
    memory the process already had (`ShmClient.share`, `in_place`)."""

    def __init__(self) -> None:
        self.next_index = 1  # the index the next region handed over takes
        self._regions: list[Region] = []  # kept mapped as long as the connection
        self._starts: list[int] = []  # windows by address: starts, and (end, placement)
        self._windows: list[tuple[int, int]] = []

    def add(self, region: Region) -> None:
        """`region`, mapped here whole, is the next index's."""
        self._regions.append(region)
        self.add_windows([(address_of(region.array), region.size, 0)])

    def add_windows(self, windows: Sequence[tuple[int, int, int]]) -> None:
        """The next index's file is mapped here in `windows` (address, nbytes, offset)."""
        for address, nbytes, offset in windows:
            at = bisect.bisect(self._starts, address)
            self._starts.insert(at, address)
            self._windows.insert(at, (address + nbytes, placement(self.next_index, offset)))
        self.next_index += 1

    def overlaps(self, address: int, nbytes: int) -> bool:
        """Whether any of [address, address + nbytes) is shared already."""
        at = bisect.bisect(self._starts, address + nbytes - 1) - 1
        return at >= 0 and self._windows[at][0] > address

    def where(self, parts: Sequence[Sequence[TransferBuffer]]) -> list[list[int]] | None:
        """The placement of every buffer (`parts[s][i]` -> `[s][i]`), or None unless they
        all lie in shared memory."""
        if not self._starts:
            return None
        out = []
        for part in parts:
            row = [self._placed(b) for b in part]
            if None in row:
                return None
            out.append(row)
        return out  # type: ignore[return-value]

    def _placed(self, buf: TransferBuffer) -> int | None:
        if buf.is_device:
            return None
        address = address_of(buf.obj) if buf.address is None else buf.address
        return self.placed_at(address, buf.nbytes)

    def placed_at(self, start: int, nbytes: int) -> int | None:
        """The placement of the `nbytes` at address `start`, or None unless all are in one
        shared window."""
        at = bisect.bisect(self._starts, start) - 1
        if at < 0:
            return None
        end, where = self._windows[at]
        return where + start - self._starts[at] if start + nbytes <= end else None


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for two uint8 arrays of one size, in pieces of at most PIECE_BYTES
    (numpy lets go of the GIL meanwhile)."""
    if dst.shape != src.shape:  # never broadcast
        raise ValueError(f"copy of {src.shape} bytes into {dst.shape}")
    if dst.nbytes <= PIECE_BYTES:
        np.copyto(dst, src, casting="no")
        return
    for start in range(0, dst.nbytes, PIECE_BYTES):
        np.copyto(dst[start : start + PIECE_BYTES], src[start : start + PIECE_BYTES], casting="no")


def copy_summed(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
    """`copy`, in pieces, each summed as soon as it is copied (from the cache, not from
    memory: a second pass over a large block would read it all again); returns the CRC32C
    of `dst` (continuing `crc`)."""
    if dst.shape != src.shape:
        raise ValueError(f"copy of {src.shape} bytes into {dst.shape}")
    for start in range(0, dst.nbytes, PIECE_BYTES):
        piece = dst[start : start + PIECE_BYTES]
        np.copyto(piece, src[start : start + PIECE_BYTES], casting="no")
        crc = checksum(piece, crc)
    return crc
