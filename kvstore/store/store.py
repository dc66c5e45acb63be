"""Single-node store: two-phase put, get under leases, eviction, expiry.

Every public method takes the store lock, validates its input completely before it
changes anything, and leaves the index, tiers and policy consistent (`check_integrity`).
Time comes from the injected `clock`, so tests move it instead of sleeping.

A put is `reserve` -> a `Reservation` that writes, commits or aborts itself; a read is
`acquire` -> a `Lease` that reads and releases itself. Every call is for a `Caller`,
resolved once at the edge (default `LOCAL`: an in-process caller on a node without
tenants): the namespace ids it names are mapped through it, and what it opens is its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvstore.keys import ChainPosition, Namespace
from kvstore.results import (
    NO_RESERVATION,
    MatchResult,
    NamespaceInfo,
    PutStatus,
    StoreStats,
)
from kvstore.store import chains, key_checks
from kvstore.store.caller import LOCAL, Caller
from kvstore.store.config import StoreConfig
from kvstore.store.counters import Counters
from kvstore.store.index import BlockIndex, BlockState, Entry, block_id
from kvstore.store.inventory import DEFAULT_MAX_IDS, Holding, Inventory
from kvstore.store.leases import Lease, Leases
from kvstore.store.namespaces import Namespaces
from kvstore.store.reservations import Reservation, Reservations
from kvstore.store.tiering import Tiering, TieringCounters

if TYPE_CHECKING:
    from kvstore.store.quotas import TenantQuotas

__all__ = ["Clock", "Lease", "Reservation", "Store", "StoreConfig"]
log = logging.getLogger("kvstore.store")
Clock = Callable[[], float]


@dataclass
class Store:
    """One node's blocks in DRAM and, when configured, on SSD, by namespace and key.

    With an SSD tier, a store opened on an existing `ssd_path` serves every block that was
    written there before, and the namespaces registered then. Call `close` when done.

    A caller's namespace ids are mapped to the store's own through its `Caller` (a node
    with tenants files each tenant's namespaces under internal ids, `kvstore.tenancy`), and
    the store charges every block to the tenant of its namespace, against that tenant's
    `quotas` (None: no quotas).
    """

    config: StoreConfig = field(default_factory=StoreConfig)
    clock: Clock = time.monotonic
    quotas: TenantQuotas | None = None

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._index = BlockIndex()
        tenant_of = self._tenant_of  # bound now; the namespaces it reads come next
        self._tiering = Tiering(self.config, self._index, self._lock, self.quotas, tenant_of)
        self._namespaces = Namespaces(self.config, self._tiering)
        self._counters = Counters()
        now = self._now  # the clock as it is when called: tests may set `clock` later
        self._reservations = Reservations(
            self.config, self._lock, now, self._index, self._tiering, self._counters
        )
        self._leases = Leases(self.config, self._lock, now, self._tiering.end_lease)
        self._recover()

    def _recover(self) -> None:
        if not self.config.ssd_path:
            return
        start = time.perf_counter()
        self._namespaces.load()
        num_blocks = self._tiering.recover()
        seconds, path = time.perf_counter() - start, self.config.ssd_path
        msg = "event=recovered blocks=%d namespaces=%d seconds=%.3f path=%s"
        log.info(msg, num_blocks, len(self._namespaces), seconds, path)

    def close(self) -> None:
        """Stops the demoter and closes the SSD tier; the store is unusable afterwards."""
        self._tiering.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- namespaces ----------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace, caller: Caller = LOCAL) -> NamespaceInfo:
        """Makes `namespace` known as the caller's own; idempotent. Returns its id as the
        caller computed it (internal ids never leave the node).

        Raises `FieldTooLargeError` for a field over the node's limits, InvalidArgumentError
        if its blocks cannot fit a tier, `TooManyNamespacesError` past `max_namespaces` (or
        the caller's `max_namespaces`), `StoreFullError` (registering nothing) when a full
        disk cannot store it.
        """
        self._namespaces.validate(namespace)
        internal = caller.namespaces.register_id(namespace.id)
        with self._lock:
            self._namespaces.register(namespace, internal, caller.tenant, caller.max_namespaces)
        return NamespaceInfo(namespace.id, namespace.block_bytes)

    def namespace(self, namespace_id: bytes, caller: Caller = LOCAL) -> Namespace:
        """The namespace a read of `namespace_id` reads (else `UnknownNamespaceError`)."""
        with self._lock:
            return self._namespaces.get(self._read_ids(namespace_id, caller)[0])

    # -- reads ---------------------------------------------------------------------------

    def match(
        self, namespace_id: bytes, keys: Sequence[bytes], caller: Caller = LOCAL
    ) -> MatchResult:
        """Longest committed prefix of `keys`, with the tier of each hit. Changes nothing."""
        with self._lock:
            own, fallback = self._read_ids(namespace_id, caller)
            self._check_keys(own, keys)
            hits = []
            for key in keys:
                entry = self._readable(own, key, fallback)
                if entry is None:
                    break
                hits.append(entry)
            return MatchResult(len(hits), tuple(e.tier for e in hits))

    def internal_ids(
        self, namespace_id: bytes, keys: Sequence[bytes], caller: Caller = LOCAL
    ) -> tuple[bytes, bytes | None]:
        """The store's own ids a read of `keys` in the caller's `namespace_id` looks in (its
        own namespace, then the public one it reads beneath, or None), after the checks a
        read makes; for a mirror of the index that files blocks by those ids."""
        with self._lock:
            own, fallback = self._read_ids(namespace_id, caller)
            self._check_keys(own, keys)
            return own, fallback

    def acquire(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        device: bool = False,
        caller: Caller = LOCAL,
    ) -> Lease:
        """Leases the committed blocks among `keys` for reading; misses get no view.

        A block whose checksum fails is removed and reported as a miss. `device`: the
        reader takes device memory, so blocks with a device copy (HBM) are served from it,
        and the others read from DRAM get one for next time. The lease counts against the
        caller's owner (`TooManyLeasesError` past its limit or the node's).
        """
        with self._lock:
            self.expire()
            own, fallback = self._read_ids(namespace_id, caller)
            self._check_keys(own, keys)
            self._leases.check_limit(caller.owner)
            entries = [self._readable(own, key, fallback) for key in keys]
            block_tokens = self._namespaces.get(own).layout.block_tokens
            views, hits = self._tiering.read(entries, device, block_tokens)
            nbytes = sum(e.nbytes for e in hits)
            misses = len(keys) - len(hits)
            self._counters.count_read(caller.tenant, len(hits), misses, block_tokens, nbytes)
            return self._leases.open(hits, views, caller.owner)

    def read(
        self, namespace_id: bytes, keys: Sequence[bytes], caller: Caller = LOCAL
    ) -> list[bytes | None]:
        """Copies of the committed blocks among `keys` (None for a miss)."""
        with self._lock, self.acquire(namespace_id, keys, caller=caller) as lease:
            return [None if v is None else bytes(v) for v in lease.views]

    def remove(self, namespace_id: bytes, keys: Sequence[bytes], caller: Caller = LOCAL) -> int:
        """Removes the committed blocks among `keys`; returns how many were present.

        All or nothing: raises `StoreFullError`, removing nothing, when a full disk cannot
        delete their SSD records.
        """
        with self._lock:
            internal = caller.namespaces.write_id(namespace_id, self._namespaces.__contains__)
            self._check_keys(internal, keys)
            found = [self._index.readable(internal, k) for k in keys]
            entries = [e for e in found if e is not None]
            self._tiering.remove(entries)
            return len(entries)

    # -- writes --------------------------------------------------------------------------

    def reserve(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
        caller: Caller = LOCAL,
        position: ChainPosition | None = None,
    ) -> Reservation:
        """Allocates a slot for each key not yet present, evicting as needed.

        `parents[i]` is the chain predecessor of `keys[i]` (None for a root): committed in
        this namespace or earlier in `keys`, never the key itself (else a `BadParentError`,
        see `kvstore.store.chains`). A parent that is only in the public namespace the
        caller reads beneath its own (its chain goes on from a published prefix) is taken
        as no parent: chains never cross namespaces. `position`: the first key's parent is
        held on another node of a pool, and the first key sits there in its chain (it need
        not be committed here; `InvalidArgumentError` for a position that cannot be, or
        one without a parent). All or nothing: raises
        `StoreFullError` and reserves nothing if any slot cannot be had. A call with
        nothing to reserve (every key present or in flight) opens no reservation (its id is
        `NO_RESERVATION`). The reservation counts against the caller's owner
        (`TooManyReservationsError` past its limit or the node's).
        """
        with self._lock:
            self.expire()
            internal = caller.namespaces.write_id(namespace_id, self._namespaces.__contains__)
            self._check_keys(internal, keys)
            parents = key_checks.check_parents(keys, parents)
            key_checks.check_position(keys, parents, position)
            public = self._read_ids(namespace_id, caller)[1]
            if public is not None:
                parents = self._own_parents(internal, public, keys, parents)
            statuses = tuple(self._put_status(internal, k) for k in keys)
            is_new = [s is PutStatus.RESERVED for s in statuses]
            chains.check_parents(self._index, internal, keys, parents, is_new, position is not None)
            todo = [i for i, new in enumerate(is_new) if new]
            parent_entries = [self._index.readable(internal, p) for p in parents if p]
            self._tiering.touch([e for e in parent_entries if e is not None])
            if not todo:
                return self._reservations.none(statuses, caller.owner)
            self._reservations.check_limit(caller.owner)
            block_bytes = self._namespaces.get(internal).block_bytes
            slots = self._tiering.allocate(block_bytes, len(todo), self._tenant_of(internal))
            entries = {
                i: Entry(keys[i], internal, parents[i], block_bytes, slot)
                for i, slot in zip(todo, slots, strict=True)
            }
            if position is not None and 0 in entries:
                entries[0].depth, entries[0].group = position
            return self._reservations.open(statuses, entries, caller.owner, caller.tenant)

    def reservation(self, reservation_id: int, caller: Caller = LOCAL) -> Reservation:
        """The open reservation `reservation_id` of the caller (a wire that names it by id
        between calls); `UnknownReservationError` for any other, or one that has ended.
        `NO_RESERVATION` is the empty reservation of a call with nothing to reserve."""
        with self._lock:
            if reservation_id == NO_RESERVATION:
                return self._reservations.none((), caller.owner)
            return self._reservations.owned(reservation_id, caller.owner)

    # -- inventory: what a mirror of the node's blocks reads (kvstore.cluster) -----------

    def watch_inventory(self, max_changes: int = DEFAULT_MAX_IDS) -> None:
        """Notes every change of what the node holds from now on (`inventory_changes`)."""
        with self._lock:
            self._index.inventory = Inventory[Entry](max_changes)

    def inventory_changes(self) -> tuple[list[Holding], bool]:
        """What changed since the last call, as held now, and whether changes were
        forgotten (past `max_changes`: then read every block with `held_ids`)."""
        with self._lock:
            assert self._index.inventory is not None, "watch_inventory first"
            entries, overflowed = self._index.inventory.take()
            return [self._holding(e) for e in entries], overflowed

    def held_ids(self) -> list[bytes]:
        """The block ids the node holds now (to read in slices with `holdings`)."""
        with self._lock:
            return [e.block_id for e in self._index if e.is_readable]

    def holdings(self, block_ids: Sequence[bytes]) -> list[Holding]:
        """What the node holds of each of `block_ids` now (those it holds no longer are
        left out)."""
        with self._lock:
            entries = (self._index.get(bid) for bid in block_ids)
            return [self._holding(e) for e in entries if e is not None and e.is_readable]

    def _holding(self, entry: Entry) -> Holding:
        held = entry.is_readable and self._index.get(entry.block_id) is entry
        tier = None if not held else "ssd" if entry.slot is None else "dram"
        return Holding(entry.namespace_id, entry.key, entry.group, tier)

    # -- housekeeping --------------------------------------------------------------------

    def expire(self) -> None:
        """Ends leases and reservations whose deadline has passed."""
        with self._lock:
            now = self.clock()
            self._reservations.expire(now)
            self._leases.expire(now)

    def stats(self, caller: Caller = LOCAL) -> StoreStats:
        """The node's stats for a caller that `sees_node`; else its tenant's own: its
        blocks, namespaces, bytes per tier (its quota as the capacity) and counters, with
        node-wide events (evictions, demotions, ...) at 0."""
        with self._lock:
            if not caller.sees_node:
                num_blocks, tiers = self._tiering.tenant_usage(caller.tenant)
                sizes = (num_blocks, self._namespaces.num_of(caller.tenant), 0, 0)
                return self._counters.of(caller.tenant).stats(sizes, TieringCounters(), tiers)
            num_blocks = len(self._index) - self._reservations.num_entries
            sizes = (num_blocks, len(self._namespaces), len(self._reservations), len(self._leases))
            counters = replace(
                self._counters.node,
                expired_reservations=self._reservations.num_expired,
                expired_leases=self._leases.num_expired,
            )
            return counters.stats(sizes, self._tiering.counters, self._tiering.usage())

    def has_key(self, namespace_id: bytes, key: bytes) -> bool:
        """Whether `key` is committed in `namespace_id`."""
        with self._lock:
            return self._index.readable(namespace_id, key) is not None

    def tenant_bytes(self) -> dict[str, dict[str, int]]:
        """tier -> tenant -> bytes held (what the operator's metrics show)."""
        with self._lock:
            return self._tiering.tenant_bytes()

    def tiers_of(self, namespace_id: bytes, keys: Sequence[bytes]) -> tuple[frozenset[str], ...]:
        """Every tier holding a copy of each committed block of `keys` (empty: not held);
        changes nothing. For operators and tests: `match` reports only the tier a read
        would be served from."""
        with self._lock:
            self._check_keys(namespace_id, keys)
            entries = [self._index.readable(namespace_id, key) for key in keys]
            return tuple(frozenset() if e is None else _tiers_holding(e) for e in entries)

    def eviction_order(self, tier: str) -> list[tuple[bytes, bytes]]:
        """The (namespace id, key) of the blocks `tier`'s policy ("dram" or "ssd") would
        evict, best victim first; changes nothing. For operators and tests."""
        with self._lock:
            entries = (self._index.get(block) for block in self._tiering.eviction_order(tier))
            return [(e.namespace_id, e.key) for e in entries if e is not None]

    def demote_now(self) -> int:
        """Runs one demotion pass now (tests, benchmarks); returns blocks demoted."""
        return self._tiering.demote_pass() if self.config.ssd_path else 0

    def check_integrity(self) -> None:
        """Asserts that index, tiers, policies, leases and reservations agree."""
        with self._lock:
            self._tiering.check()
            self._reservations.check()
            self._leases.check()
            reserved = [e for e in self._index if e.state is BlockState.RESERVED]
            assert len(reserved) == self._reservations.num_entries, "reserved, unreserved"
            leased = self._leases.entries()
            # Leased blocks removed meanwhile are out of the index, holding stale slots.
            for entry in {id(e): e for e in [*self._index, *leased]}.values():
                live = sum(e is entry for e in leased)
                assert entry.num_leases == live, f"lease count of {entry.key.hex()[:8]} is off"

    # -- internals -----------------------------------------------------------------------

    def _now(self) -> float:
        return self.clock()

    def _tenant_of(self, namespace_id: bytes) -> str:
        return self._namespaces.tenant_of(namespace_id)

    def _read_ids(self, namespace_id: bytes, caller: Caller) -> tuple[bytes, bytes | None]:
        """(where a read looks first, where next); a namespace the caller has only in the
        public namespace it reads beneath its own is read there. Whether `own` is known is
        the caller's to check (`_check_keys`, or `Namespaces.get`)."""
        return caller.namespaces.read_ids(namespace_id, self._namespaces.__contains__)

    def _readable(self, namespace_id: bytes, key: bytes, fallback_id: bytes | None) -> Entry | None:
        entry = self._index.readable(namespace_id, key)
        if entry is None and fallback_id is not None:
            entry = self._index.readable(fallback_id, key)
        return entry

    def _check_keys(self, namespace_id: bytes, keys: Sequence[bytes]) -> None:
        self._namespaces.get(namespace_id)
        key_checks.check_keys(keys, self.config.max_batch_keys)

    def _put_status(self, namespace_id: bytes, key: bytes) -> PutStatus:
        entry = self._index.get(block_id(namespace_id, key))
        if entry is None:
            return PutStatus.RESERVED
        return PutStatus.PRESENT if entry.is_readable else PutStatus.IN_FLIGHT

    def _own_parents(
        self,
        internal: bytes,
        public: bytes,
        keys: Sequence[bytes],
        parents: Sequence[bytes | None],
    ) -> list[bytes | None]:
        """`parents` with each that only `public` holds taken as no parent."""
        earlier = set(keys)
        out = list(parents)
        for i, parent in enumerate(parents):
            if parent is None or parent in earlier or len(parent) != len(keys[i]):
                continue  # malformed ones stay, for the chain rules to refuse
            mine, published = (self._index.readable(n, parent) for n in (internal, public))
            if mine is None and published is not None:
                out[i] = None
        return out


def _tiers_holding(entry: Entry) -> frozenset[str]:
    held = {"dram"} if entry.slot is not None else set()
    held |= {"ssd"} if entry.on_ssd else set()
    held |= {"hbm"} if entry.hbm_slot is not None else set()
    return frozenset(held)
