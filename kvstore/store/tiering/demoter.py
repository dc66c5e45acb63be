"""The demoter: a background thread that runs demotion passes while DRAM is over its high
watermark, and backs off after a pass that failed or freed nothing."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from kvstore.store.tiering.usage import TieringCounters

log = logging.getLogger(__name__)


class Backoff(NamedTuple):
    """The wait after a failed or fruitless pass: `min_s`, doubling up to `max_s` while
    passes keep failing; a successful SSD write cuts it short."""

    min_s: float
    max_s: float


DEFAULT_BACKOFF = Backoff(0.1, 5.0)  # read when a demoter starts


class Demoter:
    """Runs `demote()` (which takes the lock itself) whenever `is_needed()` (called with
    the store's lock `lock` held) says so; `wake` it after a change that may need it."""

    def __init__(
        self,
        lock: threading.RLock,
        counters: TieringCounters,
        is_needed: Callable[[], bool],
        demote: Callable[[], int],
    ) -> None:
        self.lock = lock
        self.counters = counters
        self.backoff = DEFAULT_BACKOFF
        self._is_needed = is_needed
        self._demote = demote
        self._wake = threading.Condition(lock)
        self._closing = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Called with the lock held."""
        self._wake.notify()

    def close(self) -> None:
        """Stops the thread, after the pass under way if any."""
        with self.lock:
            self._closing = True
            self._wake.notify_all()
        self._thread.join()

    def _run(self) -> None:
        delay_s = 0.0  # after a pass that failed or freed nothing; doubles while they go on
        while True:
            with self.lock:
                self._wait(delay_s)
                if self._closing:
                    return
                num_failures = self.counters.ssd_write_failures
            try:
                num_moved = self._demote()
            except Exception:
                log.exception("event=demotion_failed")
                num_moved = 0
            with self.lock:
                is_stuck = num_moved == 0 or self.counters.ssd_write_failures != num_failures
            backoff = self.backoff
            delay_s = min(max(2 * delay_s, backoff.min_s), backoff.max_s) if is_stuck else 0.0

    def _wait(self, delay_s: float) -> None:
        """Waits, with the lock, `delay_s` (cut short by `close` or by an SSD write that
        succeeded meanwhile), then until a pass is needed."""
        deadline = time.monotonic() + delay_s
        num_demotions = self.counters.demotions
        while not self._closing and self.counters.demotions == num_demotions:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            self._wake.wait(left_s)
        while not self._closing and not self._is_needed():
            self._wake.wait()
