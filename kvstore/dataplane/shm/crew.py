"""A batch's block copies worked through by the calling thread and any idle helper threads.

One thread's copy of a large batch is bound by how many cache misses one core keeps in
flight, not by the memory's bandwidth: on a 2-core host, two threads copied 64 blocks of 1
MiB in 0.36-0.51x the time one took, and copied and summed them in 0.55-0.65x. NumPy's
copies and CRC32C let go of the GIL, so threads of one process share the work.

`Crew.run(jobs)` takes the jobs in order, one at a time, on the caller's thread, while
the crew's helpers take the next ones beside it (a node has one crew for all of its
connections, a client one per connection). The caller never waits for a helper that has
not started (one busy with another connection's batch): once no job is left to take,
helpers still queued are called off, and the caller waits only for the job each running
helper is on. So a busy process degrades to copying on the caller's thread, as without a
crew; an idle core joins in.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

MIN_SHARED_BYTES = 1 << 20  # a smaller batch is done by the caller alone (a hand-over
# to a helper costs tens of microseconds: about what copying 1 MiB takes)


class Crew:
    """The calling thread and up to `helpers` pool threads, over the jobs of one batch."""

    def __init__(self, helpers: int) -> None:
        self.helpers = max(0, helpers)
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(self.helpers, "kvstore-crew")
            if self.helpers
            else None
        )

    @classmethod
    def for_host(cls) -> Crew:
        """A helper per core beside the caller's, at most three (threads start on first
        use; idle ones wait on a queue)."""
        return cls(host_helpers())

    def run(
        self,
        jobs: Sequence[Callable[[], T]],
        nbytes: int,
        least: int | None = None,
        most: int | None = None,
    ) -> list[T]:
        """Every job's result, in order; the first exception any job raised (later jobs
        then are not started). `nbytes`: what the batch moves (below `least`, by default
        MIN_SHARED_BYTES, or with one job, the caller does it all). `most`: at most this
        many helpers join in (by default any of the crew's)."""
        floor = MIN_SHARED_BYTES if least is None else least
        helpers = self.helpers if most is None else min(self.helpers, most)
        if self._pool is None or len(jobs) < 2 or nbytes < floor or helpers < 1:
            return [job() for job in jobs]
        results: list[T | None] = [None] * len(jobs)
        failed: list[BaseException] = []
        taken = itertools.count()  # next() is atomic: each job is taken once

        def work() -> None:
            for i in taken:
                if i >= len(jobs) or failed:
                    return
                try:
                    results[i] = jobs[i]()
                except BaseException as exc:
                    failed.append(exc)
                    return

        helping = []
        for _ in range(min(helpers, len(jobs) - 1)):
            try:
                helping.append(self._pool.submit(work))
            except RuntimeError:  # shut down meanwhile: the caller does the rest
                break
        work()
        for future in helping:
            if not future.cancel():
                future.result()
        if failed:
            raise failed[0]
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def host_helpers() -> int:
    """How many helpers a crew has on this host: one per core beside the caller's, at most
    three."""
    return min(3, (os.cpu_count() or 1) - 1)
