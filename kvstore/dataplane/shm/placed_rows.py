"""Rows of memory shared with a node, checked and placed once for many gets.

A get into caller buffers wraps and checks every buffer and finds where it lies in shared
memory, per call: microseconds and a few Python objects per buffer. A paged KV cache
loaded over and over (vLLM's, shared in place at start-up) is the same rows every time,
only other ones: `ShmClient.place` does that work once for all of them, and a get then
names its rows by number (`ShmClient.submit_get_placed`), with no object per row. The
objects matter as much as the time: in a process with a large heap (a vLLM CPU worker:
about 700k objects, not frozen) a few thousand new ones start a collection, and a full
one pauses every thread of the process for a third of a second.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.dataplane.buffers import address_of
from kvstore.dataplane.shm.regions import SharedBuffers

NOT_SHARED = -1  # the placement of a row outside shared memory


class PlacedRows:
    """`arrays[s]` row `r` is part s of the block kept in row r (vLLM: layer s of page r),
    with where each row lies in memory shared over one connection (`owner`).

    Args:
        owner: the connection whose shared memory the placements are in.
        arrays: per part, a writable, C-contiguous uint8 array of one row per block; all of
            one shape.
        offsets: `offsets[s, r]`, the placement of `arrays[s][r]`, or NOT_SHARED.
    """

    def __init__(self, owner: object, arrays: Sequence[np.ndarray], offsets: np.ndarray) -> None:
        self.owner, self.arrays, self.offsets = owner, list(arrays), offsets
        self.num_parts, self.num_rows = offsets.shape

    @classmethod
    def of(cls, owner: object, arrays: Sequence[np.ndarray], shared: SharedBuffers) -> PlacedRows:
        """Checks `arrays` and places every row; raises InvalidArgumentError for arrays a
        get cannot land in."""
        if not arrays:
            raise errors.InvalidArgumentError("no arrays to place")
        shape = arrays[0].shape
        for a in arrays:
            if a.dtype != np.uint8 or a.ndim != 2 or a.shape != shape:
                raise errors.InvalidArgumentError("rows must be 2-d uint8 arrays of one shape")
            if not a.flags.c_contiguous or not a.flags.writeable:
                raise errors.InvalidArgumentError("rows must be C-contiguous and writable")
        num_rows, row_bytes = shape
        offsets = np.full((len(arrays), num_rows), NOT_SHARED, np.int64)
        for s, a in enumerate(arrays):
            base = address_of(a)
            for r in range(num_rows):
                where = shared.placed_at(base + r * row_bytes, row_bytes)
                offsets[s, r] = NOT_SHARED if where is None else where
        return cls(owner, arrays, offsets)

    @property
    def row_bytes(self) -> int:
        return int(self.arrays[0].shape[1])

    def select(self, rows: Sequence[int]) -> list[int] | None:
        """The placements of `rows`' parts, part-major (part s of every row before part
        s + 1, as a GET in parts takes them), or None unless every one is shared. Raises
        InvalidArgumentError for a row out of range."""
        index = np.asarray(rows, np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.num_rows):
            raise errors.InvalidArgumentError(f"rows out of range 0..{self.num_rows - 1}")
        chosen = self.offsets[:, index]
        if (chosen == NOT_SHARED).any():
            return None
        return chosen.ravel().tolist()

    def summer(self, rows: Sequence[int]) -> Callable[[int, int, int], int]:
        """`take` of a `Landing` over `rows`: the CRC32C of part s of key i's block where
        it landed (`arrays[s][rows[i]]`), continuing `crc`."""
        return functools.partial(_summed, self.arrays, rows)


def _summed(arrays: list[np.ndarray], rows: Sequence[int], s: int, i: int, crc: int) -> int:
    return checksum(arrays[s][rows[i]], crc)
