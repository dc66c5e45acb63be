"""`kvstore stats --watch`: a live table of a node's tiers and rates between two snapshots."""

from __future__ import annotations

from rich import box
from rich.table import Table

from kvstore.results import StoreStats, TierUsage

# StoreStats counters shown as rates, with their column titles.
_RATES = {
    "hits": "hit/s",
    "misses": "miss/s",
    "blocks_committed": "put/s",
    "evictions": "evict/s",
    "demotions": "demote/s",
    "promotions": "promo/s",
}


def _table(title: str) -> Table:
    """Fits an 80-column terminal: no vertical rules, one space of padding."""
    return Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


def _rate(now: int, then: int, interval_s: float) -> str:
    return f"{(now - then) / interval_s:,.0f}"


def node_table(now: StoreStats, then: StoreStats, interval_s: float) -> Table:
    """The node's sizes, and its event rates over the `interval_s` from `then` to `now`."""
    table = _table("node")
    for title in ("blocks", "leases", "resv", *_RATES.values(), "bad crc"):
        table.add_column(title, justify="right")
    rates = [_rate(getattr(now, f), getattr(then, f), interval_s) for f in _RATES]
    sizes = (now.num_blocks, now.num_leases, now.num_reservations)
    table.add_row(*map(str, sizes), *rates, str(now.checksum_failures))
    return table


def tier_table(now: StoreStats, then: StoreStats, interval_s: float) -> Table:
    """One row per tier: use, and read and write rates over `interval_s`."""
    table = _table("tiers")
    for title in ("tier", "used MiB", "capacity MiB", "use", "blocks", "hits/s", "read MiB/s"):
        table.add_column(title, justify="right")
    table.add_column("written MiB/s", justify="right")
    before = {t.name: t for t in then.tiers}
    for tier in now.tiers:
        old = before.get(tier.name, TierUsage(tier.name, 0, 0, 0))
        table.add_row(
            tier.name,
            _mib(tier.used_bytes),
            _mib(tier.capacity_bytes),
            f"{tier.used_bytes / max(tier.capacity_bytes, 1):.0%}",
            str(tier.num_blocks),
            _rate(tier.hits, old.hits, interval_s),
            _mib((tier.bytes_read - old.bytes_read) / interval_s),
            _mib((tier.bytes_written - old.bytes_written) / interval_s),
        )
    return table
