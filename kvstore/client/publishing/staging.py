"""`StagingRing`: a fixed pool of host staging blocks, handed out as runs of consecutive blocks.

The pool is one tensor ``(num_blocks, *block_shape)``. Runs are cut from the ring in order,
so a batch of blocks is one slice (two where it wraps past the end) and a copy into it is a
few vectorized calls, not one per block. Runs come back in any order; a block is free again
once every run handed out before its own has come back too (puts finish nearly in order:
one thread makes them).

    blocks:  [ free | taken (oldest run first) ... | free ]
                    ^ tail                          ^ head: the next run starts here
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch


class StagedRun(NamedTuple):
    """Blocks handed out together; `parts` are 1 or 2 slices ``(n, *block_shape)``."""

    run_id: int
    parts: tuple[torch.Tensor, ...]


class StagingRing:
    """`num_blocks` staging blocks; not thread-safe (its owner locks).

    Args:
        block_shape, dtype: one staging block.
        num_blocks: blocks in the pool, allocated once.
        pin_memory: page-locked (for copies out of GPU memory).
    """

    def __init__(
        self,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        num_blocks: int,
        pin_memory: bool = False,
    ) -> None:
        assert num_blocks > 0, "a staging ring needs blocks"
        self.blocks = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self._head = 0
        self._num_taken = 0
        self._runs: OrderedDict[int, list[int]] = OrderedDict()  # id -> [blocks, is_back]
        self._next_id = 0

    @property
    def num_free(self) -> int:
        return len(self.blocks) - self._num_taken

    def take(self, num: int) -> StagedRun:
        """The next `num` blocks (0 < num <= num_free)."""
        assert 0 < num <= self.num_free, f"take({num}) with {self.num_free} free"
        size, start = len(self.blocks), self._head
        end = start + num
        parts: tuple[torch.Tensor, ...] = (self.blocks[start : min(end, size)],)
        if end > size:
            parts += (self.blocks[: end - size],)
        self._head, self._num_taken = end % size, self._num_taken + num
        run = StagedRun(self._next_id, parts)
        self._runs[run.run_id] = [num, False]
        self._next_id += 1
        return run

    def give_back(self, run_id: int) -> None:
        """Returns a run; frees it and every returned run after it once the older ones are."""
        self._runs[run_id][1] = True
        while self._runs and next(iter(self._runs.values()))[1]:
            num, _ = self._runs.popitem(last=False)[1]
            self._num_taken -= num
        if not self._runs:  # empty: start over at 0, so the next runs wrap less often
            self._head = 0
