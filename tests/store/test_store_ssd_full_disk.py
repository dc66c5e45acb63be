"""A full disk under one store: a tmpfs far smaller than `ssd_bytes` makes SSD writes fail
for real (`lmdb.DiskError`, `MapFullError`), inline or in the demotion pass. Every put
still lands, memory describes the disk exactly, and once the disk grows the SSD takes
writes again. Removes and namespace registrations the disk refuses change nothing, in
memory or (after a restart) on the disk; `faults` makes a refused remove exact.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import errors
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.store import Store, StoreConfig
from tests.conftest import mounted_tmpfs
from tests.store.ssd_fault_cases import (
    INLINE_ONLY,
    NS,
    Counts,
    chain,
    counts,
    fastest_tiers,
    make_store,
    payload,
    put,
)

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
        res.write(i, 0, _big_payload(key))
    res.commit()
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
    with make_store(tmp_path / "ssd", dram_blocks=4, **INLINE_ONLY) as store:
        a, b = chain(4, seed=1), chain(2, seed=2)
        put(store, a)
        put(store, b)  # evicts a[0] and a[1] to SSD
        assert fastest_tiers(store, a) == ("ssd", "ssd", "dram", "dram")
        faults.fail_all()
        with pytest.raises(errors.StoreFullError, match="nothing was removed"):
            store.remove(NS.id, a[1:3])  # a[1] on SSD only, a[2] in DRAM only
        assert counts(store) == Counts(4, 2, evictions=2, drops=0, demotions=2, failures=1)
        store.check_integrity()
        faults.heal()
        assert store.remove(NS.id, a[1:3]) == 2
        assert fastest_tiers(store, a) == ("ssd", None, None, "dram")
        assert store.read(NS.id, [a[0], a[3]]) == [payload(a[0]), payload(a[3])]
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
