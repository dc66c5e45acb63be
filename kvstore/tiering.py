"""Where blocks live: DRAM slots, SSD records, and the moves between them.

Invariants (checked by `Store.check_integrity`):
- the DRAM policy tracks exactly the committed entries with a DRAM slot;
- the SSD policy tracks exactly the committed entries with `on_ssd`;
- an entry with neither is not in the index.

SSD is inclusive: a promoted block keeps its SSD record, so evicting a clean block from
DRAM is free, and only blocks that were never written out cost an SSD write. DRAM over
its high watermark is cleaned down to its low watermark by writing victims to SSD in one
transaction (by a background thread, or inline when `background_demotion` is off).

Each tier has its own policy instance. A block's reads follow it down: a block demoted after
a hit in DRAM is recorded as reused by the SSD policy too, so a policy that protects reused
blocks (prefix-2q) keeps protecting it there; so does what the DRAM policy knew of it (its
`hint`, for prefix-2q an unread block's prompt class).

With an HBM tier (`kvstore.hbm_cache`), blocks read by device readers also get a device copy,
inclusive of DRAM: a block leaving DRAM leaves HBM with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import lmdb

from kvstore import chains, errors
from kvstore.checksum import checksum
from kvstore.hbm_cache import HbmCache
from kvstore.index import BlockIndex, BlockState, Entry, block_id, split_block_id
from kvstore.keys import KEY_BYTES
from kvstore.policy import BlockHint, make_policy
from kvstore.results import TierUsage
from tiers.base import Record, RecordHeader, Slot
from tiers.dram import DramTier
from tiers.hbm import HbmTier
from tiers.ssd import SsdTier

if TYPE_CHECKING:
    from kvstore.store_config import StoreConfig

log = logging.getLogger("kvstore.tiering")
_BACKOFF_MIN_S = 0.1  # the demoter's first wait after a failed or fruitless pass
_BACKOFF_MAX_S = 5.0  # doubling up to this while passes keep failing


@dataclass
class TierCounters:
    hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass
class TieringCounters:
    evictions: int = 0  # blocks that left DRAM to make room (demoted or dropped)
    drops: int = 0  # blocks that left the store to make room
    demotions: int = 0
    promotions: int = 0
    checksum_failures: int = 0
    ssd_write_failures: int = 0  # SSD transactions that failed (and changed nothing)
    tiers: dict[str, TierCounters] = field(
        default_factory=lambda: {
            "hbm": TierCounters(),
            "dram": TierCounters(),
            "ssd": TierCounters(),
        }
    )


class _Batch(NamedTuple):
    """One SSD transaction: `records` to put, and the SSD copies given up to make room for
    them, whose records it deletes."""

    records: list[Record]
    copies: list[Entry]  # of blocks still in DRAM, pinned until the write ends
    dropped: list[Entry]  # of blocks only on SSD, dropped from the index

    @property
    def delete(self) -> list[bytes]:
        return [e.block_id for e in self.copies + self.dropped]


class Tiering:
    """Moves blocks between tiers; every method runs under the store's lock `lock`."""

    def __init__(self, config: StoreConfig, index: BlockIndex, lock: threading.RLock) -> None:
        self.config = config
        self.index = index
        self.lock = lock
        self.dram = DramTier(config.dram_bytes, config.slab_bytes)
        self.ssd = (
            SsdTier(config.ssd_path, config.ssd_bytes, config.ssd_sync) if config.ssd_path else None
        )
        self.dram_policy = make_policy(config.policy)
        self.ssd_policy = make_policy(config.ssd_policy)
        self.counters = TieringCounters()
        self.hbm = (
            HbmCache(
                HbmTier(config.hbm_bytes, config.slab_bytes, config.hbm_device),
                make_policy(config.policy),
                self.counters.tiers["hbm"],
            )
            if config.hbm_bytes
            else None
        )
        self._redundant: dict[bytes, Entry] = {}  # on SSD and in DRAM, oldest first
        self._seq = 0
        self._wake = threading.Condition(lock)
        self._closing = False
        self._demoter: threading.Thread | None = None
        if self.ssd is not None and config.background_demotion:
            self._demoter = threading.Thread(target=self._demote_forever, daemon=True)
            self._demoter.start()

    # -- DRAM space ----------------------------------------------------------------------

    def allocate(self, nbytes: int, count: int) -> list[Slot]:
        """`count` DRAM slots, evicting as needed; all or nothing (StoreFullError)."""
        slots: list[Slot] = []
        try:
            for _ in range(count):
                slot = self.dram.allocate(nbytes)
                while slot is None:
                    self._evict_one(nbytes)
                    slot = self.dram.allocate(nbytes)
                slots.append(slot)
        except errors.StoreFullError:
            for slot in slots:
                self.dram.free(slot)
            raise
        return slots

    def _evict_one(self, nbytes: int) -> None:
        victim = self._dram_victim(nbytes)
        if victim is None:
            raise errors.StoreFullError(
                f"no evictable block for {nbytes} bytes: DRAM is leased or reserved"
            )
        is_worth_writing = self.ssd is not None and self.dram_policy.should_demote(victim.block_id)
        if not victim.on_ssd and is_worth_writing:
            self._write_out([victim], {victim.block_id: self.dram_policy.hint(victim.block_id)})
        self._evict_now(victim)  # dropped if its write failed: DRAM blocks are a cache

    def _dram_victim(self, nbytes: int | None) -> Entry | None:
        """The policy's best evictable block, preferring one of the slot size of `nbytes`."""
        size_class = None if nbytes is None else self.dram.size_class(nbytes)
        fallback = None
        for key in self.dram_policy.candidates():
            entry = self.index.get(key)
            assert entry is not None and entry.slot is not None, "DRAM policy is stale"
            if not entry.is_evictable:
                continue
            if size_class in (None, self.dram.size_class(entry.nbytes)):
                return entry
            if self.dram.has_free_slab():
                return entry
            fallback = fallback or entry
        return fallback

    def _free_dram(self, entry: Entry) -> None:
        assert entry.slot is not None
        if self.hbm is not None:
            self.hbm.forget(entry)
        self._redundant.pop(entry.block_id, None)
        self.dram_policy.remove(entry.block_id)
        if entry.num_leases == 0:
            self.dram.free(entry.slot)
        else:
            entry.stale_slot = entry.slot
        entry.slot = None

    # -- entries -------------------------------------------------------------------------

    def on_commit(self, entries: Sequence[Entry]) -> None:
        """Starts tracking newly committed DRAM blocks; cleans DRAM if it is too full."""
        for entry in entries:
            self._seq += 1
            entry.seq = self._seq
            self.dram_policy.insert(entry.block_id, entry.parent_id)
            self.counters.tiers["dram"].bytes_written += entry.nbytes
        if self.ssd is not None and self._is_dram_over(self.config.dram_high_watermark):
            if self._demoter is None:
                self.demote_pass()
            else:
                self._wake.notify()

    def touch(self, entries: Sequence[Entry]) -> None:
        """Records hits, in chain order, with each tier's policy."""
        for entry in entries:
            entry.num_hits += 1
        self.dram_policy.touch([e.block_id for e in entries if e.slot is not None])
        self.ssd_policy.touch([e.block_id for e in entries if e.on_ssd])
        if self.hbm is not None:
            self.hbm.touch(entries)

    def load(self, entry: Entry, device: bool = False) -> Any | None:
        """A view of a committed block: its device copy when `device` asks for one and it
        has one, else a DRAM view, promoting it from SSD if needed.

        Returns None, after dropping the block, when its bytes fail their checksum.
        """
        if device and self.hbm is not None and (view := self.hbm.view(entry)) is not None:
            return view
        counters = self.counters.tiers["dram" if entry.slot is not None else "ssd"]
        view = self._dram_view(entry) if entry.slot is not None else self._promote(entry)
        if view is None:
            return None
        counters.hits += 1
        counters.bytes_read += entry.nbytes
        return view

    def _dram_view(self, entry: Entry) -> memoryview | None:
        assert entry.slot is not None
        view = self.dram.view(entry.slot)
        if self.config.verify_reads and checksum(view) != entry.checksum:
            self._corrupted(entry)
            return None
        return view

    def _promote(self, entry: Entry) -> memoryview | None:
        assert self.ssd is not None and entry.on_ssd
        entry.num_leases += 1  # pinned: allocating below must not evict it from SSD
        try:
            slot = self.allocate(entry.nbytes, 1)[0]
        except errors.StoreFullError:
            slot = None  # DRAM is all leased: serve from a private buffer, no promotion
        finally:
            entry.num_leases -= 1
        view = self.dram.view(slot) if slot is not None else memoryview(bytearray(entry.nbytes))
        header = self.ssd.read_into(entry.block_id, view)
        if header is None or checksum(view) != entry.checksum:
            if slot is not None:
                self.dram.free(slot)
            self._corrupted(entry)
            return None
        if slot is not None:
            entry.slot = slot
            self._redundant[entry.block_id] = entry
            self.dram_policy.insert(entry.block_id, entry.parent_id, moved=True)
            self.counters.promotions += 1
            self.counters.tiers["dram"].bytes_written += entry.nbytes
        return view

    def _corrupted(self, entry: Entry) -> None:
        log.warning("event=checksum_failure key=%s tier=%s", entry.key.hex()[:16], entry.tier)
        self.counters.checksum_failures += 1
        self.drop(entry)

    def drop(self, entry: Entry) -> None:
        """Removes a committed entry from every tier; a leased DRAM slot is freed later."""
        self.index.pop(entry.block_id)
        if entry.slot is not None:
            self._free_dram(entry)
        if entry.on_ssd:
            assert self.ssd is not None
            self.ssd_policy.remove(entry.block_id)
            self.ssd.write([], delete=[entry.block_id])
            entry.on_ssd = False

    def end_lease(self, entry: Entry) -> None:
        entry.num_leases -= 1
        if entry.num_leases == 0 and entry.stale_slot is not None:
            self.dram.free(entry.stale_slot)
            entry.stale_slot = None
        if self.hbm is not None:
            self.hbm.end_lease(entry)

    def copy_up(self, entries: Sequence[Entry], views: Sequence[Any]) -> None:
        """Gives the blocks just read from DRAM by a device reader a device copy in HBM."""
        if self.hbm is None:
            return
        from_dram = [
            (e, v)
            for e, v in zip(entries, views, strict=True)
            if isinstance(v, memoryview) and e.slot is not None  # not a private SSD read
        ]
        self.hbm.admit([e for e, _ in from_dram], [v for _, v in from_dram])

    # -- demotion ------------------------------------------------------------------------

    def _is_dram_over(self, fraction: float) -> bool:
        return self.dram.stats().used_bytes > fraction * self.dram.capacity_bytes

    def demote_pass(self) -> int:
        """Frees DRAM down to its low watermark: clean victims at once, dirty ones after an
        SSD write (one transaction, run without the store's lock; the victims are pinned and
        out of the DRAM policy meanwhile). If the write fails, SSD is as it was and the
        victims are dropped (DRAM blocks are a cache), but for those read meanwhile, which
        stay in DRAM. Returns how many blocks left DRAM."""
        with self.lock:
            to_write, hints, num_freed = self._select_demotions()
            batch = self._prepare_write(to_write)
        is_written = self._try_write(batch)
        with self.lock:
            self._end_write(batch, is_written)
            for entry in to_write:
                entry.is_demoting = False
                self.end_lease(entry)
            kept = [e for e in to_write if self.index.get(e.block_id) is e]
            if not is_written:
                return num_freed + self._drop_unwritten(kept)
            self._finish_write(kept, hints)
            for entry in kept:
                self.dram_policy.insert(entry.block_id, entry.parent_id, moved=True)
                if entry.is_evictable:
                    self._free_dram(entry)
            self.counters.evictions += len(kept)
            self._delete_stale([e for e in to_write if self.index.get(e.block_id) is not e])
            return num_freed + len(kept)

    def _drop_unwritten(self, entries: list[Entry]) -> int:
        """Drops victims whose SSD write failed; one read meanwhile goes back to the DRAM
        policy instead. Returns how many were dropped."""
        num_dropped = 0
        for entry in entries:
            if entry.is_evictable:
                self._evict_now(entry)
                num_dropped += 1
            else:
                self.dram_policy.insert(entry.block_id, entry.parent_id, moved=True)
        return num_dropped

    def _is_on_ssd(self, key: bytes) -> bool:
        entry = self.index.get(key)
        return entry is not None and entry.on_ssd

    def _select_demotions(self) -> tuple[list[Entry], dict[bytes, BlockHint | None], int]:
        """Dirty victims to write out (pinned), after freeing clean ones and dropping those
        the policy will not demote; returns them, the DRAM policy's hints for them, and how
        many blocks were freed."""
        low = self.config.dram_low_watermark * self.dram.capacity_bytes
        excess = self.dram.stats().used_bytes - low
        to_write: list[Entry] = []
        hints: dict[bytes, BlockHint | None] = {}
        num_freed = 0
        while excess > 0 and (victim := self._dram_victim(None)) is not None:
            excess -= victim.nbytes
            if victim.on_ssd or not self.dram_policy.should_demote(victim.block_id):
                self._evict_now(victim)
                num_freed += 1
                continue
            hints[victim.block_id] = self.dram_policy.hint(victim.block_id)
            self.dram_policy.remove(victim.block_id)
            victim.is_demoting = True
            victim.num_leases += 1
            to_write.append(victim)
        return to_write, hints, num_freed

    def _evict_now(self, victim: Entry) -> None:
        """Evicts a victim that needs no SSD write: it is clean, or not worth keeping."""
        self.counters.evictions += 1
        if victim.on_ssd:
            self._free_dram(victim)
        else:
            self.counters.drops += 1
            self.drop(victim)

    def _write_out(self, entries: list[Entry], hints: Mapping[bytes, BlockHint | None]) -> None:
        """Writes `entries` to SSD now, under the lock (the eviction path's fallback). If
        that fails they stay off SSD, and memory still describes the disk."""
        batch = self._prepare_write(entries)
        is_written = self._try_write(batch)
        self._end_write(batch, is_written)
        if is_written:
            self._finish_write(entries, hints)

    def _prepare_write(self, entries: list[Entry]) -> _Batch:
        """The transaction that writes `entries`, with the deletes that make room for them."""
        if not entries:
            return _Batch([], [], [])
        copies, dropped = self._make_ssd_room(sum(e.nbytes for e in entries))
        records = []
        for e in entries:
            assert e.slot is not None
            header = RecordHeader(e.namespace_id, e.parent, e.checksum, e.nbytes, e.seq)
            records.append(Record(e.block_id, header, self.dram.view(e.slot)))
        return _Batch(records, copies, dropped)

    def _try_write(self, batch: _Batch) -> bool:
        """Runs `batch`, with or without the store's lock held; False if it failed, which
        leaves SSD as it was."""
        if not batch.records:
            return True
        assert self.ssd is not None
        try:
            self.ssd.write(batch.records, batch.delete)
        except lmdb.Error as exc:
            with self.lock:
                self._record_write_failure(exc, len(batch.records))
            return False
        return True

    def _end_write(self, batch: _Batch, is_written: bool) -> None:
        """Unpins the copies given up for `batch`. If it failed, their records are still
        there: the blocks come back on SSD, and the records of those removed or put again
        meanwhile are deleted."""
        for entry in batch.copies:
            self.end_lease(entry)
        if is_written:
            return
        copies = [e for e in batch.copies if self.index.get(e.block_id) is e]
        dropped = [e for e in batch.dropped if self._can_take_back(e)]
        self._take_back(copies + dropped)
        self.counters.drops -= len(dropped)
        back = {id(e) for e in copies + dropped}
        self._delete_stale([e for e in batch.copies + batch.dropped if id(e) not in back])

    def _delete_stale(self, entries: list[Entry]) -> None:
        """Deletes the records of `entries`, blocks removed (or put again) while a write
        held them, unless their id is on SSD now. If that fails too, those whose id is free
        come back as SSD blocks, so memory describes the disk; the record of an id put again
        meanwhile stays unaccounted."""
        stale = [e for e in entries if not self._is_on_ssd(e.block_id)]
        if not stale:
            return
        assert self.ssd is not None
        try:
            self.ssd.write([], delete=[e.block_id for e in stale])
        except lmdb.Error as exc:
            self._record_write_failure(exc, len(stale))
            self._take_back([e for e in stale if self._can_take_back(e)])

    def _can_take_back(self, entry: Entry) -> bool:
        if entry.block_id in self.index:
            return False
        return entry.parent_id is None or not self._closes_cycle(entry.block_id, entry.parent_id)

    def _take_back(self, entries: list[Entry]) -> None:
        """Tracks `entries`, whose records are on SSD, as on SSD again (indexing those that
        left the index); the SSD policy takes them as just arrived."""
        for entry in entries:
            if entry.block_id not in self.index:
                self.index.add(entry)
            entry.on_ssd = True
            if entry.slot is not None:
                self._redundant[entry.block_id] = entry
            self.ssd_policy.insert(entry.block_id, entry.parent_id, moved=True)

    def _record_write_failure(self, exc: lmdb.Error, num_blocks: int) -> None:
        self.counters.ssd_write_failures += 1
        log.error("event=ssd_write_failed blocks=%d error=%r", num_blocks, exc)

    def _finish_write(self, entries: list[Entry], hints: Mapping[bytes, BlockHint | None]) -> None:
        """Tracks written `entries` on SSD, with the DRAM policy's `hints` for them."""
        for entry in entries:
            entry.on_ssd = True
            if entry.slot is not None:
                self._redundant[entry.block_id] = entry
            hint = hints.get(entry.block_id)
            self.ssd_policy.insert(entry.block_id, entry.parent_id, moved=True, hint=hint)
            if entry.num_hits:  # reused in DRAM: the SSD policy hears of it too
                self.ssd_policy.touch([entry.block_id])
            self.counters.tiers["ssd"].bytes_written += entry.nbytes
        self.counters.demotions += len(entries)

    def _make_ssd_room(self, needed: int) -> tuple[list[Entry], list[Entry]]:
        """Gives up SSD copies until `needed` more bytes fit, for the write that follows to
        delete. Returns the copies of blocks still in DRAM (pinned until that write ends),
        and those of blocks it dropped (out of the index)."""
        assert self.ssd is not None
        cap = self.ssd.capacity_bytes
        used = self.ssd.stats().used_bytes
        copies: list[Entry] = []
        dropped: list[Entry] = []
        if used + needed <= self.config.ssd_high_watermark * cap:
            return copies, dropped
        target = self.config.ssd_low_watermark * cap - needed
        # SSD copies of blocks still in DRAM go first: the block stays servable, and the SSD
        # holds DRAM + SSD distinct blocks under pressure instead of SSD alone.
        while used > target and self._redundant:
            entry = next(iter(self._redundant.values()))
            entry.num_leases += 1  # stays in DRAM till the write ends: if it fails, back on SSD
            copies.append(entry)
            self._give_up_ssd_copy(entry)
            used -= entry.nbytes
        while used > target:
            victims = self._ssd_victims(used - target)
            if not victims:
                break
            for entry in victims:
                dropped.append(entry)
                self._give_up_ssd_copy(entry)
                used -= entry.nbytes
        return copies, dropped

    def _ssd_victims(self, nbytes: float) -> list[Entry]:
        """Evictable SSD entries in policy order, enough to free `nbytes` (one pass)."""
        victims = []
        for key in self.ssd_policy.candidates():
            if nbytes <= 0:
                break
            entry = self.index.get(key)
            assert entry is not None and entry.on_ssd, "SSD policy is stale"
            if entry.num_leases == 0:
                victims.append(entry)
                nbytes -= entry.nbytes
        return victims

    def _give_up_ssd_copy(self, entry: Entry) -> None:
        """Forgets the SSD copy (the caller deletes the record); drops a block left nowhere."""
        self.ssd_policy.remove(entry.block_id)
        self._redundant.pop(entry.block_id, None)
        entry.on_ssd = False
        if entry.slot is None:
            self.index.pop(entry.block_id)
            self.counters.drops += 1

    def _demote_forever(self) -> None:
        delay_s = 0.0  # after a pass that failed or freed nothing; doubles while they go on
        while True:
            with self.lock:
                self._wait_to_demote(delay_s)
                if self._closing:
                    return
                num_failures = self.counters.ssd_write_failures
            try:
                num_moved = self.demote_pass()
            except Exception:
                log.exception("event=demotion_failed")
                num_moved = 0
            with self.lock:
                is_stuck = num_moved == 0 or self.counters.ssd_write_failures != num_failures
            delay_s = min(max(2 * delay_s, _BACKOFF_MIN_S), _BACKOFF_MAX_S) if is_stuck else 0.0

    def _wait_to_demote(self, delay_s: float) -> None:
        """Waits, with the lock, `delay_s` (cut short by `close` or by an SSD write that
        succeeded meanwhile), then until DRAM is over its high watermark."""
        deadline = time.monotonic() + delay_s
        num_demotions = self.counters.demotions
        while not self._closing and self.counters.demotions == num_demotions:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            self._wake.wait(left_s)
        while not self._closing and not self._is_dram_over(self.config.dram_high_watermark):
            self._wake.wait()

    # -- lifecycle -----------------------------------------------------------------------

    def recover(self) -> int:
        """Rebuilds the index from SSD records; returns how many blocks were recovered.

        Records of the format before block ids (keyed by the 32-byte block key, the
        namespace only in the header) are first moved under their block id, all in one
        transaction, so a crash midway leaves the old format whole to migrate again.
        """
        if self.ssd is None:
            return 0
        good: dict[bytes, RecordHeader] = {}
        legacy: dict[bytes, tuple[bytes, RecordHeader]] = {}  # block id -> (old key, header)
        bad: list[bytes] = []
        for key, header in self.ssd.scan():
            if header is not None and len(key) == KEY_BYTES:
                legacy[block_id(header.namespace_id, key)] = (key, header)
            elif header is not None and split_block_id(key)[0] == header.namespace_id:
                good[key] = header
            else:
                bad.append(key)
        self._migrate(good, legacy)
        for bid, header in sorted(good.items(), key=lambda item: item[1].seq):
            self._recover_entry(bid, header)
        self._seq = max((h.seq for h in good.values()), default=0)
        if bad:
            self.ssd.write([], delete=bad)
            self.counters.checksum_failures += len(bad)
        return len(good)

    def _migrate(
        self, good: dict[bytes, RecordHeader], legacy: dict[bytes, tuple[bytes, RecordHeader]]
    ) -> None:
        """Re-keys old-format records by block id (into `good`); one already there wins."""
        if not legacy:
            return
        assert self.ssd is not None
        duplicates = [key for bid, (key, _) in legacy.items() if bid in good]
        moves = [(key, bid) for bid, (key, _) in legacy.items() if bid not in good]
        self.ssd.rekey(moves, delete=duplicates)
        good.update((bid, header) for bid, (_, header) in legacy.items() if bid not in good)
        log.info("event=ssd_migrated records=%d duplicates=%d", len(moves), len(duplicates))

    def _recover_entry(self, bid: bytes, h: RecordHeader) -> None:
        namespace_id, key = split_block_id(bid)
        parent = h.parent
        if parent is not None and self._closes_cycle(bid, block_id(namespace_id, parent)):
            log.warning("event=ssd_cycle_cut key=%s", key.hex()[:16])
            parent = None  # written before chains were checked: recovered as a root
        entry = Entry(key, namespace_id, parent, h.nbytes, None, BlockState.COMMITTED)
        entry.checksum, entry.on_ssd, entry.seq = h.checksum, True, h.seq
        self.index.add(entry)
        self.ssd_policy.insert(bid, entry.parent_id, moved=True)

    def _closes_cycle(self, bid: bytes, parent_id: bytes) -> bool:
        if parent_id == bid:
            return True
        if not self.index.is_named_parent(bid):
            return False
        return chains.closes_cycle(self.index, bid, {bid: parent_id}, set())

    def close(self) -> None:
        with self.lock:
            self._closing = True
            self._wake.notify_all()
        if self._demoter is not None:
            self._demoter.join()
        if self.ssd is not None:
            self.ssd.close()

    def usage(self) -> tuple[TierUsage, ...]:
        tiers: list[Any] = [self.dram] if self.ssd is None else [self.dram, self.ssd]
        if self.hbm is not None:
            tiers.insert(0, self.hbm.tier)
        out = []
        for tier in tiers:
            st, c = tier.stats(), self.counters.tiers[tier.name]
            out.append(
                TierUsage(
                    tier.name,
                    st.capacity_bytes,
                    st.used_bytes,
                    st.num_slots,
                    c.hits,
                    c.bytes_read,
                    c.bytes_written,
                )
            )
        return tuple(out)
