"""The write half of `Store`: the two-phase put (reserve, write or receive in place,
commit, abort).

`StoreWrites` is mixed into `Store` and keeps no state of its own: it works on the store's
lock, index, tiering, reservations and counters, under the same rules as every `Store`
method (take the lock, validate everything before changing anything).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore import errors
from kvstore.limits import LOCAL_OWNER
from kvstore.results import NO_RESERVATION, PutStatus, ReserveResult
from kvstore.store import chains, key_checks
from kvstore.store.config import StoreConfig
from kvstore.store.counters import StoreCounters
from kvstore.store.index import BlockIndex, Entry, block_id
from kvstore.store.namespaces import Namespaces
from kvstore.store.reservations import Reservation, Reservations
from kvstore.store.tiering import Tiering


class StoreWrites:
    """Reserve, write, commit and abort; see `Store` for the state they share."""

    config: StoreConfig
    clock: Callable[[], float]
    _lock: threading.RLock
    _index: BlockIndex
    _tiering: Tiering
    _namespaces: Namespaces
    _reservations: Reservations
    _counters: StoreCounters
    _ids: itertools.count[int]

    if TYPE_CHECKING:  # the store's, used here

        def expire(self) -> None: ...
        def _check_keys(self, namespace_id: bytes, keys: Sequence[bytes]) -> None: ...
        def _tenant_of(self, namespace_id: bytes) -> str: ...

    def reserve(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
        owner: str = LOCAL_OWNER,
    ) -> ReserveResult:
        """Allocates a slot for each key not yet present, evicting as needed.

        `parents[i]` is the chain predecessor of `keys[i]` (None for a root): committed in
        this namespace or earlier in `keys`, never the key itself (else a `BadParentError`,
        see `kvstore.store.chains`). All or nothing: raises `StoreFullError` and reserves nothing
        if any slot cannot be had. A call with nothing to reserve (every key present or in
        flight) opens no reservation: its id is `NO_RESERVATION`. `owner`: the client the
        reservation counts against (`TooManyReservationsError` past its limit or the node's).
        """
        with self._lock:
            self.expire()
            self._check_keys(namespace_id, keys)
            parents = key_checks.check_parents(keys, parents)
            statuses = [self._put_status(namespace_id, k) for k in keys]
            is_new = [s is PutStatus.RESERVED for s in statuses]
            chains.check_parents(self._index, namespace_id, keys, parents, is_new)
            todo = [i for i, new in enumerate(is_new) if new]
            block_bytes = self._namespaces.get(namespace_id).block_bytes
            parent_entries = [self._index.readable(namespace_id, p) for p in parents if p]
            self._tiering.touch([e for e in parent_entries if e is not None])
            if not todo:
                return ReserveResult(NO_RESERVATION, tuple(statuses))
            self._reservations.check_limit(owner)
            slots = self._tiering.allocate(block_bytes, len(todo), self._tenant_of(namespace_id))
            entries = {
                i: Entry(keys[i], namespace_id, parents[i], block_bytes, slot)
                for i, slot in zip(todo, slots, strict=True)
            }
            rid = self._open_reservation(namespace_id, entries, owner)
            return ReserveResult(rid, tuple(statuses))

    def write(
        self,
        reservation_id: int,
        index: int,
        offset: int,
        data: memoryview | bytes,
        owner: str = LOCAL_OWNER,
    ) -> None:
        """Writes `data` at `offset` of reserved block `index`; chunks arrive in order.

        Only the reservation's `owner` may write, commit or abort it; to anyone else it is
        an unknown reservation (ids are small integers, never a capability).
        """
        with self._lock:
            res = self._reservations.owned(reservation_id, owner)
            res.write(reservation_id, index, offset, data)

    def rewind(
        self, reservation_id: int, index: int, offset: int, owner: str = LOCAL_OWNER
    ) -> None:
        """Takes reserved block `index` back to `offset` bytes written, unless it is written
        whole, so that a write stream that failed leaves no block half done. A no-op for a
        reservation that has ended; never moves a block forward."""
        with self._lock:
            res = self._reservations.get(reservation_id)
            if res is not None and res.owner == owner:
                res.rewind(index, offset)

    def reservation_view(
        self, reservation_id: int, index: int, owner: str = LOCAL_OWNER
    ) -> memoryview:
        """Writable view of reserved block `index`, for a transport that receives in place
        (then `mark_written`); valid until the reservation is committed, aborted or expires."""
        with self._lock:
            return self._reservations.owned(reservation_id, owner).view(reservation_id, index)

    def reservation_views(self, reservation_id: int, owner: str = LOCAL_OWNER) -> dict:
        """`reservation_view` of every reserved block at once: index -> writable view."""
        with self._lock:
            return dict(self._reservations.owned(reservation_id, owner).views)

    def mark_written(
        self, reservation_id: int, index: int, crc: int | None = None, owner: str = LOCAL_OWNER
    ) -> None:
        """Records that reserved block `index` was written whole through its view; `crc`: the
        CRC32C of the slot that this node computed as it landed (`commit` then reuses it)."""
        with self._lock:
            res = self._reservations.owned(reservation_id, owner)
            res.mark_written(reservation_id, index, crc)

    def commit(
        self,
        reservation_id: int,
        checksums: Sequence[int] | None = None,
        owner: str = LOCAL_OWNER,
        written: Mapping[int, int] | None = None,
    ) -> int:
        """Makes every block of the reservation readable; returns how many it committed.

        Args:
            reservation_id: from `reserve`.
            checksums: optional CRC32C per key of the reserve call, as the sender computed
                it. On any mismatch the reservation is aborted and ChecksumMismatchError
                raised: altered or short bytes are never committed. `NO_RESERVATION`
                commits nothing.
            written: from a transport that received every block in place (through
                `reservation_views`), the CRC32C it computed of each (index -> sum, one per
                reserved block, else InvalidArgumentError): each is marked written and the
                batch commits under one hold of the lock, summing nothing again.
        """
        if reservation_id == NO_RESERVATION:
            return 0
        with self._lock:
            res = self._reservations.owned(reservation_id, owner)
            if written is not None:
                res.mark_all_written(reservation_id, written)
                return self._commit_summed(reservation_id, res, dict(written), checksums)
            res.check_complete()
        crcs = res.checksums()  # outside the lock: the checksum releases the GIL
        with self._lock:
            if self._reservations.get(reservation_id) is not res:
                raise errors.UnknownReservationError(f"reservation {reservation_id} expired")
            return self._commit_summed(reservation_id, res, crcs, checksums)

    def abort(self, reservation_id: int, owner: str = LOCAL_OWNER) -> None:
        """Drops a reservation and frees its slots (nothing for `NO_RESERVATION`)."""
        if reservation_id == NO_RESERVATION:
            return
        with self._lock:
            self._drop_reservation(self._reservations.owned(reservation_id, owner))
            self._reservations.close(reservation_id)

    # -- internals -----------------------------------------------------------------------

    def _put_status(self, namespace_id: bytes, key: bytes) -> PutStatus:
        entry = self._index.get(block_id(namespace_id, key))
        if entry is None:
            return PutStatus.RESERVED
        return PutStatus.PRESENT if entry.is_readable else PutStatus.IN_FLIGHT

    def _commit_summed(
        self, rid: int, res: Reservation, crcs: dict[int, int], checksums: Sequence[int] | None
    ) -> int:
        """Commits `res` (open, written whole, its slots summed to `crcs`); under the lock."""
        bad = res.mismatched(crcs, checksums)
        if bad:
            self.abort(rid, res.owner)
            raise errors.ChecksumMismatchError(
                f"blocks {bad[:8]} arrived short or altered (bad checksum); nothing committed"
            )
        self._reservations.close(rid)
        self._counters.bytes_written += res.seal(crcs)
        self._tiering.on_commit(list(res.entries.values()))
        self._counters.blocks_committed += len(res.entries)
        return len(res.entries)

    def _drop_reservation(self, res: Reservation) -> None:
        for entry in res.entries.values():
            self._index.pop(entry.block_id)
            self._tiering.free_reserved(entry)

    def _open_reservation(self, namespace_id: bytes, entries: dict[int, Entry], owner: str) -> int:
        for entry in entries.values():
            self._index.add(entry)
        rid = next(self._ids)
        expires_at = self.clock() + self.config.reservation_timeout_s
        views = self._tiering.views(entries)
        self._reservations.open(rid, Reservation(namespace_id, entries, views, expires_at, owner))
        return rid
