"""Publishing computed blocks to the store off the step loop: staging buffers and a thread.

`offer` copies blocks out of the engine's pages into host staging buffers from a fixed pool
(`StagingRing`, pinned when the pages live on a GPU) and queues them; a background thread
puts each batch as one chain. An offer's blocks are consecutive rows of the pool, so
`offer_batch` copies them in a few vectorized calls. The step loop never waits on the
network: when no staging buffer is free the blocks are dropped and counted, never queued
unboundedly. A chain cut short by a drop stays cut: its later blocks (offered with a dropped
block as parent) could never be matched by prefix, so they are dropped too instead of taking
staging buffers and store space. The same holds for a branch from any block that was dropped
or whose put failed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvstore.client.publishing.staging import StagedRun, StagingRing
from kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)

# (keys, their blocks, parent): the blocks are one staging tensor of a block per row when
# the run is one slice of the ring (a put may then hand the store one array), else a list
PutChain = Callable[
    [Sequence[bytes], "Sequence[torch.Tensor] | torch.Tensor", "bytes | None"], object
]
ReadBlock = Callable[[int, torch.Tensor], object]  # (block index in the offer, staging out)
ReadBlocks = Callable[[int, torch.Tensor], object]  # (index of outs[0] in the offer, outs)


class PublishStats(NamedTuple):
    num_published_blocks: int
    num_dropped_blocks: int  # no staging buffer free, publisher stopped, or chain cut
    num_failed_blocks: int  # the put raised
    num_pending_blocks: int  # staged, not yet put


class _Job(NamedTuple):
    keys: list[bytes]
    run: StagedRun
    parent: bytes | None
    put_chain: PutChain


MAX_CUT_CHAINS = 4096  # blocks remembered as cut (dropped or failed); beyond, oldest forgotten


class BlockPublisher:
    """A pool of `num_buffers` staging blocks and one thread that puts them.

    Args:
        put_chain: stores blocks as one chain continuing after a parent; may raise. None:
            every offer brings its own.
        block_shape, dtype: one staging buffer.
        num_buffers: staging blocks; also the most blocks queued at once.
        pin_memory: page-locked staging (for copies out of GPU pages).
    """

    def __init__(
        self,
        put_chain: PutChain | None,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        num_buffers: int,
        pin_memory: bool = False,
    ) -> None:
        self._put_chain = put_chain
        self._ring = StagingRing(block_shape, dtype, num_buffers, pin_memory)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._counts = {"published": 0, "dropped": 0, "failed": 0, "pending": 0}
        self._is_closed = False
        self._cut: OrderedDict[bytes, None] = OrderedDict()  # blocks that never reached a put
        self._thread = threading.Thread(target=self._run, name="kv-publisher", daemon=True)
        self._thread.start()

    def offer(
        self,
        keys: Sequence[bytes],
        read_block: ReadBlock,
        parent: bytes | None,
        put_chain: PutChain | None = None,
    ) -> int:
        """Stages blocks `keys` (block i copied by ``read_block(i, out)``) and queues their put;
        returns how many were staged. Blocks beyond the free buffers are dropped: a chain
        cut short stays a valid prefix, and its continuations are dropped from then on.
        `put_chain`, if given, puts this offer instead of the publisher's own (a connector
        whose offers go to different namespaces)."""

        def read_blocks(start: int, outs: torch.Tensor) -> None:
            for i, out in enumerate(outs):
                read_block(start + i, out)

        return self.offer_batch(keys, read_blocks, parent, put_chain)

    def offer_batch(
        self,
        keys: Sequence[bytes],
        read_blocks: ReadBlocks,
        parent: bytes | None,
        put_chain: PutChain | None = None,
    ) -> int:
        """As `offer`, copying blocks a batch at a time: ``read_blocks(start, outs)`` fills
        ``outs[j]`` (outs: ``(n, *block_shape)``) with block ``start + j`` of the offer. The
        calls cover the staged prefix of `keys` in order, once or twice (where the pool
        wraps), none when nothing is staged; each copy must be done on return."""
        put = put_chain or self._put_chain
        assert put is not None, "an offer to a publisher without a put_chain must bring one"
        with self._lock:
            is_cut = self._is_cut(parent)
            num = 0 if self._is_closed or is_cut else min(len(keys), self._ring.num_free)
            self._mark_cut(keys[num:])
            run = self._ring.take(num) if num else None
            self._counts["dropped"] += len(keys) - num
            self._counts["pending"] += num
        if run is not None:
            job = _Job(list(keys[:num]), run, parent, put)
            try:
                start = 0
                for part in run.parts:
                    read_blocks(start, part)
                    start += len(part)
            except BaseException:  # the buffers go back; the blocks count as failed
                self._finish(job, "failed")
                raise
            self._jobs.put(job)
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
            self._finish(job, "dropped" if is_cut else self._put(job))

    def _finish(self, job: _Job, outcome: str) -> None:
        """Counts a job's blocks as `outcome` and frees their buffers."""
        with self._lock:
            if outcome == "published":
                for key in job.keys:  # in the store now: a branch from it may follow
                    self._cut.pop(key, None)
            else:
                self._mark_cut(job.keys)
            self._counts[outcome] += len(job.keys)
            self._counts["pending"] -= len(job.keys)
            self._ring.give_back(job.run.run_id)
            self._lock.notify_all()

    def _is_cut(self, parent: bytes | None) -> bool:
        """Whether `parent` is a block that never reached a put (any branch from it is cut)."""
        if parent is None or parent not in self._cut:
            return False
        self._cut.move_to_end(parent)
        return True

    def _mark_cut(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._cut[key] = None
            self._cut.move_to_end(key)
        while len(self._cut) > MAX_CUT_CHAINS:
            self._cut.popitem(last=False)

    def _put(self, job: _Job) -> str:
        parts = job.run.parts
        blocks = parts[0] if len(parts) == 1 else [b for part in parts for b in part]
        try:
            job.put_chain(job.keys, blocks, job.parent)
        except KVStoreError as exc:
            logger.warning("event=publish_failed blocks=%d error=%r", len(job.keys), exc)
            return "failed"
        except Exception:
            logger.exception("event=publish_failed blocks=%d", len(job.keys))
            return "failed"
        return "published"
