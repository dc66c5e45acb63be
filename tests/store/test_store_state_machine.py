"""The in-process store as a state machine: several clients reserve, write, commit, abort,
lease, read, remove and give up, while the clock jumps, DRAM evicts and blocks move to SSD.

A model holds what the store owes: each block's last committed bytes (a block may have been
evicted since, so a read returns exactly them or nothing, never another key's or an older
version's), the reservations and leases still open, and every chain link made. Only what
eviction decides is asked of the store itself (`match`, which changes nothing). After every
step: `check_integrity` passes, the open reservations and leases are the model's, and every
leased view still holds the bytes it was leased with.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import KVLayout, Namespace
from kvstore.results import NO_RESERVATION, PutStatus
from kvstore.store import Lease, Store, StoreConfig
from kvstore.store.eviction import POLICIES

NS_A = Namespace("sm-a", KVLayout("float16", 2, 1, 8, 4))  # 256-byte blocks
NS_B = Namespace("sm-b", KVLayout("float16", 2, 1, 8, 8))  # 512-byte blocks
NS_C = Namespace("sm-c", KVLayout("float16", 2, 1, 8, 4))  # registered only by a rule
NAMESPACES = (NS_A, NS_B, NS_C)
SLAB = 1024
DRAM = 4 * SLAB  # 16 blocks of A or 8 of B: the 2 x 8 pool keys do not all fit
MAX_BATCH = 6
RESERVATION_S, LEASE_S = 10.0, 20.0
# The same eight keys in every namespace: a key of one namespace is unknown in the others.
KEYS = tuple(hashlib.blake2b(bytes([i]), digest_size=32).digest() for i in range(8))
NUM_OWNERS = 3
ROOT, PREV, SELF = "root", "prev", "self"

owners = st.integers(0, NUM_OWNERS - 1)
picks = st.integers(0, 1 << 16)  # which of the open handles (or blocks) a rule acts on
namespaces = st.sampled_from([NS_A, NS_B] * 3 + [NS_C])  # C: unknown until registered
key_sets = st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=MAX_BATCH, unique=True)
# None: well formed (most of the time); else how the call is malformed.
key_damage = st.sampled_from([None] * 12 + ["empty", "too_many", "dup", "short_key"])
parent_damage = st.sampled_from([None] * 12 + ["parents_len", "short_parent"])
parent_specs = st.lists(
    st.sampled_from([PREV] * 10 + [ROOT] * 4 + [SELF, *range(len(KEYS))]),
    min_size=MAX_BATCH + 1,
    max_size=MAX_BATCH + 1,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _content(ns_id: bytes, key: bytes, version: int, nbytes: int) -> bytes:
    """Bytes unique to one put of `key` in `ns_id`."""
    seed = hashlib.blake2b(ns_id + key + version.to_bytes(8, "little")).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


@dataclass
class _Block:
    intended: bytes  # what the writer means to store; `checksum` of it goes to commit
    written: bytearray = field(default_factory=bytearray)  # what reached the slot, in order


@dataclass
class _Reservation:
    owner: int
    ns_id: bytes
    keys: tuple[bytes, ...]
    parents: tuple[bytes | None, ...]
    blocks: dict[int, _Block]  # index in the reserve call -> block
    expires_at: float
    is_held: bool = True  # False once its owner went away without ending it


@dataclass
class _Lease:
    owner: int
    ns_id: bytes
    keys: tuple[bytes, ...]
    lease: Lease
    expected: tuple[bytes | None, ...]
    expires_at: float
    is_held: bool = True


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.store: Store | None = None
        self.ssd_dir: str | None = None
        self.registered: set[bytes] = set()
        self.committed: dict[tuple[bytes, bytes], bytes] = {}  # (ns, key) -> last committed
        self.parent_of: dict[tuple[bytes, bytes], bytes | None] = {}  # links of those blocks
        self.reservations: dict[int, _Reservation] = {}
        self.leases: dict[int, _Lease] = {}
        self.version = 0
        self.num_flooded = 0

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

    # -- model helpers ---------------------------------------------------------------------

    def _sweep(self) -> None:
        """What `Store.expire` ends now (reserve and acquire call it first)."""
        now = self.clock.now
        self.reservations = {r: m for r, m in self.reservations.items() if m.expires_at > now}
        self.leases = {i: m for i, m in self.leases.items() if m.expires_at > now}

    def _is_readable(self, ns_id: bytes, key: bytes) -> bool:
        assert self.store is not None
        return self.store.match(ns_id, [key]).num_matched == 1

    def _in_flight(self, ns_id: bytes) -> set[bytes]:
        return {m.keys[i] for m in self.reservations.values() if m.ns_id == ns_id for i in m.blocks}

    def _is_pinned(self) -> bool:
        """Whether anything is leased or reserved, so a reserve may find DRAM full."""
        return bool(self.reservations or self.leases)

    def _held(self, handles: dict, pick: int) -> int | None:
        held = sorted(h for h, m in handles.items() if m.is_held)
        return held[pick % len(held)] if held else None

    def _keys(self, indices: list[int], damage: str | None) -> list[bytes]:
        keys = [KEYS[i] for i in indices]
        if damage == "empty":
            return []
        if damage == "too_many":
            return list(KEYS[: MAX_BATCH + 1])
        if damage == "dup":
            return [*keys, keys[0]]
        if damage == "short_key":
            return [*keys[:-1], keys[-1][:31]]
        return keys

    def _key_error(self, ns_id: bytes, keys: list[bytes]) -> type[errors.KVStoreError] | None:
        """The error `Store._check_keys` must raise, in its order."""
        if ns_id not in self.registered:
            return errors.UnknownNamespaceError
        if not keys:
            return errors.EmptyRequestError
        if len(keys) > MAX_BATCH:
            return errors.BatchTooLargeError
        if any(len(k) != 32 for k in keys):
            return errors.BadKeyError
        if len(set(keys)) != len(keys):
            return errors.DuplicateKeyError
        return None

    def _expect(self, error: type[errors.KVStoreError] | None, call, *args):
        """Runs `call(*args)`: it raises exactly `error`, or, with None, returns."""
        event(f"{call.__name__}: {error.__name__ if error else 'ok'}")
        if error is None:
            return call(*args)
        try:
            call(*args)
        except errors.KVStoreError as exc:
            assert type(exc) is error, f"{call.__name__}{args!r}: {exc!r}, expected {error}"
            return None
        raise AssertionError(f"{call.__name__} did not raise {error.__name__}")

    # -- namespaces ------------------------------------------------------------------------

    @rule(ns=namespaces)
    def register(self, ns: Namespace) -> None:
        assert self.store is not None
        info = self.store.register_namespace(ns)
        assert info == (ns.id, ns.block_bytes)
        self.registered.add(ns.id)

    # -- reserve ---------------------------------------------------------------------------

    def _parents(self, keys: list[bytes], mode: str, specs: list) -> list[bytes | None] | None:
        if mode == "none":
            return None

        def resolve(i: int, spec: object) -> bytes | None:
            if spec == ROOT:
                return None
            if spec == PREV:
                return keys[i - 1] if i else None
            if spec == SELF:
                return keys[i] if keys else None
            return KEYS[spec]

        if mode == "chain":
            return [resolve(0, specs[0]), *keys[:-1]][: len(keys)]
        return [resolve(i, s) for i, s in enumerate(specs[: len(keys)])]

    def _chain_error(
        self, ns_id: bytes, keys: list[bytes], parents: list[bytes | None], is_new: list[bool]
    ) -> type[errors.KVStoreError] | None:
        """The README's chain rules, on the model's links (`kvstore.store.chains` is not used)."""
        earlier: set[bytes] = set()
        for key, parent in zip(keys, parents, strict=True):
            if parent == key:
                return errors.ChainCycleError
            if (
                parent is not None
                and parent not in earlier
                and not self._is_readable(ns_id, parent)
            ):
                return errors.UnknownParentError
            earlier.add(key)
        links = self._links(ns_id)
        links.update((k, p) for k, p, new in zip(keys, parents, is_new, strict=True) if new)
        for key, new in zip(keys, is_new, strict=True):
            if new and _leads_back(links, key):
                return errors.ChainCycleError
        return None

    def _links(self, ns_id: bytes) -> dict[bytes, bytes | None]:
        """key -> parent of every block of `ns_id` the store holds, committed or reserved."""
        links = {
            key: parent
            for (ns, key), parent in self.parent_of.items()
            if ns == ns_id and self._is_readable(ns, key)
        }
        for res in self.reservations.values():
            if res.ns_id == ns_id:
                links.update((res.keys[i], res.parents[i]) for i in res.blocks)
        return links

    def _statuses(self, ns_id: bytes, keys: list[bytes]) -> tuple[PutStatus, ...]:
        in_flight = self._in_flight(ns_id)
        return tuple(
            PutStatus.IN_FLIGHT
            if k in in_flight
            else PutStatus.PRESENT
            if self._is_readable(ns_id, k)
            else PutStatus.RESERVED
            for k in keys
        )

    @rule(
        owner=owners,
        ns=namespaces,
        indices=key_sets,
        damage=key_damage,
        mode=st.sampled_from(["chain", "chain", "none", "specs"]),
        specs=parent_specs,
        parent_damage=parent_damage,
    )
    def reserve(self, owner, ns, indices, damage, mode, specs, parent_damage) -> None:
        assert self.store is not None
        self._sweep()
        keys = self._keys(indices, damage)
        parents = self._parents(keys, mode, specs)
        if parent_damage == "parents_len" and parents is not None:
            parents = [*parents, None]
        elif parent_damage == "short_parent" and parents is not None and keys:
            parents = [b"p" * 31, *parents[1:]]
        self._reserve(owner, ns, keys, parents)

    def _reserve(
        self, owner: int, ns: Namespace, keys: list[bytes], parents: list[bytes | None] | None
    ) -> int | None:
        """`Store.reserve` checked against the model; the new reservation's id, if any."""
        assert self.store is not None
        error = self._key_error(ns.id, keys)
        if error is None and parents is not None and len(parents) != len(keys):
            error = errors.InvalidArgumentError
        if error is None and parents is not None and any(p and len(p) != 32 for p in parents):
            error = errors.BadKeyError
        if error is not None:
            return self._expect(error, self.store.reserve, ns.id, keys, parents)
        statuses = self._statuses(ns.id, keys)
        is_new = [s is PutStatus.RESERVED for s in statuses]
        links = parents if parents is not None else [None] * len(keys)
        error = self._chain_error(ns.id, keys, links, is_new)
        if error is not None:
            return self._expect(error, self.store.reserve, ns.id, keys, parents)
        try:
            result = self.store.reserve(ns.id, keys, parents)
        except errors.StoreFullError:
            assert self._is_pinned(), "DRAM full with nothing leased or reserved"
            event("reserve: StoreFullError")
            return None
        assert result.statuses == statuses
        event(f"reserve: ok, {sorted({s.value for s in statuses})}")
        if not any(is_new):
            assert result.reservation_id == NO_RESERVATION
            return None
        assert result.reservation_id not in self.reservations
        blocks = {}
        for i in (i for i, new in enumerate(is_new) if new):
            self.version += 1
            blocks[i] = _Block(_content(ns.id, keys[i], self.version, ns.block_bytes))
        self.reservations[result.reservation_id] = _Reservation(
            owner,
            ns.id,
            tuple(keys),
            tuple(links),
            blocks,
            self.clock.now + RESERVATION_S,
        )
        return result.reservation_id

    @rule(
        owner=owners,
        ns=st.sampled_from([NS_A, NS_B]),
        indices=key_sets,
        spec=parent_specs,
        order=st.permutations(range(MAX_BATCH)),
        fault=st.sampled_from([None] * 4 + ["altered", "short", "left_open"]),
    )
    def put(self, owner, ns, indices, spec, order, fault) -> None:
        """A client's whole put of a chain, reserve, write, commit, then a read of it; or
        one whose bytes were altered on the way, that leaves a block short (and aborts),
        or that leaves its reservation open."""
        assert self.store is not None
        self._sweep()
        keys = self._keys(indices, None)
        rid = self._reserve(owner, ns, keys, self._parents(keys, "chain", spec))
        if rid is None:
            return
        blocks = self.reservations[rid].blocks
        first = min(blocks)
        if fault == "altered":  # one bit flipped on the way: the commit's checksums refuse it
            data = bytearray(blocks[first].intended)
            data[-1] ^= 0x01
            self.store.write(rid, first, 0, data)
            blocks[first].written += data
        if fault == "short":  # the first block stops half way
            data = blocks[first].intended[: ns.block_bytes // 2]
            self.store.write(rid, first, 0, data)
            blocks[first].written += data
        self._write_rest(rid, order, skip=first if fault == "short" else None)
        if fault == "left_open":
            return
        self._commit(rid, with_checksums=True)
        if fault == "short":
            self.store.abort(rid)
            del self.reservations[rid]
            return
        found = self._check_found(ns.id, keys, self.store.read(ns.id, keys))
        if not self.config.ssd_path and fault is None:  # nothing evicts on commit or read
            assert all(found[i] is not None for i in blocks), "a block just put is missing"

    # -- write, rewind, commit, abort ------------------------------------------------------

    @rule(
        pick=picks,
        block_pick=picks,
        mode=st.sampled_from(
            ["whole", "chunk", "whole", "chunk", "corrupt", "wrong_offset", "past_end", "index"]
        ),
        size=st.integers(0, 600),
    )
    def write(self, pick: int, block_pick: int, mode: str, size: int) -> None:
        """One chunk into one block: in order, at a wrong offset, past the end, altered, or
        into a block the reservation does not hold (present, in flight, out of range)."""
        assert self.store is not None
        rid = self._held(self.reservations, pick)
        if rid is None:
            self._expect(errors.UnknownReservationError, self.store.write, 1 << 40, 0, 0, b"x")
            return
        res = self.reservations[rid]
        if mode == "index":
            index = next(i for i in range(-1, MAX_BATCH + 2) if i not in res.blocks)
            self._expect(errors.InvalidArgumentError, self.store.write, rid, index, 0, b"x")
            return
        indices = sorted(res.blocks)
        index = indices[block_pick % len(indices)]
        block = res.blocks[index]
        offset = len(block.written)
        rest = block.intended[offset:]
        if mode == "wrong_offset":
            bad = offset + 1 + size
            self._expect(errors.InvalidArgumentError, self.store.write, rid, index, bad, b"x")
            return
        if mode == "past_end":
            data = b"y" * (len(rest) + 1 + size % 8)
            self._expect(errors.PayloadSizeError, self.store.write, rid, index, offset, data)
            return
        data = rest if mode == "whole" else rest[:size]
        if mode == "corrupt" and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        self.store.write(rid, index, offset, data)
        block.written += data

    @rule(pick=picks, order=st.permutations(range(MAX_BATCH)))
    def write_rest(self, pick: int, order: list[int]) -> None:
        """A well-behaved writer sends what is left of every block, blocks in any order."""
        rid = self._held(self.reservations, pick)
        if rid is not None:
            self._write_rest(rid, order)

    def _write_rest(self, rid: int, order: list[int], skip: int | None = None) -> None:
        assert self.store is not None
        for index in order:
            block = self.reservations[rid].blocks.get(index)
            if block is not None and index != skip:
                rest = block.intended[len(block.written) :]
                self.store.write(rid, index, len(block.written), rest)
                block.written += rest

    @rule(pick=picks, index=st.integers(0, MAX_BATCH - 1), offset=st.integers(0, 600))
    def rewind(self, pick: int, index: int, offset: int) -> None:
        assert self.store is not None
        rid = self._held(self.reservations, pick)
        if rid is None:
            self.store.rewind(1 << 40, index, offset)  # a no-op
            return
        self.store.rewind(rid, index, offset)
        block = self.reservations[rid].blocks.get(index)
        if block is not None and len(block.written) != len(block.intended):
            del block.written[offset:]

    @rule(pick=picks, with_checksums=st.booleans())
    def commit(self, pick: int, with_checksums: bool) -> None:
        assert self.store is not None
        assert self.store.commit(NO_RESERVATION) == 0
        rid = self._held(self.reservations, pick)
        if rid is None:
            self._expect(errors.UnknownReservationError, self.store.commit, 1 << 40)
            return
        self._commit(rid, with_checksums)

    def _commit(self, rid: int, with_checksums: bool) -> None:
        assert self.store is not None
        res = self.reservations[rid]
        sums = None
        if with_checksums:
            sums = [
                checksum(b.intended) if (b := res.blocks.get(i)) else 0
                for i in range(len(res.keys))
            ]
        if any(len(b.written) != len(b.intended) for b in res.blocks.values()):
            self._expect(errors.IncompleteWriteError, self.store.commit, rid, sums)
            return
        if sums is not None and any(b.written != b.intended for b in res.blocks.values()):
            self._expect(errors.ChecksumMismatchError, self.store.commit, rid, sums)
            del self.reservations[rid]  # aborted
            return
        assert self.store.commit(rid, sums) == len(res.blocks)
        event("commit: ok")
        del self.reservations[rid]
        for i, block in res.blocks.items():
            self.committed[res.ns_id, res.keys[i]] = bytes(block.written)
            self.parent_of[res.ns_id, res.keys[i]] = res.parents[i]
            if self.config.ssd_path == "":  # nothing evicts on commit without an SSD tier
                assert self._is_readable(res.ns_id, res.keys[i]), "committed block not found"

    @rule(pick=picks)
    def abort(self, pick: int) -> None:
        assert self.store is not None
        self.store.abort(NO_RESERVATION)
        rid = self._held(self.reservations, pick)
        if rid is None:
            self._expect(errors.UnknownReservationError, self.store.abort, 1 << 40)
            return
        self.store.abort(rid)
        del self.reservations[rid]
        self._expect(errors.UnknownReservationError, self.store.abort, rid)

    # -- reads -----------------------------------------------------------------------------

    def _check_found(self, ns_id: bytes, keys: list[bytes], blocks) -> tuple[bytes | None, ...]:
        """Each block is None or exactly its key's last committed bytes; returns those."""
        expected = []
        for key, block in zip(keys, blocks, strict=True):
            want = self.committed.get((ns_id, key))
            if block is not None:
                assert want is not None, f"read {key.hex()[:8]}, never committed or removed"
                assert bytes(block) == want, f"{key.hex()[:8]}: not its last committed bytes"
            expected.append(None if block is None else want)
        return tuple(expected)

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
            self._expect(error, self.store.acquire, ns.id, keys)
            return
        lease = self.store.acquire(ns.id, keys)
        expected = self._check_found(ns.id, keys, lease.views)
        event(f"acquire: ok, {'some' if any(lease.found) else 'none'} found")
        sums = tuple(0 if b is None else checksum(b) for b in expected)
        assert lease.checksums == sums, "a lease's checksums are not its blocks'"
        assert lease.lease_id not in self.leases
        self.leases[lease.lease_id] = _Lease(
            owner, ns.id, tuple(keys), lease, expected, lease.expires_at
        )
        assert lease.expires_at == self.clock.now + LEASE_S

    @rule(pick=picks)
    def release(self, pick: int) -> None:
        assert self.store is not None
        lid = self._held(self.leases, pick)
        if lid is None:
            self.store.release(1 << 40)  # a no-op
            return
        self.store.release(lid)
        del self.leases[lid]
        self.store.release(lid)  # twice: a no-op

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
        self.reservations.clear()
        self.leases.clear()
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
                self.store.write(res.reservation_id, i, 0, _content(ns.id, key, 0, ns.block_bytes))
            self.store.commit(res.reservation_id)
        self.store.check_integrity()

    @rule()
    def end_everything(self) -> None:
        """Every holder releases and aborts what it holds, then the rest expires: nothing is
        left open."""
        assert self.store is not None
        for lid, lease in list(self.leases.items()):
            if lease.is_held:
                self.store.release(lid)
                del self.leases[lid]
        for rid, res in list(self.reservations.items()):
            if res.is_held:
                self.store.abort(rid)
                del self.reservations[rid]
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
    def leased_views_keep_their_bytes(self) -> None:
        for lid, held in self.leases.items():
            for view, want in zip(held.lease.views, held.expected, strict=True):
                assert (view is None) == (want is None)
                assert view is None or bytes(view) == want, f"lease {lid}: its bytes changed"


def _leads_back(links: dict[bytes, bytes | None], start: bytes) -> bool:
    """Whether following parents up from `start` comes back to it."""
    seen: set[bytes] = set()
    node = links.get(start)
    while node is not None and node not in seen:
        if node == start:
            return True
        seen.add(node)
        node = links.get(node)
    return False


StoreMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_store_state_machine = StoreMachine.TestCase
