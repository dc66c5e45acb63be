"""The model behind the store's state machine (`test_store_state_machine.py`): the namespaces,
keys, owners (each a `Caller`) and strategies the rules draw from, the records of what the
store owes (each open `Reservation` and `Lease` object with what it was opened for, by id,
and the reservations that ended, whose ids must stay unknown), and `StoreModel`, the
machine's state with the helpers that predict the store's answers: which error a malformed
call raises, in which order, what a reserve finds in flight, which chain links it refuses,
and that a read returns a key's last committed bytes or nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from kvstore import errors
from kvstore.keys import KVLayout, Namespace
from kvstore.results import PutStatus
from kvstore.store import Lease, Reservation, Store, StoreConfig
from kvstore.store.caller import Caller

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
# Owner i of the model calls the store as CALLERS[i]: what it opens is unknown to the others.
CALLERS = tuple(Caller(owner=f"sm-client-{i}") for i in range(NUM_OWNERS))
UNKNOWN_ID = 1 << 40  # a reservation id the store never gave
ROOT, PREV, SELF = "root", "prev", "self"

owners = st.integers(0, NUM_OWNERS - 1)
picks = st.integers(0, 1 << 16)  # which of the open handles (or blocks) a rule acts on
# How a rule reaches the reservation it acts on: the object it holds, the object found
# again by id as its owner (the gRPC path between calls), or by id as another owner.
vias = st.sampled_from(["object", "object", "by_id", "other_owner"])
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


def content(ns_id: bytes, key: bytes, version: int, nbytes: int) -> bytes:
    """Bytes unique to one put of `key` in `ns_id`."""
    seed = hashlib.blake2b(ns_id + key + version.to_bytes(8, "little")).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


@dataclass
class BlockModel:
    intended: bytes  # what the writer means to store; `checksum` of it goes to commit
    written: bytearray = field(default_factory=bytearray)  # what reached the slot, in order


@dataclass
class ReservationModel:
    owner: int
    res: Reservation  # the object `reserve` returned; `store.reservation` finds it again
    ns_id: bytes
    keys: tuple[bytes, ...]
    parents: tuple[bytes | None, ...]
    blocks: dict[int, BlockModel]  # index in the reserve call -> block
    expires_at: float
    is_held: bool = True  # False once its owner went away without ending it


@dataclass
class LeaseModel:
    owner: int
    ns_id: bytes
    keys: tuple[bytes, ...]
    lease: Lease
    expected: tuple[bytes | None, ...]
    expires_at: float
    is_held: bool = True


class StoreModel(RuleBasedStateMachine):
    """What the store owes, and the helpers that predict its answers; the rules are the
    subclasses'."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.store: Store | None = None
        self.config = StoreConfig()
        self.ssd_dir: str | None = None
        self.registered: set[bytes] = set()
        self.committed: dict[tuple[bytes, bytes], bytes] = {}  # (ns, key) -> last committed
        self.parent_of: dict[tuple[bytes, bytes], bytes | None] = {}  # links of those blocks
        self.reservations: dict[int, ReservationModel] = {}  # open ones, by id
        self.ended: dict[int, ReservationModel] = {}  # committed, aborted or expired, by id
        self.leases: dict[int, LeaseModel] = {}  # open ones, by id
        self.ended_leases: list[Lease] = []  # released or expired
        self.version = 0
        self.num_flooded = 0

    # -- handles ---------------------------------------------------------------------------

    def _sweep(self) -> None:
        """What `Store.expire` ends now (reserve and acquire call it first)."""
        now = self.clock.now
        for rid in [r for r, m in self.reservations.items() if m.expires_at <= now]:
            self._end(rid)
        for lid in [i for i, m in self.leases.items() if m.expires_at <= now]:
            self.ended_leases.append(self.leases.pop(lid).lease)

    def _end(self, rid: int) -> None:
        """Reservation `rid` was committed, aborted or expired: its id is unknown now."""
        self.ended[rid] = self.reservations.pop(rid)

    def _forget_store(self) -> None:
        """The store's process ended: its handles go with it (ids start again at 1)."""
        self.reservations.clear()
        self.ended.clear()
        self.leases.clear()
        self.ended_leases.clear()

    def _held(self, handles: dict, pick: int) -> int | None:
        held = sorted(h for h, m in handles.items() if m.is_held)
        return held[pick % len(held)] if held else None

    def _ended_reservation(self, pick: int) -> Reservation | None:
        """One reservation object that has ended, if any."""
        gone = sorted(self.ended)
        return self.ended[gone[pick % len(gone)]].res if gone else None

    def _reach(self, rid: int, via: str) -> Reservation | None:
        """Open reservation `rid` as a client reaches it (`vias`); None where another owner
        asked for it by id, and was told it is unknown."""
        assert self.store is not None
        held = self.reservations[rid]
        if via == "object":
            return held.res
        if via == "by_id":
            found = self.store.reservation(rid, CALLERS[held.owner])
            assert found is held.res, f"reservation {rid} found by id is another object"
            return found
        other = CALLERS[(held.owner + 1) % NUM_OWNERS]
        self._expect(errors.UnknownReservationError, self.store.reservation, rid, other)
        return None

    def _open_or_ended(
        self, pick: int, owner: int, via: str, on_ended: Callable[[Reservation], object]
    ) -> tuple[int, Reservation] | None:
        """(id, object) of the open reservation `pick` names, reached `via`. With none
        held: `on_ended` checks what an ended one does, or, with none ended either, an id
        the store never gave is unknown; None then, and where `_reach` reached nothing."""
        rid = self._held(self.reservations, pick)
        if rid is None:
            gone = self._ended_reservation(pick)
            if gone is None:
                self._unknown_reservation(owner)
            else:
                on_ended(gone)
            return None
        res = self._reach(rid, via)
        return None if res is None else (rid, res)

    def _unknown_reservation(self, owner: int) -> None:
        """With nothing held: an id the store never gave is unknown."""
        assert self.store is not None
        unknown = errors.UnknownReservationError
        self._expect(unknown, self.store.reservation, UNKNOWN_ID, CALLERS[owner % NUM_OWNERS])

    # -- blocks ----------------------------------------------------------------------------

    def _is_readable(self, ns_id: bytes, key: bytes) -> bool:
        assert self.store is not None
        return self.store.match(ns_id, [key]).num_matched == 1

    def _in_flight(self, ns_id: bytes) -> set[bytes]:
        return {m.keys[i] for m in self.reservations.values() if m.ns_id == ns_id for i in m.blocks}

    def _is_pinned(self) -> bool:
        """Whether anything is leased or reserved, so a reserve may find DRAM full."""
        return bool(self.reservations or self.leases)

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

    # -- calls and their errors ------------------------------------------------------------

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

    # -- chains ----------------------------------------------------------------------------

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
            if new and leads_back(links, key):
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


def leads_back(links: dict[bytes, bytes | None], start: bytes) -> bool:
    """Whether following parents up from `start` comes back to it."""
    seen: set[bytes] = set()
    node = links.get(start)
    while node is not None and node not in seen:
        if node == start:
            return True
        seen.add(node)
        node = links.get(node)
    return False
