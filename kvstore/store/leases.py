"""Leases: read access to committed blocks, until released or expired.

`Store.acquire` opens a `Lease`; the lease itself reads (`read_chunk`) and ends
(`release`, or `with`). A leased block's views stay valid: a block that leaves a tier while
leased keeps its slot until its last lease ends (`kvstore.store.tiering.slots`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore import errors
from kvstore.limits import OwnerCounts
from kvstore.store.index import Entry

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig


class Lease:
    """Read access to the committed blocks one `acquire` found, until released or expired.

    `views[i]` is None where `keys[i]` missed: a `memoryview` of host memory, or, for a
    device reader, a device tensor. A view must not be used after release, nor after
    `expires_at` as acquired: a reader that may outlive it copies through `read_chunk`,
    which checks and renews the lease under the store's lock.
    """

    def __init__(
        self, leases: Leases, lease_id: int, entries: list[Entry], views: list[Any], owner: str
    ) -> None:
        self.lease_id = lease_id
        self.views = tuple(views)
        self.owner = owner
        self.entries = entries  # the leased hits, in key order
        self.expires_at = leases.deadline()
        sums = iter(e.checksum for e in entries)
        # CRC32C of each found block's bytes (0 for a miss)
        self.checksums = tuple(0 if v is None else next(sums) for v in views)
        self._leases = leases

    @property
    def found(self) -> tuple[bool, ...]:
        return tuple(v is not None for v in self.views)

    def read_chunk(self, index: int, offset: int, nbytes: int) -> bytes:
        """A copy of bytes `[offset, offset + nbytes)` of the block held for `keys[index]`,
        made under the store's lock; renews the lease. Host leases only.

        For readers that copy a block out bit by bit (a stream that may stall between
        chunks): once the lease has ended its slot may hold another block, so this raises
        `LeaseExpiredError` instead of reading it.
        """
        with self._leases.lock:
            self._leases.check_live(self)
            view = self.views[index] if 0 <= index < len(self.views) else None
            if view is None or offset < 0 or nbytes < 0:
                raise errors.InvalidArgumentError(
                    f"lease {self.lease_id} holds no bytes [{offset}, +{nbytes}) of block {index}"
                )
            assert isinstance(view, memoryview), "read_chunk reads host leases"
            self.expires_at = self._leases.deadline()
            return bytes(view[offset : offset + nbytes])

    def release(self) -> None:
        """Ends the lease; a no-op if it already ended."""
        self._leases.release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Leases:
    """A store's open leases, counted per owner against the limits.

    Args:
        config: the lease timeout and limits.
        lock: the store's lock, which every method takes.
        clock: the store's clock.
        end: called for each entry of a lease that ends (the tiers let go of it).
    """

    def __init__(
        self,
        config: StoreConfig,
        lock: threading.RLock,
        clock: Callable[[], float],
        end: Callable[[Entry], None],
    ) -> None:
        self.lock = lock
        self._timeout_s = config.lease_timeout_s
        self._clock = clock
        self._end = end
        self._open: dict[int, Lease] = {}
        self._ids = 0
        self.num_expired = 0  # leases ended by their deadline
        self._counts = OwnerCounts(
            "leases", config.max_leases_per_client, config.max_leases, errors.TooManyLeasesError
        )

    def __len__(self) -> int:
        return len(self._open)

    def deadline(self) -> float:
        """When a lease opened or renewed now expires."""
        return self._clock() + self._timeout_s

    def check_limit(self, owner: str) -> None:
        """Raises `TooManyLeasesError` if `owner` may open no other lease."""
        self._counts.check(owner)

    def open(self, hits: list[Entry], views: list[Any], owner: str) -> Lease:
        """A lease of `owner` on `hits` (leased already), whose views are the non-None ones
        of `views` (one per key of the acquire call). Under the lock."""
        self._ids += 1
        lease = Lease(self, self._ids, hits, views, owner)
        self._open[lease.lease_id] = lease
        self._counts.add(owner)
        return lease

    def release(self, lease: Lease) -> None:
        with self.lock:
            if self._open.get(lease.lease_id) is lease:
                self._close(lease)

    def check_live(self, lease: Lease) -> None:
        """Raises `LeaseExpiredError` unless `lease` is open and in time (ending it if
        late). Under the lock."""
        if self._open.get(lease.lease_id) is lease and lease.expires_at <= self._clock():
            self._close(lease)
            self.num_expired += 1
        if self._open.get(lease.lease_id) is not lease:
            raise errors.LeaseExpiredError(
                f"lease {lease.lease_id} has ended (released, or no read for "
                f"{self._timeout_s} s); read the blocks again"
            )

    def expire(self, now: float) -> None:
        """Ends the leases whose deadline has passed. Under the lock."""
        late = [lease for lease in self._open.values() if lease.expires_at <= now]
        for lease in late:
            self._close(lease)
        self.num_expired += len(late)

    def entries(self) -> list[Entry]:
        """Every leased entry, once per lease that holds it."""
        return [e for lease in self._open.values() for e in lease.entries]

    def check(self) -> None:
        assert len(self._counts) == len(self._open), "lease counts"

    def _close(self, lease: Lease) -> None:
        del self._open[lease.lease_id]
        self._counts.remove(lease.owner)
        for entry in lease.entries:
            self._end(entry)
