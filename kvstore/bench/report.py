"""Shared output of the suites: a rich table of rows, a JSON file of rows, a progress bar."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

Row = dict[str, object]


def columns_of(rows: Sequence[Row]) -> list[str]:
    """Every key of `rows`, in order of first appearance."""
    seen: dict[str, None] = {}
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def format_cell(value: object) -> str:
    """Compact text for one table cell: yes/no for bools, floats to 4 digits or the unit."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if value is None:
        return "-"
    return str(value)


def render_table(rows: Sequence[Row], title: str) -> Table:
    """A rich table with one column per key of `rows`; numbers right-aligned. Columns
    holding lists (series, for `--json` and `--plot`) are left out."""
    table = Table(title=title)
    cols = [c for c in columns_of(rows) if not any(isinstance(r.get(c), list) for r in rows)]
    for col in cols:
        numeric = any(isinstance(r.get(col), int | float) for r in rows)
        table.add_column(col, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*(format_cell(row.get(col)) for col in cols))
    return table


def print_table(rows: Sequence[Row], title: str) -> None:
    """Prints `rows` as a table to stdout.

    Off a terminal (a pipe, a CI log) nothing bounds the width, so the table gets all it needs
    instead of rich's default 80 columns of elided cells.
    """
    table = render_table(rows, title)
    console = Console()
    if not console.is_terminal:
        wide = Console(width=10_000)
        console = Console(width=Measurement.get(wide, wide.options, table).maximum)
    console.print(table)


def write_json(rows: Sequence[Row], path: Path) -> None:
    """Writes `rows` to `path` as a JSON list, one object per table row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(rows), indent=2) + "\n")


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Shows a progress bar on stderr while the block runs; yields ``advance(steps)``."""
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield partial(progress.advance, task)


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the file-only Agg backend; tells how to install it if absent."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'kvstore[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
