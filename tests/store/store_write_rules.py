"""The write side of the store's state machine (`test_store_state_machine.py`), on the model
of `store_model.py`: clients reserve (well formed or not, chains that the rules refuse or
accept), put whole chains (through `write`, or in place through `views` and
`commit(written=)` as a transport does, with bytes altered, a block left short, or the
reservation left open), and write, rewind, commit and abort the `Reservation` objects they
hold, reaching each as the object `reserve` returned, found again by id as its owner (as
the gRPC path does between calls), or by id as another owner, to whom it is unknown. A
reservation that ended, an id never given and `NO_RESERVATION` are tried too.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import rule

from kvstore import errors
from kvstore.checksum import checksum
from kvstore.keys import Namespace
from kvstore.results import NO_RESERVATION, PutStatus, ReserveResult
from kvstore.store import Reservation
from tests.store.store_model import (
    CALLERS,
    MAX_BATCH,
    NS_A,
    NS_B,
    RESERVATION_S,
    BlockModel,
    ReservationModel,
    StoreModel,
    content,
    key_damage,
    key_sets,
    namespaces,
    owners,
    parent_damage,
    parent_specs,
    picks,
    vias,
)


class WriteRules(StoreModel):
    """Reserve, put, write, rewind, commit and abort."""

    # -- reserve ---------------------------------------------------------------------------

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
        caller = CALLERS[owner]
        error = self._key_error(ns.id, keys)
        if error is None and parents is not None and len(parents) != len(keys):
            error = errors.InvalidArgumentError
        if error is None and parents is not None and any(p and len(p) != 32 for p in parents):
            error = errors.BadKeyError
        if error is not None:
            return self._expect(error, self.store.reserve, ns.id, keys, parents, caller)
        statuses = self._statuses(ns.id, keys)
        is_new = [s is PutStatus.RESERVED for s in statuses]
        links = parents if parents is not None else [None] * len(keys)
        error = self._chain_error(ns.id, keys, links, is_new)
        if error is not None:
            return self._expect(error, self.store.reserve, ns.id, keys, parents, caller)
        try:
            res = self.store.reserve(ns.id, keys, parents, caller)
        except errors.StoreFullError:
            assert self._is_pinned(), "DRAM full with nothing leased or reserved"
            event("reserve: StoreFullError")
            return None
        assert res.statuses == statuses
        assert res.result == ReserveResult(res.reservation_id, statuses)
        event(f"reserve: ok, {sorted({s.value for s in statuses})}")
        if not any(is_new):
            assert res.reservation_id == NO_RESERVATION
            assert res.commit() == 0
            res.abort()  # a no-op
            return None
        rid = res.reservation_id
        assert rid not in self.reservations and rid not in self.ended, f"id {rid} again"
        assert res.expires_at == self.clock.now + RESERVATION_S
        blocks = {}
        for i in (i for i, new in enumerate(is_new) if new):
            self.version += 1
            blocks[i] = BlockModel(content(ns.id, keys[i], self.version, ns.block_bytes))
        self.reservations[rid] = ReservationModel(
            owner,
            res,
            ns.id,
            tuple(keys),
            tuple(links),
            blocks,
            self.clock.now + RESERVATION_S,
        )
        return rid

    @rule(
        owner=owners,
        ns=st.sampled_from([NS_A, NS_B]),
        indices=key_sets,
        spec=parent_specs,
        order=st.permutations(range(MAX_BATCH)),
        fault=st.sampled_from([None] * 4 + ["altered", "short", "left_open"]),
        in_place=st.booleans(),
        by_id=st.booleans(),
    )
    def put(self, owner, ns, indices, spec, order, fault, in_place, by_id) -> None:
        """A client's whole put of a chain, reserve, write, commit, then a read of it; or
        one whose bytes were altered on the way, that leaves a block short (and aborts),
        or that leaves its reservation open. `in_place`: the bytes land in the views and
        the commit carries their sums (a transport), `by_id`: the writer finds the
        reservation again by id after reserving."""
        assert self.store is not None
        self._sweep()
        keys = self._keys(indices, None)
        rid = self._reserve(owner, ns, keys, self._parents(keys, "chain", spec))
        if rid is None:
            return
        res = self._reach(rid, "by_id" if by_id else "object")
        assert res is not None
        blocks = self.reservations[rid].blocks
        first = min(blocks)
        in_place = in_place and fault != "short"
        if in_place:
            views = res.views()
            assert sorted(views) == sorted(blocks)
            for i in (i for i in order if i in blocks):
                data = bytearray(blocks[i].intended)
                if fault == "altered" and i == first:
                    data[-1] ^= 0x01
                views[i][:] = data  # landed, not yet written: the commit says so
        if fault == "altered" and not in_place:  # one bit flipped: the checksums refuse it
            altered = bytearray(blocks[first].intended)
            altered[-1] ^= 0x01
            res.write(first, 0, bytes(altered))
            blocks[first].written += altered
        if fault == "short":  # the first block stops half way
            half = blocks[first].intended[: ns.block_bytes // 2]
            res.write(first, 0, half)
            blocks[first].written += half
        if not in_place:
            self._write_rest(res, rid, order, skip=first if fault == "short" else None)
        if fault == "left_open":
            return
        self._commit(res, rid, with_checksums=True, in_place=in_place)
        if fault == "short":
            res.abort()
            self._end(rid)
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
        via=vias,
    )
    def write(self, pick: int, block_pick: int, mode: str, size: int, via: str) -> None:
        """One chunk into one block: in order, at a wrong offset, past the end, altered, or
        into a block the reservation does not hold (present, in flight, out of range)."""
        unknown = errors.UnknownReservationError
        reached = self._open_or_ended(
            pick, block_pick, via, lambda gone: self._expect(unknown, gone.write, 0, 0, b"x")
        )
        if reached is None:
            return
        rid, res = reached
        held = self.reservations[rid]
        if mode == "index":
            index = next(i for i in range(-1, MAX_BATCH + 2) if i not in held.blocks)
            self._expect(errors.InvalidArgumentError, res.write, index, 0, b"x")
            return
        indices = sorted(held.blocks)
        index = indices[block_pick % len(indices)]
        block = held.blocks[index]
        offset = len(block.written)
        rest = block.intended[offset:]
        if mode == "wrong_offset":
            bad = offset + 1 + size
            self._expect(errors.InvalidArgumentError, res.write, index, bad, b"x")
            return
        if mode == "past_end":
            data = b"y" * (len(rest) + 1 + size % 8)
            self._expect(errors.PayloadSizeError, res.write, index, offset, data)
            return
        data = rest if mode == "whole" else rest[:size]
        if mode == "corrupt" and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        res.write(index, offset, data)
        block.written += data

    @rule(pick=picks, order=st.permutations(range(MAX_BATCH)), via=vias)
    def write_rest(self, pick: int, order: list[int], via: str) -> None:
        """A well-behaved writer sends what is left of every block, blocks in any order."""
        rid = self._held(self.reservations, pick)
        if rid is not None and (res := self._reach(rid, via)) is not None:
            self._write_rest(res, rid, order)

    def _write_rest(
        self, res: Reservation, rid: int, order: list[int], skip: int | None = None
    ) -> None:
        for index in order:
            block = self.reservations[rid].blocks.get(index)
            if block is not None and index != skip:
                rest = block.intended[len(block.written) :]
                res.write(index, len(block.written), rest)
                block.written += rest

    @rule(pick=picks, index=st.integers(0, MAX_BATCH - 1), offset=st.integers(0, 600), via=vias)
    def rewind(self, pick: int, index: int, offset: int, via: str) -> None:
        reached = self._open_or_ended(pick, index, via, lambda gone: gone.rewind(index, offset))
        if reached is None:  # an ended one: a no-op
            return
        rid, res = reached
        res.rewind(index, offset)
        block = self.reservations[rid].blocks.get(index)
        if block is not None and len(block.written) != len(block.intended):
            del block.written[offset:]

    @rule(pick=picks, with_checksums=st.booleans(), owner=owners, via=vias)
    def commit(self, pick: int, with_checksums: bool, owner: int, via: str) -> None:
        assert self.store is not None
        empty = self.store.reservation(NO_RESERVATION, CALLERS[owner])
        assert (empty.reservation_id, empty.statuses) == (NO_RESERVATION, ())
        assert empty.commit() == 0
        reached = self._open_or_ended(
            pick, owner, via, lambda gone: self._expect(errors.UnknownReservationError, gone.commit)
        )
        if reached is not None:
            self._commit(reached[1], reached[0], with_checksums)

    def _commit(
        self, res: Reservation, rid: int, with_checksums: bool, in_place: bool = False
    ) -> None:
        """Commits `res`; `in_place`: its bytes landed through `views`, and the commit
        carries the sums of what landed."""
        assert self.store is not None
        held = self.reservations[rid]
        sums = None
        if with_checksums:
            sums = [
                checksum(b.intended) if (b := held.blocks.get(i)) else 0
                for i in range(len(held.keys))
            ]
        written = None
        if in_place:
            views = res.views()
            written = {i: checksum(views[i]) for i in held.blocks}
            for i, block in held.blocks.items():  # the commit marks each written whole
                block.written = bytearray(views[i])
        elif any(len(b.written) != len(b.intended) for b in held.blocks.values()):
            self._expect(errors.IncompleteWriteError, res.commit, sums)
            return
        if sums is not None and any(b.written != b.intended for b in held.blocks.values()):
            self._expect(errors.ChecksumMismatchError, res.commit, sums, written)
            self._end(rid)  # aborted
            return
        assert res.commit(sums, written) == len(held.blocks)
        event(f"commit: ok{', in place' if in_place else ''}")
        self._end(rid)
        for i, block in held.blocks.items():
            self.committed[held.ns_id, held.keys[i]] = bytes(block.written)
            self.parent_of[held.ns_id, held.keys[i]] = held.parents[i]
            if self.config.ssd_path == "":  # nothing evicts on commit without an SSD tier
                assert self._is_readable(held.ns_id, held.keys[i]), "committed block not found"

    @rule(pick=picks, owner=owners, via=vias)
    def abort(self, pick: int, owner: int, via: str) -> None:
        assert self.store is not None
        self.store.reservation(NO_RESERVATION, CALLERS[owner]).abort()  # a no-op
        reached = self._open_or_ended(
            pick, owner, via, lambda gone: self._expect(errors.UnknownReservationError, gone.abort)
        )
        if reached is None:
            return
        rid, res = reached
        caller = CALLERS[self.reservations[rid].owner]
        res.abort()
        self._end(rid)
        self._expect(errors.UnknownReservationError, res.abort)
        self._expect(errors.UnknownReservationError, self.store.reservation, rid, caller)
