"""Publishing computed blocks to the store off the step loop: staging buffers and a thread.

`offer` copies blocks out of the engine's pages into host staging buffers from a fixed pool
(pinned when the pages live on a GPU) and queues them; a background thread puts each batch
as one chain. The step loop never waits on the network: when no staging buffer is free the
blocks are dropped and counted, never queued unboundedly. A chain cut short by a drop stays
cut: its later blocks (offered with a dropped block as parent) could never be matched by
prefix, so they are dropped too instead of taking staging buffers and store space.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

PutChain = Callable[[Sequence[bytes], Sequence[torch.Tensor], "bytes | None"], object]
ReadBlock = Callable[[int, torch.Tensor], object]  # (block index in the offer, staging out)


class PublishStats(NamedTuple):
    num_published_blocks: int
    num_dropped_blocks: int  # no staging buffer free, publisher stopped, or chain cut
    num_failed_blocks: int  # the put raised
    num_pending_blocks: int  # staged, not yet put


class _Job(NamedTuple):
    keys: list[bytes]
    buffers: list[torch.Tensor]
    parent: bytes | None


MAX_CUT_CHAINS = 4096  # cut chains remembered; beyond, the oldest are forgotten


class BlockPublisher:
    """A pool of `num_buffers` staging blocks and one thread that puts them.

    Args:
        put_chain: stores blocks as one chain continuing after a parent; may raise.
        block_shape, dtype: one staging buffer.
        num_buffers: staging blocks; also the most blocks queued at once.
        pin_memory: page-locked staging (for copies out of GPU pages).
    """

    def __init__(
        self,
        put_chain: PutChain,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        num_buffers: int,
        pin_memory: bool = False,
    ) -> None:
        self._put_chain = put_chain
        self._free = [
            torch.empty(block_shape, dtype=dtype, pin_memory=pin_memory) for _ in range(num_buffers)
        ]
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._counts = {"published": 0, "dropped": 0, "failed": 0, "pending": 0}
        self._is_closed = False
        self._cut: OrderedDict[bytes, None] = OrderedDict()  # last keys of cut chains
        self._thread = threading.Thread(target=self._run, name="kv-publisher", daemon=True)
        self._thread.start()

    def offer(self, keys: Sequence[bytes], read_block: ReadBlock, parent: bytes | None) -> int:
        """Stages blocks `keys` (block i copied by ``read_block(i, out)``) and queues their put;
        returns how many were staged. Blocks beyond the free buffers are dropped: a chain
        cut short stays a valid prefix, and its continuations are dropped from then on."""
        with self._lock:
            is_cut = self._is_cut(parent)
            num = 0 if self._is_closed or is_cut else min(len(keys), len(self._free))
            if num < len(keys) and keys:
                self._mark_cut(keys[-1])
            buffers = [self._free.pop() for _ in range(num)]
            self._counts["dropped"] += len(keys) - num
            self._counts["pending"] += num
        for i, buf in enumerate(buffers):
            read_block(i, buf)
        if buffers:
            self._jobs.put(_Job(list(keys[:num]), buffers, parent))
        return num

    def stats(self) -> PublishStats:
        with self._lock:
            c = self._counts
            return PublishStats(c["published"], c["dropped"], c["failed"], c["pending"])

    def drain(self, timeout_s: float | None = None) -> bool:
        """Waits until every staged block was put (or failed); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._counts["pending"] == 0, timeout_s)

    def close(self) -> None:
        """Finishes the queued puts, then stops the thread."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                is_cut = self._is_cut(job.parent)  # its parent's put failed meanwhile
            outcome = "dropped" if is_cut else self._put(job)
            with self._lock:
                if outcome != "published":
                    self._mark_cut(job.keys[-1])
                self._counts[outcome] += len(job.keys)
                self._counts["pending"] -= len(job.keys)
                self._free.extend(job.buffers)
                self._lock.notify_all()

    def _is_cut(self, parent: bytes | None) -> bool:
        """Whether `parent` is the last block of a cut chain (any branch from it is cut)."""
        if parent is None or parent not in self._cut:
            return False
        self._cut.move_to_end(parent)
        return True

    def _mark_cut(self, key: bytes) -> None:
        self._cut[key] = None
        while len(self._cut) > MAX_CUT_CHAINS:
            self._cut.popitem(last=False)

    def _put(self, job: _Job) -> str:
        try:
            self._put_chain(job.keys, job.buffers, job.parent)
        except KVStoreError as exc:
            logger.warning("event=publish_failed blocks=%d error=%r", len(job.keys), exc)
            return "failed"
        except Exception:
            logger.exception("event=publish_failed blocks=%d", len(job.keys))
            return "failed"
        return "published"
