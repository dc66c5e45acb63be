"""The config table of a server's response streams (`StreamLimits`), held by every server
that streams responses: the store node, the conductor and the engine."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.bounds.stream_slots import StreamLimits
from kvstore.config import option


@dataclass(frozen=True)
class StreamSettings:
    """How many response streams the server keeps open for one client and in all, and how
    long one send may wait on a reader that takes nothing."""

    max_streams_per_client: int = option(
        32, "most response streams one client keeps open (TooManyStreamsError past it)"
    )
    max_streams: int = option(256, "most response streams open in all (TooManyStreamsError)")
    stream_stall_timeout_s: float = option(
        30.0, "a response stream whose reader takes nothing for this long is ended"
    )

    def __post_init__(self) -> None:
        self.limits  # noqa: B018 -- checks the rows

    @property
    def limits(self) -> StreamLimits:
        """The rows above, checked (InvalidArgumentError)."""
        return StreamLimits(
            self.max_streams_per_client, self.max_streams, self.stream_stall_timeout_s
        )
