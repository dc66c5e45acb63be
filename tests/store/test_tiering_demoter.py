"""The demoter thread: a pass whenever one is needed, backing off while passes free nothing."""

from __future__ import annotations

import threading
import time

from kvstore.store.tiering.demoter import Backoff, Demoter
from kvstore.store.tiering.usage import TieringCounters


class _Passes:
    """A demotion pass that frees nothing, and when each one ran."""

    def __init__(self, lock: threading.RLock, num_wanted: int) -> None:
        self.lock = lock
        self.times: list[float] = []
        self.num_wanted = num_wanted
        self.done = threading.Event()

    def demote(self) -> int:
        with self.lock:
            self.times.append(time.monotonic())
            if len(self.times) >= self.num_wanted:
                self.done.set()
        return 0


def test_fruitless_passes_back_off_doubling_up_to_the_cap():
    lock = threading.RLock()
    passes = _Passes(lock, num_wanted=5)
    demoter = Demoter(lock, TieringCounters(), lambda: True, passes.demote)
    demoter.backoff = Backoff(0.05, 0.2)  # read at each wait
    try:
        assert passes.done.wait(10.0), "five demotion passes"
    finally:
        demoter.close()
    gaps = [b - a for a, b in zip(passes.times, passes.times[1:], strict=False)]
    # Waits of 0.05, 0.1, 0.2 (the cap), 0.2 s: each gap at least its wait; a demoter that
    # spins would make thousands of passes in that time.
    for gap, wait_s in zip(gaps, (0.05, 0.1, 0.2, 0.2), strict=True):
        assert gap >= wait_s * 0.95, (gaps, wait_s)


def test_a_pass_runs_only_once_it_is_needed_and_wake_is_called():
    lock = threading.RLock()
    passes = _Passes(lock, num_wanted=1)
    is_needed = threading.Event()
    demoter = Demoter(lock, TieringCounters(), is_needed.is_set, passes.demote)
    try:
        with lock:  # the demoter checks `is_needed` under the lock: nothing can slip between
            assert passes.times == []
            is_needed.set()
            demoter.wake()
        assert passes.done.wait(10.0), "a pass after wake"
    finally:
        demoter.close()
