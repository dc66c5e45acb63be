"""The server's footprint through a load run: resident bytes and open fds, snapshot by
snapshot, and the figures a leak shows in (`quarter_medians`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.bench.load_server import ServerProcess


@dataclass(frozen=True)
class Snapshot:
    """The server's resident bytes and open fds `at_s` seconds into the timed loop."""

    at_s: float
    rss_bytes: int
    num_fds: int

    @classmethod
    def of(cls, server: ServerProcess, at_s: float) -> Snapshot:
        return cls(at_s, server.rss_bytes(), server.num_fds())


def quarter_medians(footprint: list[Snapshot]) -> dict[str, int]:
    """The median RSS over the first and over the last quarter of the timed loop.

    Two single snapshots wander with what the server is doing at that instant (a batch in
    flight); medians over a quarter each do not. A leak grows with time, so the last
    quarter sits above the first; pools that reached their level under this load do not.
    """
    end_s = footprint[-1].at_s
    first = [s.rss_bytes for s in footprint if s.at_s <= end_s / 4]
    last = [s.rss_bytes for s in footprint if s.at_s >= end_s * 3 / 4]
    return {
        "rss_first_quarter_bytes": int(np.median(first)),
        "rss_last_quarter_bytes": int(np.median(last)),
    }
