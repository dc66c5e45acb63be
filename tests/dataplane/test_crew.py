"""A batch's jobs on the caller's thread and idle helpers (`kvstore.dataplane.shm.crew`): every
job once, results in order, no wait for a busy helper, and nothing still running once a
batch returns or raises (a put's reservation ends right after)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.dataplane.shm.crew import MIN_SHARED_BYTES, Crew
from kvstore.dataplane.shm.regions import copy_summed


class _Jobs:
    """Jobs that copy 256 KiB each and record which thread ran them, and how many are
    running at any moment."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.src = [np.full(256 << 10, i, np.uint8) for i in range(n)]
        self.dst = [np.zeros(256 << 10, np.uint8) for _ in range(n)]
        self.threads: list[int | None] = [None] * n
        self.runs = [0] * n
        self.running = 0
        self._lock = threading.Lock()
        self._fail_at = fail_at

    def job(self, i: int) -> int:
        with self._lock:
            self.running += 1
            self.runs[i] += 1
        try:
            self.threads[i] = threading.get_ident()
            if i == self._fail_at:
                raise ValueError(f"job {i} failed")
            return copy_summed(self.dst[i], self.src[i])
        finally:
            with self._lock:
                self.running -= 1

    def all(self) -> list:
        return [lambda i=i: self.job(i) for i in range(len(self.src))]


@pytest.fixture
def crew():
    crew = Crew(2)
    yield crew
    crew.shutdown()


def test_every_job_runs_once_and_results_come_in_order(crew):
    jobs = _Jobs(64)
    results = crew.run(jobs.all(), 64 << 18)
    assert results == [copy_summed(np.zeros(256 << 10, np.uint8), s) for s in jobs.src]
    assert jobs.runs == [1] * 64
    assert all((d == s).all() for d, s in zip(jobs.dst, jobs.src, strict=True))


def test_a_batch_takes_at_most_the_helpers_it_is_lent(crew):
    """`most`: none lent, the caller does it all; one lent, at most two threads run it."""
    alone = _Jobs(64)
    assert crew.run(alone.all(), 64 << 18, most=0) == [
        copy_summed(d, s) for d, s in zip(alone.dst, alone.src, strict=True)
    ]
    assert set(alone.threads) == {threading.get_ident()}
    lent = _Jobs(64)
    crew.run(lent.all(), 64 << 18, most=1)
    assert len(set(lent.threads)) <= 2 and lent.runs == [1] * 64


def test_a_small_batch_or_a_crew_of_none_stays_on_the_callers_thread(crew):
    """Under the floor (the default, or the caller's `least`), or with no helper."""
    me = threading.get_ident()
    small = _Jobs(3)
    crew.run(small.all(), MIN_SHARED_BYTES - 1)
    assert small.threads == [me] * 3
    under_its_own = _Jobs(8)  # 2 MiB: over the default floor, under the caller's
    crew.run(under_its_own.all(), 8 << 18, least=4 << 20)
    assert under_its_own.threads == [me] * 8
    alone = Crew(0)
    jobs = _Jobs(8)
    want = [copy_summed(np.zeros(256 << 10, np.uint8), s) for s in jobs.src]
    assert alone.run(jobs.all(), 8 << 20) == want
    assert jobs.threads == [me] * 8


def test_the_caller_never_waits_for_a_helper_busy_with_another_batch():
    crew = Crew(1)
    release, entered, timed_out = threading.Event(), threading.Semaphore(0), []

    def blocked() -> None:  # holds its thread (the holder's, the crew's one helper)
        entered.release()
        timed_out.append(not release.wait(timeout=30))

    holding = threading.Thread(target=crew.run, args=([blocked, blocked], MIN_SHARED_BYTES))
    holding.start()
    try:
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)  # helper held
        jobs = _Jobs(16)
        results = crew.run(jobs.all(), 16 << 18)  # the helper is busy: the caller does it all
        assert len(results) == 16 and jobs.threads == [threading.get_ident()] * 16
        assert not release.is_set()
    finally:
        release.set()
        holding.join(timeout=30)
        crew.shutdown()
    assert timed_out == [False, False]  # both of the holder's jobs ended by the release


def test_a_failed_job_raises_only_once_no_job_is_running(crew):
    for fail_at in (0, 5, 63):
        jobs = _Jobs(64, fail_at)
        with pytest.raises(ValueError, match=f"job {fail_at} failed"):
            crew.run(jobs.all(), 64 << 18)
        assert jobs.running == 0
        assert max(jobs.runs) == 1


def test_a_crew_shut_down_leaves_the_work_to_the_caller():
    crew = Crew(2)
    crew.shutdown()
    jobs = _Jobs(8)
    assert len(crew.run(jobs.all(), 8 << 20)) == 8
    assert jobs.threads == [threading.get_ident()] * 8
