"""Leases: read access to committed blocks, until released or expired.

A leased block's views stay valid: a block that leaves a tier while leased keeps its slot
until its last lease ends (`kvstore.store.tiering.slots`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore import errors
from kvstore.limits import OwnerCounts
from kvstore.store.index import Entry

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig


@dataclass(frozen=True)
class Lease:
    """Read access to committed blocks, valid until `Store.release` or expiry.

    `views[i]` is None where `keys[i]` missed: a `memoryview` of host memory, or, for a
    device reader, a device tensor. A view must not be used after release, nor after
    `expires_at` (as acquired): a reader that may outlive it copies through
    `Store.read_chunk`, which checks and renews the lease under the store's lock.
    """

    lease_id: int
    views: tuple[Any, ...]
    expires_at: float
    checksums: tuple[int, ...] = ()  # CRC32C of each found block's bytes (0 for a miss)

    @property
    def found(self) -> tuple[bool, ...]:
        return tuple(v is not None for v in self.views)


@dataclass
class OpenLease:
    entries: list[Entry]
    views: dict[int, Any]  # index in the acquire call -> view of the block, hits only
    expires_at: float
    owner: str

    def host_view(self, lease_id: int, index: int) -> memoryview:
        """The view of the block this lease holds for `keys[index]` of its acquire."""
        view = self.views.get(index)
        if view is None:
            raise errors.InvalidArgumentError(f"lease {lease_id} holds no block {index}")
        assert isinstance(view, memoryview), "read_chunk reads host leases"
        return view


class Leases:
    """The open leases of a store by id, counted per owner against the limits."""

    def __init__(self, config: StoreConfig) -> None:
        self._open: dict[int, OpenLease] = {}
        self._counts = OwnerCounts(
            "leases", config.max_leases_per_client, config.max_leases, errors.TooManyLeasesError
        )

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._open

    def check_limit(self, owner: str) -> None:
        """Raises `TooManyLeasesError` if `owner` may open no other lease."""
        self._counts.check(owner)

    def open(
        self, lease_id: int, hits: list[Entry], views: list[Any], expires_at: float, owner: str
    ) -> Lease:
        """Opens lease `lease_id` of `owner` on `hits` (leased already), whose views are
        the non-None ones of `views` (one per key of the acquire call)."""
        found = {i: v for i, v in enumerate(views) if v is not None}
        self._open[lease_id] = OpenLease(hits, found, expires_at, owner)
        self._counts.add(owner)
        sums = iter(e.checksum for e in hits)
        checksums = tuple(0 if v is None else next(sums) for v in views)
        return Lease(lease_id, tuple(views), expires_at, checksums)

    def close(self, lease_id: int) -> OpenLease:
        lease = self._open.pop(lease_id)
        self._counts.remove(lease.owner)
        return lease

    def get(self, lease_id: int) -> OpenLease | None:
        return self._open.get(lease_id)

    def expired(self, now: float) -> list[int]:
        return [i for i, lease in self._open.items() if lease.expires_at <= now]

    def entries(self) -> list[Entry]:
        """Every leased entry, once per lease that holds it."""
        return [e for lease in self._open.values() for e in lease.entries]

    def check(self) -> None:
        assert len(self._counts) == len(self._open), "lease counts"
