"""Takes out of a UCX worker the tagged messages that no receive will ever match.

UCX keeps a message that arrives before any receive matches it in the worker's unexpected
queue, worker-wide, until one does: a peer that sends under tags nobody receives would
grow the node's memory for good, even after its connection is dropped. The sweeper looks
at the oldest such message (a probe with an empty tag mask) and asks the node whether a
connection may still receive it (`expects`): if not, it receives the message into scratch
memory and drops it, and looks at the next. It stops at the first message the node
expects; one that stays the oldest past `grace_s` is never going to be received by a
transfer that succeeds, so it is taken too and reported, for the node to drop its sender.

Only the oldest message is ever visible: a message the node expects shields those behind
it until it is received (a legitimate one is, within a transfer) or its grace ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

SCRATCH_BYTES = 64 << 10  # larger messages are received truncated: UCX drops the rest
BATCH = 32  # receives posted before they are awaited


class Swept(NamedTuple):
    """What one sweep took: how many messages, and the tag of one that outstayed its grace
    (its sender is broken or hostile), if any."""

    num_dropped: int
    stale_tag: int | None = None


class Sweeper:
    """Drops unexpected messages of `worker` (a ucxx `UCXWorker`) that `expects(tag)` says
    no receive will match. Runs on the worker's event loop; `sweep` is not reentrant."""

    def __init__(self, worker: Any, expects: Callable[[int], bool], grace_s: float) -> None:
        self.worker = worker
        self.expects = expects
        self.grace_s = grace_s
        self.num_dropped = 0
        self._head: tuple[int, int] | None = None  # (tag, length) of an expected oldest one
        self._head_since = 0.0
        self._scratch = bytearray(SCRATCH_BYTES)

    async def sweep(self, now: float, limit: int = 4096) -> Swept:
        """Drops up to `limit` unexpected messages, oldest first, as of `now` (monotonic
        seconds); stops at the first one the node still expects."""
        from ucxx.types import Tag, TagMask

        num_dropped, stale = 0, None
        taken: list[Any] = []
        while num_dropped + len(taken) < limit:
            head = self.worker.tag_probe(Tag(0), TagMask(0), remove=False)
            if not head.matched:
                self._head = None
                break
            tag, length = int(head.sender_tag.value), int(head.length)
            if self.expects(tag):
                if self._head != (tag, length):
                    self._head, self._head_since = (tag, length), now
                    break
                if now - self._head_since < self.grace_s:
                    break
                stale, self._head = tag, None
            if not taken:  # each receive takes a future from ucxx's pool: topped up per batch
                self.worker.populate_python_futures_pool()
            taken.extend(self._take(tag))
            if len(taken) >= BATCH:
                num_dropped += await _settled(taken)
                taken = []
        num_dropped += await _settled(taken)
        self.num_dropped += num_dropped
        return Swept(num_dropped, stale)

    def _take(self, tag: int) -> list[Any]:
        """Posts the receive of the oldest message under `tag` into scratch memory (none if
        a receive took it first). Scratch is shared: its bytes are never read."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        taken = self.worker.tag_probe(Tag(tag), TagMaskFull, remove=True)
        if not taken.matched:
            return []
        size = min(int(taken.length), len(self._scratch))
        return [self.worker.tag_recv_with_handle(Array(memoryview(self._scratch)[:size]), taken)]


async def _settled(requests: list[Any]) -> int:
    """Waits for every receive; errors (truncated, by design, when larger than scratch)
    are expected and dropped with the bytes."""
    for request in requests:
        with contextlib.suppress(Exception):
            await request.future
    return len(requests)


async def sweep_forever(
    sweeper: Sweeper, clock: Callable[[], float], on_sweep: Callable[[Swept], None], period_s: float
) -> None:
    """Sweeps every `period_s`, and at once again while sweeps find messages to drop;
    `on_sweep` hears of every sweep that dropped any."""
    while True:
        swept = await sweeper.sweep(clock())
        if swept.num_dropped:
            on_sweep(swept)
        await asyncio.sleep(0 if swept.num_dropped else period_s)
