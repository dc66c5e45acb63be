"""A suite's verdict on its targets: each target missed, or not measured, is a failure.

A ratio that could not be computed (a peer that did not start, a mode that did not run, a
cell that raised) is never a pass: it is listed with its reason, and the suite exits 1
like for a missed target. `kvstore-bench SUITE --no-targets` runs a suite for exploration:
the failures are still listed, and the exit status is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console


def exit_status(failures: Sequence[str], what: str = "target missed") -> int:
    """Lists `failures` on stderr; 1 where there is one, else 0."""
    console = Console(stderr=True)
    for line in failures:
        console.print(f"[red]{what}[/red] {line}")
    return int(bool(failures))
