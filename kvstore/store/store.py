"""Single-node store: two-phase put, get under leases, eviction, expiry.

Every public method takes the store lock, validates its input completely before it
changes anything, and leaves the index, tiers and policy consistent (`check_integrity`).
Time comes from the injected `clock`, so tests move it instead of sleeping. The write half
(reserve, write, commit, abort) is `kvstore.store.writes.StoreWrites`, mixed in.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore import errors
from kvstore.auth import ANONYMOUS
from kvstore.keys import Namespace
from kvstore.limits import LOCAL_OWNER
from kvstore.results import (
    MatchResult,
    NamespaceInfo,
    StoreStats,
    TierUsage,
)
from kvstore.store import key_checks
from kvstore.store.config import StoreConfig
from kvstore.store.counters import StoreCounters
from kvstore.store.index import BlockIndex, BlockState, Entry
from kvstore.store.leases import Lease, Leases, OpenLease
from kvstore.store.namespaces import Namespaces
from kvstore.store.reservations import Reservations
from kvstore.store.tiering import Tiering
from kvstore.store.writes import StoreWrites

if TYPE_CHECKING:
    from kvstore.store.quotas import TenantQuotas

__all__ = ["Clock", "Lease", "Store", "StoreConfig"]
log = logging.getLogger("kvstore.store")
Clock = Callable[[], float]


@dataclass
class Store(StoreWrites):
    """One node's blocks in DRAM and, when configured, on SSD, by namespace and key.

    With an SSD tier, a store opened on an existing `ssd_path` serves every block that was
    written there before, and the namespaces registered then. Call `close` when done.

    Namespace ids here are the store's own: a node with tenants registers each tenant's
    namespaces under internal ids (`kvstore.tenancy`), and the store charges every block to
    the tenant of its namespace, against that tenant's `quotas` (None: no quotas).
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
        self._reservations = Reservations(self.config)
        self._leases = Leases(self.config)
        self._ids = itertools.count(1)
        self._counters = StoreCounters()
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

    def register_namespace(
        self,
        namespace: Namespace,
        namespace_id: bytes | None = None,
        tenant: str = ANONYMOUS,
        max_per_tenant: int | None = None,
    ) -> NamespaceInfo:
        """Makes `namespace` known; idempotent. Returns its own id, whatever it is filed as.

        `namespace_id`: the id to file it under (default its own); `tenant`: whose it is,
        registering at most `max_per_tenant` of them (None: no limit).

        Raises `FieldTooLargeError` for a field over the node's limits, InvalidArgumentError
        if its blocks cannot fit a tier, `TooManyNamespacesError` past `max_namespaces` (or
        `max_per_tenant`), `StoreFullError` (registering nothing) when a full disk cannot
        store it.
        """
        self._namespaces.validate(namespace)
        with self._lock:
            self._namespaces.register(namespace, namespace_id, tenant, max_per_tenant)
        return NamespaceInfo(namespace.id, namespace.block_bytes)

    def is_registered(self, namespace_id: bytes) -> bool:
        with self._lock:
            return namespace_id in self._namespaces

    def namespace(self, namespace_id: bytes) -> Namespace:
        """The registered namespace `namespace_id` (else `UnknownNamespaceError`)."""
        return self._namespaces.get(namespace_id)

    # -- reads ---------------------------------------------------------------------------

    def match(
        self, namespace_id: bytes, keys: Sequence[bytes], fallback_id: bytes | None = None
    ) -> MatchResult:
        """Longest committed prefix of `keys`, with the tier of each hit. Changes nothing.

        `fallback_id`: a namespace (of the same layout) each key is also looked up in, where
        `namespace_id` does not have it (a tenant's read of the public namespace)."""
        with self._lock:
            self._check_keys(namespace_id, keys)
            hits = []
            for key in keys:
                entry = self._readable(namespace_id, key, fallback_id)
                if entry is None:
                    break
                hits.append(entry)
            return MatchResult(len(hits), tuple(e.tier for e in hits))

    def acquire(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        device: bool = False,
        owner: str = LOCAL_OWNER,
        fallback_id: bytes | None = None,
    ) -> Lease:
        """Leases the committed blocks among `keys` for reading; misses get no view.

        A block whose checksum fails is removed and reported as a miss. `device`: the
        reader takes device memory, so blocks with a device copy (HBM) are served from it,
        and the others read from DRAM get one for next time. `owner`: the client the lease
        counts against (`TooManyLeasesError` past its limit or the node's). `fallback_id`:
        as in `match`.
        """
        with self._lock:
            self.expire()
            self._check_keys(namespace_id, keys)
            self._leases.check_limit(owner)
            entries = [self._readable(namespace_id, key, fallback_id) for key in keys]
            block_tokens = self._namespaces.get(namespace_id).layout.block_tokens
            views, hits = self._tiering.read(entries, device, block_tokens)
            self._counters.hits += len(hits)
            self._counters.misses += len(keys) - len(hits)
            self._counters.miss_tokens += (len(keys) - len(hits)) * block_tokens
            self._counters.bytes_read += sum(e.nbytes for e in hits)
            expires_at = self.clock() + self.config.lease_timeout_s
            return self._leases.open(next(self._ids), hits, views, expires_at, owner)

    def release(self, lease_id: int) -> None:
        """Ends a lease; a no-op if it already expired."""
        with self._lock:
            if lease_id in self._leases:
                self._end_lease(self._leases.close(lease_id))

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
            view = lease.host_view(lease_id, index)
            lease.expires_at = self.clock() + self.config.lease_timeout_s
            return bytes(view[offset : offset + nbytes])

    def remove(self, namespace_id: bytes, keys: Sequence[bytes]) -> int:
        """Removes the committed blocks among `keys`; returns how many were present.

        All or nothing: raises `StoreFullError`, removing nothing, when a full disk cannot
        delete their SSD records.
        """
        with self._lock:
            self._check_keys(namespace_id, keys)
            found = [self._index.readable(namespace_id, k) for k in keys]
            entries = [e for e in found if e is not None]
            self._tiering.remove(entries)
            return len(entries)

    # -- housekeeping --------------------------------------------------------------------

    def expire(self) -> None:
        """Ends leases and reservations whose deadline has passed."""
        with self._lock:
            now = self.clock()
            for rid in self._reservations.expired(now):
                self._drop_reservation(self._reservations.close(rid))
                self._counters.expired_reservations += 1
            for lid in self._leases.expired(now):
                self._expire_lease(lid)

    def stats(self) -> StoreStats:
        with self._lock:
            num_blocks = len(self._index) - self._reservations.num_entries
            sizes = (num_blocks, len(self._namespaces), len(self._reservations), len(self._leases))
            return self._counters.stats(sizes, self._tiering.counters, self._tiering.usage())

    def tenant_usage(self, tenant: str) -> tuple[int, tuple[TierUsage, ...]]:
        """`tenant`'s committed blocks and its share of each tier (`Tiering.tenant_usage`)."""
        with self._lock:
            return self._tiering.tenant_usage(tenant)

    def has_key(self, namespace_id: bytes, key: bytes) -> bool:
        """Whether `key` is committed in `namespace_id`."""
        with self._lock:
            return self._index.readable(namespace_id, key) is not None

    def num_namespaces_of(self, tenant: str) -> int:
        with self._lock:
            return self._namespaces.num_of(tenant)

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

    def _tenant_of(self, namespace_id: bytes) -> str:
        return self._namespaces.tenant_of(namespace_id)

    def _readable(self, namespace_id: bytes, key: bytes, fallback_id: bytes | None) -> Entry | None:
        entry = self._index.readable(namespace_id, key)
        if entry is None and fallback_id is not None:
            entry = self._index.readable(fallback_id, key)
        return entry

    def _check_keys(self, namespace_id: bytes, keys: Sequence[bytes]) -> None:
        self.namespace(namespace_id)
        key_checks.check_keys(keys, self.config.max_batch_keys)

    def _live_lease(self, lease_id: int) -> OpenLease:
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
        self._end_lease(self._leases.close(lease_id))
        self._counters.expired_leases += 1

    def _end_lease(self, lease: OpenLease) -> None:
        for entry in lease.entries:
            self._tiering.end_lease(entry)


def _tiers_holding(entry: Entry) -> frozenset[str]:
    held = {"dram"} if entry.slot is not None else set()
    held |= {"ssd"} if entry.on_ssd else set()
    held |= {"hbm"} if entry.hbm_slot is not None else set()
    return frozenset(held)
