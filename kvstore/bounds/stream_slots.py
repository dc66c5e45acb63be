"""Open response streams of one server, per client and in all.

A stream takes a slot when it starts and gives it back when nothing of it is left in the
server: its handler has ended and no send of it is still pending below (a stalled reader's
last message stays in the transport until that reader takes it or goes away, so its slot
stays taken until then). What a stalled reader can make a server hold is therefore at most
one message and its handler per stream, `max_streams_per_client` streams per client and
`max_streams` in all. Safe to use from any thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore import errors
from kvstore.limits import OwnerCounts


@dataclass(frozen=True)
class StreamLimits:
    """How many response streams a server keeps open, and how long a send may wait."""

    max_streams_per_client: int = 32
    max_streams: int = 256
    stall_timeout_s: float = 30.0  # a send its reader takes nothing of for this long ends it

    def __post_init__(self) -> None:
        if not 1 <= self.max_streams_per_client <= self.max_streams:
            raise errors.InvalidArgumentError(
                "stream limits need 1 <= max_streams_per_client <= max_streams"
            )
        if self.stall_timeout_s <= 0:
            raise errors.InvalidArgumentError("stream_stall_timeout_s must be positive")


class StreamSlot:
    """One stream's place; `release` is idempotent."""

    def __init__(self, slots: StreamSlots, client: str) -> None:
        self.client = client
        self._slots = slots
        self._released = False

    def release(self) -> None:
        self._slots._give_back(self)


class StreamSlots:
    """The open streams of the service `service` (its name in logs and metrics)."""

    def __init__(self, limits: StreamLimits, service: str) -> None:
        self.limits = limits
        self.service = service
        self.num_refused = 0  # streams refused past a bound, since start
        self.num_stalled = 0  # streams ended because a send stalled, since start
        self._lock = threading.Lock()
        self._counts = OwnerCounts(
            "streams", limits.max_streams_per_client, limits.max_streams, errors.TooManyStreamsError
        )

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)

    def take(self, client: str) -> StreamSlot:
        """A slot for a new stream of `client`; raises TooManyStreamsError past a bound."""
        with self._lock:
            try:
                self._counts.check(client)
            except errors.TooManyStreamsError:
                self.num_refused += 1
                raise
            self._counts.add(client)
        return StreamSlot(self, client)

    def stalled(self) -> None:
        """Counts a stream ended because its reader stalled."""
        with self._lock:
            self.num_stalled += 1

    def _give_back(self, slot: StreamSlot) -> None:
        with self._lock:
            if not slot._released:
                slot._released = True
                self._counts.remove(slot.client)
