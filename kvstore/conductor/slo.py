"""The service-level objective a request is served under."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    """Time to first token and time between tokens a request must meet.

    Attributes:
        ttft_s: most seconds from arrival to the first token.
        tbt_s: most seconds between output tokens, averaged over the request's decode.
    """

    ttft_s: float = 30.0
    tbt_s: float = 0.1

    def __post_init__(self) -> None:
        if not self.ttft_s > 0 or not self.tbt_s > 0:
            raise ValueError(f"SLO times must be > 0: ttft_s={self.ttft_s}, tbt_s={self.tbt_s}")

    def is_met(self, ttft_s: float, tbt_s: float) -> bool:
        """Whether a request served with `ttft_s` and `tbt_s` met both objectives."""
        return ttft_s <= self.ttft_s and tbt_s <= self.tbt_s
