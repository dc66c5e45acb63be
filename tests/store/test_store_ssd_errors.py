"""SSD writes that fail (a full disk: `lmdb.DiskError`, `MapFullError`) inside one store.

Both writers are covered: a put that writes its DRAM victim inline, and the demotion pass
(run by `commit` here, background demotion off, or by the background demoter). A failed
write is one LMDB transaction that changed nothing, so afterwards memory must describe the
disk exactly (`check_integrity`): the victims it was for are dropped from DRAM (a cache),
the SSD copies given up to make room for them are back, nothing stays pinned, and the
demoter waits before it tries again.

`_Faults` makes `SsdTier.write` fail on demand, for exact states; a tmpfs far smaller than
`ssd_bytes` makes it fail for real.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import lmdb
import pytest

from kvstore import errors
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.store import Store, StoreConfig
from kvstore.store.eviction import POLICIES
from kvstore.store.tiering import demoter
from kvstore.store.tiers.base import Record
from kvstore.store.tiers.ssd import SsdTier
from tests.conftest import mounted_tmpfs, wait_until

NS = Namespace("ssd-errors-model", KVLayout("float16", 2, 2, 16, 8))  # 1 KiB blocks
BLOCK = NS.block_bytes
INLINE_ONLY = {"dram_high_watermark": 1.0, "dram_low_watermark": 1.0}  # no demotion pass
ENOSPC = "mdb_txn_commit: No space left on device"

Writes = Callable[[Sequence[Record], Sequence[bytes]], object]  # (records, delete) -> ...


@dataclass
class _Faults:
    """What `SsdTier.write` does here: runs `before(records, delete)`, then raises
    `lmdb.DiskError` if `should_fail(records, delete)`, else writes. Counts its calls."""

    should_fail: Writes = lambda records, delete: False
    before: Writes = lambda records, delete: None
    num_calls: int = 0

    def fail_all(self) -> None:
        self.should_fail = lambda records, delete: True

    def heal(self) -> None:
        self.should_fail = lambda records, delete: False


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> _Faults:
    faults = _Faults()
    write = SsdTier.write

    def faulty_write(tier: SsdTier, records: Sequence[Record], delete: Sequence[bytes] = ()):
        faults.num_calls += 1
        faults.before(records, delete)
        if faults.should_fail(records, delete):
            raise lmdb.DiskError(ENOSPC)
        write(tier, records, delete)

    monkeypatch.setattr(SsdTier, "write", faulty_write)
    return faults


def _make_store(path: Path, dram_blocks: int = 8, ssd_blocks: int = 32, **kw) -> Store:
    settings = {"policy": "lru", "ssd_policy": "lru", "background_demotion": False, **kw}
    config = StoreConfig(
        dram_bytes=dram_blocks * BLOCK,
        slab_bytes=4 * BLOCK,
        ssd_path=str(path),
        ssd_bytes=ssd_blocks * BLOCK,
        **settings,
    )
    store = Store(config)
    store.register_namespace(NS)
    return store


def _chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def _payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key)))[:BLOCK]


def _put(store: Store, keys: list[bytes]) -> None:
    _put_unchecked(store, keys)
    store.check_integrity()


def _put_unchecked(store: Store, keys: list[bytes]) -> None:
    """A put that may wake the background demoter: check integrity once it has settled."""
    res = store.reserve(NS.id, keys, [None, *keys[:-1]])
    for i, key in enumerate(keys):
        store.write(res.reservation_id, i, 0, _payload(key))
    store.commit(res.reservation_id)


def _tiers(store: Store, keys: list[bytes]) -> tuple[str | None, ...]:
    """Each key's fastest tier, None for a miss."""
    matches = [store.match(NS.id, [key]) for key in keys]
    return tuple(m.tiers[0] if m.num_matched else None for m in matches)


class _Counts(NamedTuple):
    dram: int  # blocks
    ssd: int  # blocks
    evictions: int
    drops: int
    demotions: int
    failures: int  # SSD writes that failed
    leases: int = 0
    reservations: int = 0


def _counts(store: Store) -> _Counts:
    stats = store.stats()
    tiers = {t.name: t.num_blocks for t in stats.tiers}
    return _Counts(
        tiers["dram"],
        tiers["ssd"],
        stats.evictions,
        stats.drops,
        stats.demotions,
        stats.ssd_write_failures,
        stats.num_leases,
        stats.num_reservations,
    )


def _bid(key: bytes) -> bytes:
    return NS.id + key


def _writes(key: bytes) -> Writes:
    """Whether a write puts `key`'s record."""
    return lambda records, delete: any(r.key == _bid(key) for r in records)


# -- a put that writes its victim inline -----------------------------------------------


def test_a_put_whose_victim_fails_to_write_drops_it_and_lands(tmp_path, faults, caplog):
    caplog.set_level(logging.ERROR, logger="kvstore.store.tiering")
    with _make_store(tmp_path / "ssd", dram_blocks=4, **INLINE_ONLY) as store:
        a, b, c = _chain(4, seed=1), _chain(1, seed=2), _chain(1, seed=3)
        _put(store, a)
        faults.fail_all()
        _put(store, b)  # evicts a[0], whose write fails: it is dropped instead
        assert _tiers(store, a + b) == (None, "dram", "dram", "dram", "dram")
        assert _counts(store) == _Counts(4, 0, evictions=1, drops=1, demotions=0, failures=1)
        assert "event=ssd_write_failed blocks=1 error=DiskError(" in caplog.text
        assert store.read(NS.id, a + b) == [None, *map(_payload, a[1:] + b)]
        faults.heal()
        _put(store, c)  # evicts a[1] (the read left it the oldest): written again
        assert _tiers(store, a[1:2]) == ("ssd",)
        assert _counts(store) == _Counts(4, 1, evictions=2, drops=1, demotions=1, failures=1)
        assert store.read(NS.id, a[1:2]) == [_payload(a[1])]
        store.check_integrity()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_reserve_whose_victims_all_fail_to_write_frees_them_all(tmp_path, faults, policy):
    with _make_store(tmp_path / "ssd", 4, policy=policy, ssd_policy=policy, **INLINE_ONLY) as s:
        a, b = _chain(4, seed=1), _chain(3, seed=2)
        _put(s, a)
        faults.fail_all()
        _put(s, b)  # three victims from a, each dropped (written first where worth it)
        num_writes = faults.num_calls
        assert _counts(s) == _Counts(4, 0, evictions=3, drops=3, demotions=0, failures=num_writes)
        got = dict(zip(a + b, s.read(NS.id, a + b), strict=True))
        assert [got[k] for k in b] == list(map(_payload, b))
        kept = [k for k in a if got[k] is not None]  # which one depends on the policy
        assert [got[k] for k in kept] == [_payload(kept[0])]
        s.check_integrity()


def test_a_failed_write_keeps_the_ssd_blocks_it_was_to_delete(tmp_path, faults):
    with _make_store(tmp_path / "ssd", dram_blocks=4, ssd_blocks=4, **INLINE_ONLY) as store:
        a, b, c = _chain(4, seed=1), _chain(4, seed=2), _chain(1, seed=3)
        _put(store, a)
        _put(store, b)  # a goes to SSD, which it fills
        assert _tiers(store, a + b) == ("ssd",) * 4 + ("dram",) * 4
        faults.fail_all()
        _put(store, c)  # b[0]'s transaction was to delete a[0] and a[1] for room: none of it
        assert _tiers(store, a + b + c) == ("ssd",) * 4 + (None,) + ("dram",) * 4
        assert _counts(store) == _Counts(4, 4, evictions=5, drops=1, demotions=4, failures=1)
        # Still failing: each SSD hit is promoted over a dropped victim, and reads exact.
        assert store.read(NS.id, a) == list(map(_payload, a))
        store.check_integrity()
        assert _counts(store).ssd == 4


def test_a_failed_write_gives_back_the_ssd_copies_of_dram_blocks(tmp_path, faults):
    with _make_store(tmp_path / "ssd", dram_blocks=4, ssd_blocks=7, **INLINE_ONLY) as store:
        a, b, c, d = (_chain(n, seed) for n, seed in ((4, 1), (4, 2), (1, 3), (1, 4)))
        _put(store, a)
        _put(store, b)  # a to SSD
        store.read(NS.id, a[:3])  # promoted over b[0:3], which go to SSD: it is full
        assert _tiers(store, a + b) == ("dram",) * 3 + ("ssd",) * 4 + ("dram",)
        assert _counts(store) == _Counts(4, 7, evictions=7, drops=0, demotions=7, failures=0)
        faults.fail_all()
        _put(store, c)  # b[3]'s write was to delete the SSD copies of a[0] and a[1]
        assert _tiers(store, a + b + c) == ("dram",) * 3 + ("ssd",) * 4 + (None, "dram")
        assert _counts(store) == _Counts(4, 7, evictions=8, drops=1, demotions=7, failures=1)
        _put(store, d)  # evicts a[0]: on SSD still, so freed without a write
        assert _tiers(store, a[:1] + d) == ("ssd", "dram")
        assert _counts(store) == _Counts(4, 7, evictions=9, drops=1, demotions=7, failures=1)
        assert store.read(NS.id, a) == list(map(_payload, a))
        store.check_integrity()


# -- the demotion pass -----------------------------------------------------------------


def test_a_failed_demotion_drops_its_victims_and_pins_nothing(tmp_path, faults):
    with _make_store(tmp_path / "ssd") as store:
        a, b = _chain(8, seed=1), _chain(2, seed=2)
        faults.fail_all()
        _put(store, a)  # 8 of 8 blocks: a[0] and a[1] are to go to SSD, and fail to
        assert _tiers(store, a) == (None, None) + ("dram",) * 6
        assert _counts(store) == _Counts(6, 0, evictions=2, drops=2, demotions=0, failures=1)
        assert store.read(NS.id, a) == [None, None, *map(_payload, a[2:])]
        faults.heal()
        _put(store, b)  # over the high watermark again: a[2] and a[3] go to SSD
        assert _tiers(store, a[2:4]) == ("ssd", "ssd")
        assert _counts(store) == _Counts(6, 2, evictions=4, drops=2, demotions=2, failures=1)
        assert store.demote_now() == 0  # at the low watermark: nothing left to do
        store.check_integrity()


def test_a_victim_read_during_a_failed_demotion_stays_in_dram(tmp_path, faults):
    with _make_store(tmp_path / "ssd") as store:
        a = _chain(8, seed=1)
        leases = []

        def read_a0(records: Sequence[Record], delete: Sequence[bytes]) -> None:
            leases.append(store.acquire(NS.id, a[:1]))
            faults.before = lambda records, delete: None

        faults.before = read_a0
        faults.fail_all()
        _put(store, a)  # a[0] is leased while its write fails; a[1] is dropped
        assert _tiers(store, a) == ("dram", None) + ("dram",) * 6
        assert _counts(store) == _Counts(7, 0, 1, drops=1, demotions=0, failures=1, leases=1)
        assert bytes(leases[0].views[0]) == _payload(a[0])
        store.release(leases[0].lease_id)
        store.check_integrity()
        faults.heal()
        assert store.demote_now() == 1  # down to the low watermark: a[2], the oldest now
        assert _tiers(store, a[:3]) == ("dram", None, "ssd")
        store.check_integrity()


def test_a_victim_removed_during_a_failed_demotion_is_gone(tmp_path, faults):
    with _make_store(tmp_path / "ssd") as store:
        a = _chain(8, seed=1)
        faults.before = lambda records, delete: store.remove(NS.id, a[:1])
        faults.fail_all()
        _put(store, a)
        assert _tiers(store, a) == (None, None) + ("dram",) * 6
        assert _counts(store) == _Counts(6, 0, evictions=1, drops=1, demotions=0, failures=1)
        store.check_integrity()


def test_a_removed_victim_whose_record_fails_to_go_stays_on_ssd(tmp_path, faults):
    with _make_store(tmp_path / "ssd") as store:
        a = _chain(8, seed=1)
        removed = []

        def remove_a0(records: Sequence[Record], delete: Sequence[bytes]) -> None:
            if records:  # the demotion's write, not the delete of a[0]'s record after it
                removed.append(store.remove(NS.id, a[:1]))

        faults.before = remove_a0
        faults.should_fail = lambda records, delete: not records
        _put(store, a)  # a[0] and a[1] written; a[0], removed meanwhile, keeps its record
        assert removed == [1]
        assert _tiers(store, a) == ("ssd", "ssd") + ("dram",) * 6
        assert _counts(store) == _Counts(6, 2, evictions=1, drops=0, demotions=1, failures=1)
        assert store.read(NS.id, a[:1]) == [_payload(a[0])]
        store.check_integrity()


def test_a_failed_demotion_deletes_the_record_of_a_copy_removed_meanwhile(tmp_path, faults):
    with _make_store(tmp_path / "ssd", ssd_blocks=4) as store:
        a, b = _chain(8, seed=1), _chain(1, seed=2)
        _put(store, a)  # a[0] and a[1] to SSD
        store.read(NS.id, a[:2])  # promoted into free slots: SSD copies of DRAM blocks
        removed = []

        def remove_a0(records: Sequence[Record], delete: Sequence[bytes]) -> None:
            if _writes(a[3])(records, delete):
                removed.append(store.remove(NS.id, a[:1]))

        faults.before = remove_a0
        faults.should_fail = _writes(a[3])
        # b[0] evicts a[2] (written); its commit demotes a[3] and a[4], whose transaction was
        # to delete the SSD copies of a[0] (removed meanwhile) and a[1]: it fails.
        _put(store, b)
        assert removed == [1]
        assert _tiers(store, a + b) == (None, "dram", "ssd", None, None) + ("dram",) * 4
        assert _counts(store) == _Counts(5, 2, evictions=5, drops=2, demotions=3, failures=1)
        assert store.read(NS.id, a[1:3]) == [_payload(a[1]), _payload(a[2])]
        store.check_integrity()


# -- the background demoter ------------------------------------------------------------


def test_the_demoter_waits_while_writes_fail_and_resumes_after_one_succeeds(
    tmp_path, faults, monkeypatch
):
    # Only a good write ends its wait.
    monkeypatch.setattr(demoter, "DEFAULT_BACKOFF", demoter.Backoff(3600.0, 3600.0))
    with _make_store(tmp_path / "ssd", background_demotion=True) as store:
        a, b, c = _chain(8, seed=1), _chain(2, seed=2), _chain(1, seed=3)
        faults.fail_all()
        _put_unchecked(store, a)
        dropped = _Counts(6, 0, evictions=2, drops=2, demotions=0, failures=1)
        wait_until(lambda: _counts(store) == dropped, 10.0, "the demoter dropped a[0:2]")
        store.check_integrity()
        _put(store, b)  # over the high watermark again, while the demoter waits
        time.sleep(0.3)  # a measurement window, not a wait for a condition
        assert (faults.num_calls, _counts(store).dram) == (1, 8)
        faults.heal()
        _put_unchecked(store, c)  # DRAM is full: c evicts a[2] inline, and that write succeeds
        written = _Counts(6, 3, evictions=5, drops=2, demotions=3, failures=1)
        wait_until(lambda: _counts(store) == written, 10.0, "the demoter wrote a[3:5]")
        assert _tiers(store, a[2:5]) == ("ssd",) * 3
        store.check_integrity()


def test_the_demoter_tries_again_after_its_backoff(tmp_path, faults):
    with _make_store(tmp_path / "ssd", background_demotion=True) as store:
        a, b = _chain(8, seed=1), _chain(2, seed=2)
        faults.fail_all()
        _put_unchecked(store, a)
        dropped = _Counts(6, 0, evictions=2, drops=2, demotions=0, failures=1)
        wait_until(lambda: _counts(store) == dropped, 10.0, "the demoter dropped a[0:2]")
        faults.heal()
        _put_unchecked(store, b)  # within its first backoff, or after it: written either way
        written = _Counts(6, 2, evictions=4, drops=2, demotions=2, failures=1)
        wait_until(lambda: _counts(store) == written, 10.0, "the demoter wrote a[2:4]")
        store.check_integrity()


# -- a real filesystem that fills ------------------------------------------------------

BIG = Namespace("ssd-errors-big", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
DISK_BYTES = 1 << 20  # about 30 blocks


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of DISK_BYTES, unmounted after the test."""
    with mounted_tmpfs(tmp_path / "small-disk", DISK_BYTES) as path:
        yield path


def _big_chain(seed: int) -> list[bytes]:
    return block_keys(BIG, [seed * 100_000 + t for t in range(4 * BIG.block_tokens)])


def _big_payload(key: bytes) -> bytes:
    return (key * (BIG.block_bytes // len(key)))[: BIG.block_bytes]


def _big_put(store: Store, keys: list[bytes]) -> None:
    res = store.reserve(BIG.id, keys, [None, *keys[:-1]])
    for i, key in enumerate(keys):
        store.write(res.reservation_id, i, 0, _big_payload(key))
    store.commit(res.reservation_id)
    store.check_integrity()


def _on(store: Store, keys: list[bytes], tier: str) -> list[bytes]:
    return [k for k in keys if store.match(BIG.id, [k]).tiers == (tier,)]


def _assert_tiers_agree(store: Store, keys: list[bytes]) -> None:
    stats = store.stats()
    tiers = {t.name: t.num_blocks for t in stats.tiers}
    assert tiers == {"dram": len(_on(store, keys, "dram")), "ssd": len(_on(store, keys, "ssd"))}
    assert (stats.num_leases, stats.num_reservations, stats.checksum_failures) == (0, 0, 0)


@pytest.mark.parametrize("path", ["inline", "demotion"])
def test_a_disk_that_fills_and_then_grows(small_disk, path):
    config = StoreConfig(
        dram_bytes=16 * BIG.block_bytes,
        slab_bytes=16 * BIG.block_bytes,
        ssd_path=str(small_disk),
        ssd_bytes=256 * BIG.block_bytes,  # the disk fills long before the tier would
        background_demotion=False,
        policy="lru",
        ssd_policy="lru",
        **(INLINE_ONLY if path == "inline" else {}),
    )
    with Store(config) as store:
        store.register_namespace(BIG)
        tried: list[bytes] = []
        for seed in range(64):  # 256 blocks, 8x what the disk holds
            tried += _big_chain(seed)
            _big_put(store, tried[-4:])  # lands, whatever happens to the SSD write
            if store.stats().ssd_write_failures:
                break
        assert store.stats().ssd_write_failures, "the disk never filled"
        on_ssd = _on(store, tried, "ssd")
        for seed in range(100, 108):
            tried += _big_chain(seed)
            _big_put(store, tried[-4:])
        _assert_tiers_agree(store, tried)
        assert set(on_ssd) <= set(_on(store, tried, "ssd"))
        got = store.read(BIG.id, tried)
        assert all(g is None or g == _big_payload(k) for k, g in zip(tried, got, strict=True))
        assert [got[tried.index(k)] for k in on_ssd] == list(map(_big_payload, on_ssd))
        store.check_integrity()

        remount = ["mount", "-o", f"remount,size={8 * DISK_BYTES}", str(small_disk)]
        subprocess.run(remount, check=True, capture_output=True)
        before = store.stats()
        for seed in range(200, 208):
            tried += _big_chain(seed)
            _big_put(store, tried[-4:])
        assert store.stats().ssd_write_failures == before.ssd_write_failures
        assert store.stats().demotions > before.demotions
        _assert_tiers_agree(store, tried)
        store.check_integrity()


# -- deletes and metadata on a full disk -----------------------------------------------


def test_a_remove_the_disk_refuses_removes_nothing_and_says_so(tmp_path, faults):
    with _make_store(tmp_path / "ssd", dram_blocks=4, **INLINE_ONLY) as store:
        a, b = _chain(4, seed=1), _chain(2, seed=2)
        _put(store, a)
        _put(store, b)  # evicts a[0] and a[1] to SSD
        assert _tiers(store, a) == ("ssd", "ssd", "dram", "dram")
        faults.fail_all()
        with pytest.raises(errors.StoreFullError, match="nothing was removed"):
            store.remove(NS.id, a[1:3])  # a[1] on SSD only, a[2] in DRAM only
        assert _counts(store) == _Counts(4, 2, evictions=2, drops=0, demotions=2, failures=1)
        store.check_integrity()
        faults.heal()
        assert store.remove(NS.id, a[1:3]) == 2
        assert _tiers(store, a) == ("ssd", None, None, "dram")
        assert store.read(NS.id, [a[0], a[3]]) == [_payload(a[0]), _payload(a[3])]
        store.check_integrity()


def test_a_full_disk_refuses_deletes_and_namespaces_without_leaving_memory_behind(small_disk):
    config = StoreConfig(
        dram_bytes=16 * BIG.block_bytes,
        slab_bytes=16 * BIG.block_bytes,
        ssd_path=str(small_disk),
        ssd_bytes=256 * BIG.block_bytes,
        background_demotion=False,
        policy="lru",
        ssd_policy="lru",
        **INLINE_ONLY,
    )
    other = Namespace("ssd-errors-other", KVLayout("float16", 4, 2, 64, 16))
    with Store(config) as store:
        store.register_namespace(BIG)
        tried: list[bytes] = []
        for seed in range(64):
            tried += _big_chain(seed)
            _big_put(store, tried[-4:])
            if store.stats().ssd_write_failures:
                break
        on_ssd = _on(store, tried, "ssd")[:4]
        assert store.stats().ssd_write_failures and on_ssd, "the disk never filled"
        try:
            assert store.remove(BIG.id, on_ssd) == len(on_ssd)
            assert store.match(BIG.id, on_ssd[:1]).num_matched == 0
        except errors.StoreFullError:  # nothing removed
            assert store.read(BIG.id, on_ssd) == list(map(_big_payload, on_ssd))
        store.check_integrity()
        try:
            store.register_namespace(other)
            assert store.namespace(other.id) == other
        except errors.StoreFullError:  # nothing registered
            with pytest.raises(errors.UnknownNamespaceError):
                store.namespace(other.id)
        store.check_integrity()
        remount = ["mount", "-o", f"remount,size={8 * DISK_BYTES}", str(small_disk)]
        subprocess.run(remount, check=True, capture_output=True)
        store.register_namespace(other)
        store.remove(BIG.id, on_ssd)
        assert store.match(BIG.id, on_ssd[:1]).num_matched == 0
        store.check_integrity()
    with Store(config) as reopened:  # the disk holds what memory said
        assert reopened.namespace(other.id) == other
        assert reopened.match(BIG.id, on_ssd[:1]).num_matched == 0
        reopened.check_integrity()
