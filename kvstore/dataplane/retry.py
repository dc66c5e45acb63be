"""When a client on transport "auto" tries the data plane again after a handshake failed.

A node that is restarting, that has no data plane yet, or that has no endpoint free for this
client refuses the handshake; the client then moves bytes over gRPC and asks again later,
the wait doubling from `first_s` to `longest_s` while the node keeps refusing and starting
over once a handshake succeeds. Without it, one refusal (a node restarted under its
clients) would keep every client on the slow path for good. A process that can reach no
data plane at all (`selection.Selection.can_succeed`) never asks again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvstore import errors

log = logging.getLogger("kvstore.dataplane")

# What a refused handshake raises: the node has no data plane (or is down), has no endpoint
# free for this client, or did not answer in time.
REFUSALS = (errors.UnavailableError, errors.ResourceExhaustedError, errors.DeadlineExceededError)


class HandshakeRetry:
    """Backoff between data-plane handshakes; see the module docstring.

    Args:
        first_s: the wait after the first refusal.
        longest_s: the wait it doubles up to.
        clock: seconds, monotonic; injected so tests control time.
    """

    def __init__(
        self,
        first_s: float = 1.0,
        longest_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= first_s <= longest_s:
            raise ValueError(f"need 0 <= first_s <= longest_s, got {first_s}, {longest_s}")
        self.first_s = first_s
        self.longest_s = longest_s
        self.clock = clock
        self.wait_s = 0.0  # the wait after the last refusal; 0 after a success
        self._retry_at = 0.0

    @property
    def is_due(self) -> bool:
        """Whether a handshake may be tried now."""
        return self.clock() >= self._retry_at

    def refused(self, address: str, exc: Exception, can_succeed: bool = True) -> bool:
        """Counts a failed handshake with the node at `address`: the next waits `wait_s`.
        False when none can ever succeed from this process (`can_succeed` False)."""
        if not can_succeed:
            return False
        self.wait_s = min(max(2 * self.wait_s, self.first_s), self.longest_s)
        self._retry_at = self.clock() + self.wait_s
        log.info(
            "event=dataplane_refused address=%s retry_s=%g error=%s", address, self.wait_s, exc
        )
        return True

    def succeeded(self) -> None:
        self.wait_s, self._retry_at = 0.0, 0.0
