"""The in-process store as a state machine: several clients (each a `Caller`) reserve, write,
commit, abort, lease, read, remove and give up, while the clock jumps, DRAM evicts and
blocks move to SSD. The model and strategies are in `store_model.py`, the write side's rules
in `store_write_rules.py`; here are the reads, removes, time, owners and tiers, and the
invariants. The model holds what the store owes: each block's last committed bytes (a block
may have been evicted since, so a read returns exactly them or nothing, never another key's
or an older version's), the reservations and leases still open (the objects the store
returned), and every chain link made. Only what eviction decides is asked of the store
itself (`match`, which changes nothing). After every step: `check_integrity` passes, the
open reservations and leases are the model's, each open reservation is found by id for its
owner only (and an ended one for nobody), and every leased view still holds the bytes it was
leased with.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import Namespace
from kvstore.results import PutStatus
from kvstore.store import Store, StoreConfig
from kvstore.store.caller import Caller
from kvstore.store.eviction import POLICIES
from tests.store.store_model import (
    CALLERS,
    DRAM,
    LEASE_S,
    MAX_BATCH,
    NS_A,
    NS_B,
    RESERVATION_S,
    SLAB,
    UNKNOWN_ID,
    LeaseModel,
    content,
    key_damage,
    key_sets,
    namespaces,
    owners,
    picks,
)
from tests.store.store_write_rules import WriteRules


class StoreMachine(WriteRules):
    # -- set-up ----------------------------------------------------------------------------

    @initialize(
        policy=st.sampled_from(sorted(POLICIES)),
        with_ssd=st.booleans(),
        verify_reads=st.booleans(),
    )
    def open_store(self, policy: str, with_ssd: bool, verify_reads: bool) -> None:
        ssd = {}
        if with_ssd:
            self.ssd_dir = tempfile.mkdtemp(prefix="kvstore-sm-")
            ssd = {"ssd_path": self.ssd_dir, "ssd_bytes": 6 * SLAB, "background_demotion": False}
        self.config = StoreConfig(
            dram_bytes=DRAM,
            slab_bytes=SLAB,
            policy=policy,
            ssd_policy=policy,
            max_batch_keys=MAX_BATCH,
            reservation_timeout_s=RESERVATION_S,
            lease_timeout_s=LEASE_S,
            verify_reads=verify_reads,
            **ssd,
        )
        self.store = Store(self.config, clock=self.clock)
        for ns in (NS_A, NS_B):
            self.store.register_namespace(ns)
            self.registered.add(ns.id)

    def teardown(self) -> None:
        try:
            if self.store is not None:
                self.end_everything()
                evictions = self.store.stats().evictions
                event(f"evictions at the end: {'none' if not evictions else 'some'}")
        finally:
            if self.store is not None:
                self.store.close()
            if self.ssd_dir is not None:
                shutil.rmtree(self.ssd_dir, ignore_errors=True)

    # -- namespaces ------------------------------------------------------------------------

    @rule(ns=namespaces)
    def register(self, ns: Namespace) -> None:
        assert self.store is not None
        info = self.store.register_namespace(ns)
        assert info == (ns.id, ns.block_bytes)
        self.registered.add(ns.id)

    # -- reads -----------------------------------------------------------------------------

    @rule(owner=owners, ns=namespaces, indices=key_sets, damage=key_damage, committed=st.booleans())
    def acquire(self, owner, ns, indices, damage, committed: bool) -> None:
        """Leases blocks; with `committed`, only keys the model holds committed there (some
        may have been evicted)."""
        assert self.store is not None
        self._sweep()
        keys = self._keys(indices, damage)
        if committed:
            keys = [k for n, k in self.committed if n == ns.id][:MAX_BATCH] or keys
        error = self._key_error(ns.id, keys)
        if error is not None:
            self._expect(error, self.store.acquire, ns.id, keys, False, CALLERS[owner])
            return
        lease = self.store.acquire(ns.id, keys, caller=CALLERS[owner])
        expected = self._check_found(ns.id, keys, lease.views)
        event(f"acquire: ok, {'some' if any(lease.found) else 'none'} found")
        sums = tuple(0 if b is None else checksum(b) for b in expected)
        assert lease.checksums == sums, "a lease's checksums are not its blocks'"
        assert lease.lease_id not in self.leases
        self.leases[lease.lease_id] = LeaseModel(
            owner, ns.id, tuple(keys), lease, expected, lease.expires_at
        )
        assert lease.expires_at == self.clock.now + LEASE_S

    @rule(pick=picks)
    def release(self, pick: int) -> None:
        lid = self._held(self.leases, pick)
        if lid is None:
            if self.ended_leases:
                self.ended_leases[pick % len(self.ended_leases)].release()  # a no-op
            return
        lease = self.leases.pop(lid).lease
        lease.release()
        self.ended_leases.append(lease)
        lease.release()  # twice: a no-op
        self._expect(errors.LeaseExpiredError, lease.read_chunk, 0, 0, 1)

    @rule(
        pick=picks,
        index=st.integers(0, MAX_BATCH),
        offset=st.integers(0, 600),
        nbytes=st.integers(0, 600),
    )
    def read_chunk(self, pick: int, index: int, offset: int, nbytes: int) -> None:
        """A reader copies part of a leased block, renewing the lease; a lease past its
        deadline (not swept yet) ends instead, and an ended one reads nothing."""
        lid = self._held(self.leases, pick)
        if lid is None:
            if self.ended_leases:
                gone = self.ended_leases[pick % len(self.ended_leases)]
                self._expect(errors.LeaseExpiredError, gone.read_chunk, index, offset, nbytes)
            return
        held = self.leases[lid]
        if held.expires_at <= self.clock.now:
            self._expect(errors.LeaseExpiredError, held.lease.read_chunk, index, offset, nbytes)
            self.ended_leases.append(self.leases.pop(lid).lease)
            return
        want = held.expected[index] if index < len(held.expected) else None
        if want is None:
            self._expect(errors.InvalidArgumentError, held.lease.read_chunk, index, offset, 1)
            return
        assert held.lease.read_chunk(index, offset, nbytes) == want[offset : offset + nbytes]
        held.expires_at = self.clock.now + LEASE_S
        assert held.lease.expires_at == held.expires_at, "read_chunk did not renew the lease"

    @rule(ns=namespaces, indices=key_sets, damage=key_damage)
    def read(self, ns: Namespace, indices: list[int], damage: str | None) -> None:
        assert self.store is not None
        self._sweep()
        keys = self._keys(indices, damage)
        error = self._key_error(ns.id, keys)
        if error is not None:
            self._expect(error, self.store.read, ns.id, keys)
            return
        self._check_found(ns.id, keys, self.store.read(ns.id, keys))

    @rule(ns=namespaces, indices=key_sets, damage=key_damage)
    def match(self, ns: Namespace, indices: list[int], damage: str | None) -> None:
        assert self.store is not None
        keys = self._keys(indices, damage)
        error = self._key_error(ns.id, keys)
        if error is not None:
            self._expect(error, self.store.match, ns.id, keys)
            return
        result = self.store.match(ns.id, keys)
        known = 0
        while known < len(keys) and (ns.id, keys[known]) in self.committed:
            known += 1
        assert result.num_matched <= known, "matched a block never committed"
        tiers = {"dram", "ssd"} if self.config.ssd_path else {"dram"}
        assert len(result.tiers) == result.num_matched and set(result.tiers) <= tiers

    # -- remove ----------------------------------------------------------------------------

    @rule(ns=namespaces, indices=key_sets, damage=key_damage)
    def remove(self, ns: Namespace, indices: list[int], damage: str | None) -> None:
        assert self.store is not None
        keys = self._keys(indices, damage)
        error = self._key_error(ns.id, keys)
        if error is not None:
            self._expect(error, self.store.remove, ns.id, keys)
            return
        present = [k for k in keys if self._is_readable(ns.id, k)]
        assert all((ns.id, k) in self.committed for k in present), "a block never committed"
        leased = {
            (m.ns_id, k)
            for m in self.leases.values()
            for k, v in zip(m.keys, m.expected, strict=True)
            if v
        }
        if any((ns.id, k) in leased for k in present):
            event("remove: a leased block")
        assert self.store.remove(ns.id, keys) == len(present)
        for key in keys:
            self.committed.pop((ns.id, key), None)
            self.parent_of.pop((ns.id, key), None)
            assert not self._is_readable(ns.id, key)

    # -- time, owners, tiers ---------------------------------------------------------------

    @rule(dt=st.sampled_from([0.5, 5.0, 11.0, 21.0, 45.0]), sweep=st.booleans())
    def advance_clock(self, dt: float, sweep: bool) -> None:
        assert self.store is not None
        self.clock.now += dt
        if sweep:
            self.store.expire()
            self._sweep()

    @rule(owner=owners)
    def owner_goes_away(self, owner: int) -> None:
        """The owner's leases and reservations stay open until they expire."""
        for handle in [*self.reservations.values(), *self.leases.values()]:
            if handle.owner == owner:
                handle.is_held = False

    @rule()
    def demote_now(self) -> None:
        assert self.store is not None
        num = self.store.demote_now()
        assert num == 0 or self.config.ssd_path
        event(f"demote_now: {'none' if not num else 'some'}")

    @rule()
    def restart(self) -> None:
        """A new process on the same SSD: what reached SSD is served, DRAM is gone."""
        assert self.store is not None
        if not self.config.ssd_path:
            return
        self.store.close()
        self.store = Store(self.config, clock=self.clock)
        event("restart")
        self._forget_store()
        assert self.store.stats().num_namespaces == len(self.registered)

    @rule()
    def flood(self) -> None:
        """With nothing leased or reserved, every block can be evicted: fresh blocks of
        twice DRAM's size all get a slot (a chain cycle would pin its blocks forever)."""
        assert self.store is not None
        self.store.expire()  # the store ends what the model's sweep ends, skipped or not
        self._sweep()
        if self._is_pinned():
            event("flood: skipped, something is pinned")
            return
        event("flood: ran")
        ns = NS_A
        for _ in range(2 * DRAM // ns.block_bytes // MAX_BATCH):
            self.num_flooded += 1
            keys = [
                hashlib.blake2b(b"flood%d.%d" % (self.num_flooded, i)).digest()[:32]
                for i in range(MAX_BATCH)
            ]
            res = self.store.reserve(ns.id, keys)
            assert res.statuses == (PutStatus.RESERVED,) * MAX_BATCH
            for i, key in enumerate(keys):
                res.write(i, 0, content(ns.id, key, 0, ns.block_bytes))
            assert res.commit() == MAX_BATCH
        self.store.check_integrity()

    @rule()
    def end_everything(self) -> None:
        """Every holder releases and aborts what it holds, then the rest expires: nothing is
        left open."""
        assert self.store is not None
        for lid, lease in list(self.leases.items()):
            if lease.is_held:
                lease.lease.release()
                self.ended_leases.append(self.leases.pop(lid).lease)
        for rid, res in list(self.reservations.items()):
            if res.is_held:
                res.res.abort()
                self._end(rid)
        self.clock.now += max(RESERVATION_S, LEASE_S)
        self.store.expire()
        self._sweep()
        stats = self.store.stats()
        assert (stats.num_reservations, stats.num_leases) == (0, 0)
        self.store.check_integrity()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        if self.store is not None:
            self.store.check_integrity()

    @invariant()
    def open_handles_are_the_models(self) -> None:
        if self.store is None:
            return
        stats = self.store.stats()
        assert stats.num_reservations == len(self.reservations)
        assert stats.num_leases == len(self.leases)
        assert stats.num_namespaces == len(self.registered)

    @invariant()
    def reservations_are_found_by_id_by_their_owner_only(self) -> None:
        """What the gRPC path relies on: an open reservation's id finds the same object for
        its owner, and is unknown to any other; an ended one's, or one never given, to all."""
        if self.store is None:
            return
        for rid, held in self.reservations.items():
            for owner, caller in enumerate(CALLERS):
                if owner == held.owner:
                    assert self.store.reservation(rid, caller) is held.res, f"{rid}: not found"
                else:
                    assert _is_unknown(self.store, rid, caller), f"{rid}: another owner's"
        for rid, held in self.ended.items():
            assert _is_unknown(self.store, rid, CALLERS[held.owner]), f"{rid}: ended, found"
        assert _is_unknown(self.store, UNKNOWN_ID, CALLERS[0])

    @invariant()
    def leased_views_keep_their_bytes(self) -> None:
        for lid, held in self.leases.items():
            for view, want in zip(held.lease.views, held.expected, strict=True):
                assert (view is None) == (want is None)
                assert view is None or bytes(view) == want, f"lease {lid}: its bytes changed"


def _is_unknown(store: Store, rid: int, caller: Caller) -> bool:
    try:
        store.reservation(rid, caller)
    except errors.UnknownReservationError:
        return True
    return False


StoreMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_store_state_machine = StoreMachine.TestCase
