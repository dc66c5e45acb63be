"""A connection's calls, run in the order they are made: on the caller's own thread when
no call is waiting, else on the connection's one worker thread, behind the waiting ones."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvstore import errors

T = TypeVar("T")


class InOrder:
    """Runs calls one after another. `submit` queues a call on the worker; `run` makes one
    and waits: on the caller's thread if nothing is queued (no hand-over to the worker and
    back, which costs a synchronous call two thread switches), else behind the queue."""

    def __init__(self, name: str) -> None:
        self._worker = concurrent.futures.ThreadPoolExecutor(1, name)
        self._lock = threading.Lock()
        self._queued = 0  # submitted and not finished

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queues `fn(*args)`; UnavailableError once shut down."""
        with self._lock:
            self._queued += 1
        try:
            return self._worker.submit(self._counted, fn, *args)
        except RuntimeError:  # shut down
            with self._lock:
                self._queued -= 1
            raise errors.UnavailableError("data-plane connection is closed") from None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, after every call queued before it."""
        with self._lock:
            idle = not self._queued
        return fn(*args) if idle else self.submit(fn, *args).result()

    def shutdown(self) -> None:
        """Queued calls that have not started never will."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _counted(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._queued -= 1
