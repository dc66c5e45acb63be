"""Single-node store: two-phase put, get under leases, eviction, expiry.

Every public method takes the store lock, validates its input completely before it
changes anything, and leaves the index, tiers and policy consistent (`check_integrity`).
Time comes from the injected `clock`, so tests move it instead of sleeping.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore import chains, errors
from kvstore.checksum import checksum
from kvstore.index import BlockIndex, BlockState, Entry, block_id
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.limits import LAYOUT_FIELDS, LOCAL_OWNER, OwnerCounts
from kvstore.results import (
    NO_RESERVATION,
    MatchResult,
    NamespaceInfo,
    PutStatus,
    ReserveResult,
    StoreStats,
)
from kvstore.store_config import StoreConfig
from kvstore.tiering import Tiering

log = logging.getLogger("kvstore.store")
Clock = Callable[[], float]


@dataclass
class _Reservation:
    namespace_id: bytes
    entries: dict[int, Entry]  # index in the reserve call -> reserved entry
    written: dict[int, int]  # index -> bytes written so far, in order
    expires_at: float
    owner: str  # the client that holds it (`kvstore.limits`)
    sums: dict[int, int] = field(default_factory=dict)  # index -> CRC32C the node computed


@dataclass
class _Lease:
    entries: list[Entry]
    views: dict[int, Any]  # index in the acquire call -> view of the block, hits only
    expires_at: float
    owner: str


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    blocks_committed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    expired_reservations: int = 0
    expired_leases: int = 0


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
class Store:
    """One node's blocks in DRAM and, when configured, on SSD, by namespace and key.

    With an SSD tier, a store opened on an existing `ssd_path` serves every block that was
    written there before, and the namespaces registered then. Call `close` when done.
    """

    config: StoreConfig = field(default_factory=StoreConfig)
    clock: Clock = time.monotonic

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._index = BlockIndex()
        self._tiering = Tiering(self.config, self._index, self._lock)
        self._namespaces: dict[bytes, Namespace] = {}
        self._reservations: dict[int, _Reservation] = {}
        self._leases: dict[int, _Lease] = {}
        config = self.config
        self._reservation_counts = OwnerCounts(
            "reservations",
            config.max_reservations_per_client,
            config.max_reservations,
            errors.TooManyReservationsError,
        )
        self._lease_counts = OwnerCounts(
            "leases", config.max_leases_per_client, config.max_leases, errors.TooManyLeasesError
        )
        self._ids = itertools.count(1)
        self._counters = _Counters()
        self._recover()

    def _recover(self) -> None:
        ssd = self._tiering.ssd
        if ssd is None:
            return
        start = time.perf_counter()
        for raw in ssd.load_meta().values():
            ns = Namespace.decode(raw)
            self._namespaces[ns.id] = ns
        num_blocks = self._tiering.recover()
        log.info(
            "event=recovered blocks=%d namespaces=%d seconds=%.3f path=%s",
            num_blocks,
            len(self._namespaces),
            time.perf_counter() - start,
            ssd.path,
        )

    def close(self) -> None:
        """Stops the demoter and closes the SSD tier; the store is unusable afterwards."""
        self._tiering.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- namespaces ----------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace) -> NamespaceInfo:
        """Makes `namespace` known; idempotent.

        Raises `FieldTooLargeError` for a field over the node's limits, InvalidArgumentError
        if its blocks cannot fit a tier, `TooManyNamespacesError` past `max_namespaces`.
        """
        lay = namespace.layout
        layout = {name: getattr(lay, name) for name in LAYOUT_FIELDS}
        limits = self.config.namespace_limits
        limits.check(namespace.model_id, lay.dtype, namespace.tenant_salt, layout)
        dram = self._tiering.dram
        if not dram.can_fit(namespace.block_bytes):
            raise errors.InvalidArgumentError(
                f"block of {namespace.block_bytes} bytes exceeds the slab size "
                f"({dram.slab_bytes} bytes)"
            )
        with self._lock:
            is_new = namespace.id not in self._namespaces
            if is_new and len(self._namespaces) >= self.config.max_namespaces:
                raise errors.TooManyNamespacesError(
                    f"the node has {len(self._namespaces)} namespaces, the most allowed "
                    f"(max_namespaces = {self.config.max_namespaces})"
                )
            if is_new and self._tiering.ssd is not None:
                self._tiering.ssd.save_meta(namespace.id, namespace.encode())
            self._namespaces[namespace.id] = namespace
        return NamespaceInfo(namespace.id, namespace.block_bytes)

    def namespace(self, namespace_id: bytes) -> Namespace:
        try:
            return self._namespaces[namespace_id]
        except KeyError:
            raise errors.UnknownNamespaceError(
                f"unknown namespace {namespace_id.hex()[:16]}...; register it first"
            ) from None

    # -- reads ---------------------------------------------------------------------------

    def match(self, namespace_id: bytes, keys: Sequence[bytes]) -> MatchResult:
        """Longest committed prefix of `keys`, with the tier of each hit. Changes nothing."""
        with self._lock:
            self._check_keys(namespace_id, keys)
            hits = self._index.match(namespace_id, keys)
            return MatchResult(len(hits), tuple(e.tier for e in hits))

    def acquire(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        device: bool = False,
        owner: str = LOCAL_OWNER,
    ) -> Lease:
        """Leases the committed blocks among `keys` for reading; misses get no view.

        A block whose checksum fails is removed and reported as a miss. `device`: the
        reader takes device memory, so blocks with a device copy (HBM) are served from it,
        and the others read from DRAM get one for next time. `owner`: the client the lease
        counts against (`TooManyLeasesError` past its limit or the node's).
        """
        with self._lock:
            self.expire()
            self._check_keys(namespace_id, keys)
            self._lease_counts.check(owner)
            entries = [self._index.readable(namespace_id, key) for key in keys]
            for entry in entries:  # pinned first: promoting one must not evict another
                if entry is not None:
                    entry.num_leases += 1
            views: list[Any] = []
            hits = []
            for entry in entries:
                view = None if entry is None else self._tiering.load(entry, device)
                if entry is not None and view is None:
                    self._tiering.end_lease(entry)  # failed its checksum: now dropped
                elif entry is not None:
                    hits.append(entry)
                views.append(view)
            self._tiering.touch(hits)
            if device:
                self._tiering.copy_up(hits, [v for v in views if v is not None])
            self._counters.hits += len(hits)
            self._counters.misses += len(keys) - len(hits)
            self._counters.bytes_read += sum(e.nbytes for e in hits)
            lease_id = next(self._ids)
            expires_at = self.clock() + self.config.lease_timeout_s
            self._lease_counts.add(owner)
            found = {i: v for i, v in enumerate(views) if v is not None}
            self._leases[lease_id] = _Lease(hits, found, expires_at, owner)
            sums = iter(e.checksum for e in hits)
            checksums = tuple(0 if v is None else next(sums) for v in views)
            return Lease(lease_id, tuple(views), expires_at, checksums)

    def release(self, lease_id: int) -> None:
        """Ends a lease; a no-op if it already expired."""
        with self._lock:
            if lease_id in self._leases:
                self._end_lease(self._close_lease(lease_id))

    def read(self, namespace_id: bytes, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of the committed blocks among `keys` (None for a miss)."""
        with self._lock:  # copied before anything can end the lease
            lease = self.acquire(namespace_id, keys)
            try:
                return [None if v is None else bytes(v) for v in lease.views]
            finally:
                self.release(lease.lease_id)

    def read_chunk(self, lease_id: int, index: int, offset: int, nbytes: int) -> bytes:
        """A copy of bytes `[offset, offset + nbytes)` of the block a lease holds for
        `keys[index]` of its `acquire`, made under the store's lock; renews the lease.

        For readers that copy a block out bit by bit (a stream that may stall between
        chunks): once the lease has ended its slot may hold another block, so this raises
        `LeaseExpiredError` instead of reading it. Host leases only.
        """
        with self._lock:
            lease = self._live_lease(lease_id)
            view = lease.views.get(index)
            if view is None:
                raise errors.InvalidArgumentError(f"lease {lease_id} holds no block {index}")
            assert isinstance(view, memoryview), "read_chunk reads host leases"
            lease.expires_at = self.clock() + self.config.lease_timeout_s
            return bytes(view[offset : offset + nbytes])

    # -- writes --------------------------------------------------------------------------

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
        see `kvstore.chains`). All or nothing: raises `StoreFullError` and reserves nothing
        if any slot cannot be had. A call with nothing to reserve (every key present or in
        flight) opens no reservation: its id is `NO_RESERVATION`. `owner`: the client the
        reservation counts against (`TooManyReservationsError` past its limit or the node's).
        """
        with self._lock:
            self.expire()
            self._check_keys(namespace_id, keys)
            parents = self._check_parents(keys, parents)
            statuses = [self._put_status(namespace_id, k) for k in keys]
            is_new = [s is PutStatus.RESERVED for s in statuses]
            chains.check_parents(self._index, namespace_id, keys, parents, is_new)
            todo = [i for i, new in enumerate(is_new) if new]
            block_bytes = self._namespaces[namespace_id].block_bytes
            parent_entries = [self._index.readable(namespace_id, p) for p in parents if p]
            self._tiering.touch([e for e in parent_entries if e is not None])
            if not todo:
                return ReserveResult(NO_RESERVATION, tuple(statuses))
            self._reservation_counts.check(owner)
            slots = self._tiering.allocate(block_bytes, len(todo))
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
            res = self._reservation(reservation_id, owner)
            entry = res.entries.get(index)
            if entry is None:
                raise errors.InvalidArgumentError(
                    f"block {index} is not reserved by {reservation_id}"
                )
            if offset != res.written[index]:
                raise errors.InvalidArgumentError(
                    f"block {index}: chunk at offset {offset}, expected {res.written[index]}"
                )
            end = offset + len(data)
            if end > entry.nbytes:
                raise errors.PayloadSizeError(
                    f"block {index}: {end} bytes written, block size is {entry.nbytes}"
                )
            self._view(entry)[offset:end] = data
            res.written[index] = end

    def rewind(
        self, reservation_id: int, index: int, offset: int, owner: str = LOCAL_OWNER
    ) -> None:
        """Takes reserved block `index` back to `offset` bytes written, unless it is written
        whole, so that a write stream that failed leaves no block half done. A no-op for a
        reservation that has ended; never moves a block forward."""
        with self._lock:
            res = self._reservations.get(reservation_id)
            if res is not None and res.owner != owner:
                return
            entry = None if res is None else res.entries.get(index)
            if res is None or entry is None or res.written[index] == entry.nbytes:
                return
            res.written[index] = min(res.written[index], offset)
            res.sums.pop(index, None)

    def reservation_view(
        self, reservation_id: int, index: int, owner: str = LOCAL_OWNER
    ) -> memoryview:
        """Writable view of reserved block `index`, for a transport that receives in place.

        Call `mark_written` once the whole block has arrived; the view is valid until the
        reservation is committed, aborted or expires.
        """
        with self._lock:
            res = self._reservation(reservation_id, owner)
            return self._view(self._reserved_entry(res, reservation_id, index))

    def mark_written(
        self, reservation_id: int, index: int, crc: int | None = None, owner: str = LOCAL_OWNER
    ) -> None:
        """Records that reserved block `index` was written whole through its view.

        `crc`: the CRC32C of the slot, computed by this node once the write completed (a
        transport that sums each block as it lands); `commit` then does not sum it again.
        """
        with self._lock:
            res = self._reservation(reservation_id, owner)
            res.written[index] = self._reserved_entry(res, reservation_id, index).nbytes
            if crc is not None:
                res.sums[index] = crc

    def commit(
        self,
        reservation_id: int,
        checksums: Sequence[int] | None = None,
        owner: str = LOCAL_OWNER,
    ) -> int:
        """Makes every block of the reservation readable; returns how many it committed.

        Args:
            reservation_id: from `reserve`.
            checksums: optional CRC32C per key of the reserve call, as the sender computed
                it. On any mismatch the reservation is aborted and ChecksumMismatchError
                raised: altered or short bytes are never committed. `NO_RESERVATION`
                commits nothing.
        """
        if reservation_id == NO_RESERVATION:
            return 0
        with self._lock:
            res = self._reservation(reservation_id, owner)
            short = [i for i, e in res.entries.items() if res.written[i] != e.nbytes]
            if short:
                raise errors.IncompleteWriteError(
                    f"blocks {short[:8]} are not fully written; "
                    f"each needs {next(iter(res.entries.values())).nbytes} bytes"
                )
            views = {i: self._view(e) for i, e in res.entries.items()}
        # Outside the lock (the checksum releases the GIL): the slots are this reservation's.
        crcs = {i: res.sums[i] if i in res.sums else checksum(v) for i, v in views.items()}
        with self._lock:
            if self._reservations.get(reservation_id) is not res:
                raise errors.UnknownReservationError(f"reservation {reservation_id} expired")
            bad = [i for i in crcs if checksums is not None and crcs[i] != checksums[i]]
            if bad:
                self.abort(reservation_id, owner)
                raise errors.ChecksumMismatchError(
                    f"blocks {bad[:8]} arrived short or altered (bad checksum); nothing committed"
                )
            self._close_reservation(reservation_id)
            for i, entry in res.entries.items():
                entry.checksum = crcs[i]
                entry.state = BlockState.COMMITTED
                self._counters.bytes_written += entry.nbytes
            self._tiering.on_commit(list(res.entries.values()))
            self._counters.blocks_committed += len(res.entries)
            return len(res.entries)

    def abort(self, reservation_id: int, owner: str = LOCAL_OWNER) -> None:
        """Drops a reservation and frees its slots (nothing for `NO_RESERVATION`)."""
        if reservation_id == NO_RESERVATION:
            return
        with self._lock:
            self._drop_reservation(self._reservation(reservation_id, owner))
            self._close_reservation(reservation_id)

    def remove(self, namespace_id: bytes, keys: Sequence[bytes]) -> int:
        """Removes the committed blocks among `keys`; returns how many were present."""
        with self._lock:
            self._check_keys(namespace_id, keys)
            entries = [self._index.readable(namespace_id, k) for k in keys]
            for entry in entries:
                if entry is not None:
                    self._tiering.drop(entry)
            return sum(e is not None for e in entries)

    # -- housekeeping --------------------------------------------------------------------

    def expire(self) -> None:
        """Ends leases and reservations whose deadline has passed."""
        with self._lock:
            now = self.clock()
            for rid in [r for r, res in self._reservations.items() if res.expires_at <= now]:
                self._drop_reservation(self._close_reservation(rid))
                self._counters.expired_reservations += 1
            for lid in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
                self._expire_lease(lid)

    def stats(self) -> StoreStats:
        with self._lock:
            c, t = self._counters, self._tiering.counters
            return StoreStats(
                num_blocks=len(self._index) - self._num_reserved(),
                num_namespaces=len(self._namespaces),
                num_reservations=len(self._reservations),
                num_leases=len(self._leases),
                hits=c.hits,
                misses=c.misses,
                evictions=t.evictions,
                blocks_committed=c.blocks_committed,
                bytes_written=c.bytes_written,
                bytes_read=c.bytes_read,
                checksum_failures=t.checksum_failures,
                expired_reservations=c.expired_reservations,
                expired_leases=c.expired_leases,
                tiers=self._tiering.usage(),
            )

    def demote_now(self) -> int:
        """Runs one demotion pass now (tests, benchmarks); returns blocks demoted."""
        return self._tiering.demote_pass() if self._tiering.ssd is not None else 0

    def check_integrity(self) -> None:
        """Asserts that index, policies, tiers, leases and reservations agree."""
        with self._lock:
            t = self._tiering
            committed = [e for e in self._index if e.state is BlockState.COMMITTED]
            reserved = [e for e in self._index if e.state is BlockState.RESERVED]
            assert all(e.slot is not None or e.on_ssd for e in committed), "entry in no tier"
            in_dram = sum(e.slot is not None and not e.is_demoting for e in committed)
            assert in_dram == len(t.dram_policy), "DRAM policy and entries disagree"
            assert sum(e.on_ssd for e in committed) == len(t.ssd_policy), "SSD policy"
            assert len(reserved) == self._num_reserved(), "reserved entries without a reservation"
            assert len(self._reservation_counts) == len(self._reservations), "reservation counts"
            assert len(self._lease_counts) == len(self._leases), "lease counts"
            leased = [e for lease in self._leases.values() for e in lease.entries]
            stale = {id(e) for e in leased if e.stale_slot is not None}
            assert not any(e.is_demoting for e in self._index), "demotion left a pin"
            slots = sum(e.slot is not None for e in self._index) + len(stale)
            assert t.dram.stats().num_slots == slots, "DRAM slots and entries disagree"
            if t.ssd is not None:
                assert t.ssd.stats().num_slots == len(t.ssd_policy), "SSD records and entries"
            if t.hbm is not None:
                on_hbm = [e for e in self._index if e.hbm_slot is not None]
                assert all(e.slot is not None for e in on_hbm), "HBM holds a block DRAM lost"
                assert len(on_hbm) == len(t.hbm) == len(t.hbm.policy), "HBM policy and entries"
                stale_hbm = {id(e) for e in leased if e.stale_hbm_slot is not None}
                assert t.hbm.tier.stats().num_slots == len(on_hbm) + len(stale_hbm), "HBM slots"
            both = {e.block_id for e in committed if e.slot is not None and e.on_ssd}
            assert set(t._redundant) == both, "redundant copies are mistracked"
            for entry in self._index:
                live = sum(e is entry for e in leased)
                assert entry.num_leases == live, f"lease count of {entry.key.hex()[:8]} is off"

    # -- internals -----------------------------------------------------------------------

    def _check_keys(self, namespace_id: bytes, keys: Sequence[bytes]) -> None:
        self.namespace(namespace_id)
        if not keys:
            raise errors.EmptyRequestError("no keys given")
        if len(keys) > self.config.max_batch_keys:
            raise errors.BatchTooLargeError(
                f"{len(keys)} keys in one call; the limit is {self.config.max_batch_keys}"
            )
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise errors.BadKeyError(f"key {i} has {len(key)} bytes, keys have {KEY_BYTES}")
        if len(set(keys)) != len(keys):
            raise errors.DuplicateKeyError("the same key appears more than once in one call")

    def _check_parents(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None] | None
    ) -> list[bytes | None]:
        if parents is None:
            return [None] * len(keys)
        if len(parents) != len(keys):
            raise errors.InvalidArgumentError(f"{len(parents)} parents for {len(keys)} keys")
        if any(p is not None and len(p) != KEY_BYTES for p in parents):
            raise errors.BadKeyError(f"parent keys must be {KEY_BYTES} bytes")
        return list(parents)

    def _put_status(self, namespace_id: bytes, key: bytes) -> PutStatus:
        entry = self._index.get(block_id(namespace_id, key))
        if entry is None:
            return PutStatus.RESERVED
        return PutStatus.PRESENT if entry.is_readable else PutStatus.IN_FLIGHT

    def _num_reserved(self) -> int:
        return sum(len(r.entries) for r in self._reservations.values())

    def _view(self, entry: Entry) -> memoryview:
        assert entry.slot is not None, "reserved entries live in DRAM"
        return self._tiering.dram.view(entry.slot)

    def _drop_reservation(self, res: _Reservation) -> None:
        for entry in res.entries.values():
            self._index.pop(entry.block_id)
            assert entry.slot is not None
            self._tiering.dram.free(entry.slot)

    def _live_lease(self, lease_id: int) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is not None and lease.expires_at <= self.clock():
            self._expire_lease(lease_id)
            lease = None
        if lease is None:
            raise errors.LeaseExpiredError(
                f"lease {lease_id} has ended (released, or no read for "
                f"{self.config.lease_timeout_s} s); read the blocks again"
            )
        return lease

    def _expire_lease(self, lease_id: int) -> None:
        self._end_lease(self._close_lease(lease_id))
        self._counters.expired_leases += 1

    def _close_lease(self, lease_id: int) -> _Lease:
        lease = self._leases.pop(lease_id)
        self._lease_counts.remove(lease.owner)
        return lease

    def _open_reservation(self, namespace_id: bytes, entries: dict[int, Entry], owner: str) -> int:
        for entry in entries.values():
            self._index.add(entry)
        rid = next(self._ids)
        expires_at = self.clock() + self.config.reservation_timeout_s
        written = dict.fromkeys(entries, 0)
        self._reservations[rid] = _Reservation(namespace_id, entries, written, expires_at, owner)
        self._reservation_counts.add(owner)
        return rid

    def _close_reservation(self, reservation_id: int) -> _Reservation:
        res = self._reservations.pop(reservation_id)
        self._reservation_counts.remove(res.owner)
        return res

    def _end_lease(self, lease: _Lease) -> None:
        for entry in lease.entries:
            self._tiering.end_lease(entry)

    def _reservation(self, reservation_id: int, owner: str) -> _Reservation:
        res = self._reservations.get(reservation_id)
        if res is None or res.owner != owner:
            raise errors.UnknownReservationError(
                f"no open reservation {reservation_id} (committed, aborted or expired)"
            )
        return res

    def _reserved_entry(self, res: _Reservation, reservation_id: int, index: int) -> Entry:
        entry = res.entries.get(index)
        if entry is None:
            raise errors.InvalidArgumentError(f"block {index} is not reserved by {reservation_id}")
        return entry
