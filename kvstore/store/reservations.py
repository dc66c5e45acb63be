"""Reservations: the blocks one `Store.reserve` call reserved, written in place, then
committed or aborted.

A `Reservation` is what a put holds: it writes (`write`, or `views` then `commit(written=)`
for a transport that receives in place), `commit`s and `abort`s itself. It belongs to its
owner (`kvstore.limits`): to any other client it is unknown, and `Store.reservation` finds
it again by id for its owner only (ids are small integers, never a capability). Its blocks
are RESERVED entries of the index, each with a DRAM slot, invisible to readers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.limits import OwnerCounts
from kvstore.results import NO_RESERVATION, PutStatus, ReserveResult
from kvstore.store.counters import Counters
from kvstore.store.index import BlockIndex, BlockState, Entry

if TYPE_CHECKING:
    from kvstore.store.config import StoreConfig
    from kvstore.store.tiering import Tiering


class Reservation:
    """The blocks one reserve call reserved; every method takes the store's lock.

    `statuses[i]` says what became of `keys[i]` (reserved here, present, or in flight
    elsewhere); `reservation_id` is `NO_RESERVATION` where nothing needed reserving, and
    such a reservation commits 0 blocks and aborts as a no-op.
    """

    def __init__(
        self,
        book: Reservations,
        reservation_id: int,
        statuses: tuple[PutStatus, ...],
        entries: dict[int, Entry],
        views: dict[int, memoryview],
        expires_at: float,
        owner: str,
        tenant: str,
    ) -> None:
        self.reservation_id = reservation_id
        self.statuses = statuses
        self.owner = owner
        self.tenant = tenant
        self.entries = entries  # index in the reserve call -> reserved entry
        self.expires_at = expires_at
        self._views = views  # index -> writable view of the entry's DRAM slot
        self._sums: dict[int, int] = {}  # index -> CRC32C the node computed as it landed
        self._written = dict.fromkeys(entries, 0)  # index -> bytes written so far, in order
        self._book = book

    @property
    def result(self) -> ReserveResult:
        return ReserveResult(self.reservation_id, self.statuses)

    def write(self, index: int, offset: int, data: memoryview | bytes) -> None:
        """Writes `data` at `offset` of reserved block `index`; chunks arrive in order."""
        with self._book.lock:
            entry = self._entry(index)
            if offset != self._written[index]:
                raise errors.InvalidArgumentError(
                    f"block {index}: chunk at offset {offset}, expected {self._written[index]}"
                )
            end = offset + len(data)
            if end > entry.nbytes:
                raise errors.PayloadSizeError(
                    f"block {index}: {end} bytes written, block size is {entry.nbytes}"
                )
            self._views[index][offset:end] = data
            self._written[index] = end

    def rewind(self, index: int, offset: int) -> None:
        """Takes block `index` back to `offset` bytes written, unless it is written whole,
        so that a write stream that failed leaves no block half done. A no-op once the
        reservation has ended; never moves a block forward."""
        with self._book.lock:
            entry = self.entries.get(index)
            if not self._is_open() or entry is None or self._written[index] == entry.nbytes:
                return
            self._written[index] = max(0, min(self._written[index], offset))
            self._sums.pop(index, None)

    def views(self) -> dict[int, memoryview]:
        """A writable view of every reserved block (index -> view), for a transport that
        receives in place; valid until the reservation is committed, aborted or expires."""
        with self._book.lock:
            if self.reservation_id != NO_RESERVATION:
                self._check_open()
            return dict(self._views)

    def commit(
        self, checksums: Sequence[int] | None = None, written: Mapping[int, int] | None = None
    ) -> int:
        """Makes every reserved block readable; returns how many it committed.

        Args:
            checksums: optional CRC32C per key of the reserve call, as the sender computed
                it. On any mismatch the reservation is aborted and ChecksumMismatchError
                raised: altered or short bytes are never committed.
            written: from a transport that received every block in place (through
                `views`), the CRC32C it computed of each (index -> sum, one per reserved
                block, else InvalidArgumentError): the batch commits under one hold of the
                lock, summing nothing again.
        """
        if self.reservation_id == NO_RESERVATION:
            return 0
        if checksums is not None and len(checksums) != len(self.statuses):
            raise errors.InvalidArgumentError(
                f"{len(checksums)} checksums for the {len(self.statuses)} keys reserved"
            )
        with self._book.lock:
            self._check_open()
            if written is not None:
                self._mark_all_written(written)
                return self._book.commit(self, dict(written), checksums)
            self._check_complete()
        # Outside the lock: the checksum releases the GIL, and the slots are this one's.
        crcs = {
            i: self._sums[i] if i in self._sums else checksum(v) for i, v in self._views.items()
        }
        with self._book.lock:
            self._check_open()
            return self._book.commit(self, crcs, checksums)

    def abort(self) -> None:
        """Drops the reservation and frees its slots."""
        if self.reservation_id == NO_RESERVATION:
            return
        with self._book.lock:
            self._check_open()
            self._book.drop(self)

    def seal(self, crcs: Mapping[int, int]) -> int:
        """Marks every block committed with its CRC32C; returns the bytes committed."""
        for i, entry in self.entries.items():
            entry.checksum = crcs[i]
            entry.state = BlockState.COMMITTED
        return sum(e.nbytes for e in self.entries.values())

    # -- internals -----------------------------------------------------------------------

    def _is_open(self) -> bool:
        return self._book.get(self.reservation_id) is self

    def _check_open(self) -> None:
        if not self._is_open():
            raise errors.UnknownReservationError(
                f"no open reservation {self.reservation_id} (committed, aborted or expired)"
            )

    def _entry(self, index: int) -> Entry:
        self._check_open()
        entry = self.entries.get(index)
        if entry is None:
            raise errors.InvalidArgumentError(
                f"block {index} is not reserved by {self.reservation_id}"
            )
        return entry

    def _mark_all_written(self, crcs: Mapping[int, int]) -> None:
        if set(crcs) != set(self.entries):
            raise errors.InvalidArgumentError(
                f"reservation {self.reservation_id}: sums for blocks {sorted(crcs)[:8]}, "
                f"reserved are {sorted(self.entries)[:8]}"
            )
        for i in crcs:
            self._written[i] = self.entries[i].nbytes

    def _check_complete(self) -> None:
        short = [i for i, e in self.entries.items() if self._written[i] != e.nbytes]
        if short:
            raise errors.IncompleteWriteError(
                f"blocks {short[:8]} are not fully written; "
                f"each needs {next(iter(self.entries.values())).nbytes} bytes"
            )


class Reservations:
    """A store's open reservations by id, counted per owner against the limits, and what
    committing or dropping one does to the index, the tiers and the counters.

    Args:
        config: the reservation timeout and limits.
        lock: the store's lock; every method runs under it.
        clock: the store's clock.
    """

    def __init__(
        self,
        config: StoreConfig,
        lock: threading.RLock,
        clock: Callable[[], float],
        index: BlockIndex,
        tiering: Tiering,
        counters: Counters,
    ) -> None:
        self.lock = lock
        self._timeout_s = config.reservation_timeout_s
        self._clock = clock
        self._index = index
        self._tiering = tiering
        self._counters = counters
        self._open: dict[int, Reservation] = {}
        self._ids = NO_RESERVATION
        self.num_expired = 0  # reservations dropped by their deadline
        self._counts = OwnerCounts(
            "reservations",
            config.max_reservations_per_client,
            config.max_reservations,
            errors.TooManyReservationsError,
        )

    def __len__(self) -> int:
        return len(self._open)

    @property
    def num_entries(self) -> int:
        return sum(len(r.entries) for r in self._open.values())

    def check_limit(self, owner: str) -> None:
        """Raises `TooManyReservationsError` if `owner` may open no other reservation."""
        self._counts.check(owner)

    def none(self, statuses: tuple[PutStatus, ...], owner: str) -> Reservation:
        """The reservation of a call with nothing to reserve."""
        return Reservation(self, NO_RESERVATION, statuses, {}, {}, 0.0, owner, "")

    def open(
        self, statuses: tuple[PutStatus, ...], entries: dict[int, Entry], owner: str, tenant: str
    ) -> Reservation:
        """Opens a reservation of `entries` (each with its slot) for `owner`."""
        for entry in entries.values():
            self._index.add(entry)
        self._ids += 1
        views, expires_at = self._tiering.views(entries), self._clock() + self._timeout_s
        res = Reservation(self, self._ids, statuses, entries, views, expires_at, owner, tenant)
        self._open[res.reservation_id] = res
        self._counts.add(owner)
        return res

    def get(self, reservation_id: int) -> Reservation | None:
        return self._open.get(reservation_id)

    def owned(self, reservation_id: int, owner: str) -> Reservation:
        """The open reservation `owner` holds as `reservation_id`; else an unknown one."""
        res = self._open.get(reservation_id)
        if res is None or res.owner != owner:
            raise errors.UnknownReservationError(
                f"no open reservation {reservation_id} (committed, aborted or expired)"
            )
        return res

    def commit(
        self, res: Reservation, crcs: dict[int, int], checksums: Sequence[int] | None
    ) -> int:
        """Commits open `res`, written whole and summed to `crcs`."""
        bad = [i for i in crcs if checksums is not None and crcs[i] != checksums[i]]
        if bad:
            self.drop(res)
            raise errors.ChecksumMismatchError(
                f"blocks {bad[:8]} arrived short or altered (bad checksum); nothing committed"
            )
        self._close(res)
        nbytes = res.seal(crcs)
        self._tiering.on_commit(list(res.entries.values()))
        self._counters.count_commit(res.tenant, len(res.entries), nbytes)
        return len(res.entries)

    def drop(self, res: Reservation) -> None:
        """Closes open `res` and frees its blocks."""
        self._close(res)
        for entry in res.entries.values():
            self._index.pop(entry.block_id)
            self._tiering.free_reserved(entry)

    def expire(self, now: float) -> None:
        """Drops the reservations whose deadline has passed."""
        late = [res for res in self._open.values() if res.expires_at <= now]
        for res in late:
            self.drop(res)
        self.num_expired += len(late)

    def check(self) -> None:
        assert len(self._counts) == len(self._open), "reservation counts"

    def _close(self, res: Reservation) -> None:
        del self._open[res.reservation_id]
        self._counts.remove(res.owner)
