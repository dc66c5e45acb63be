"""Namespaces are disjoint: a key means nothing outside the namespace it was put in.

In DRAM, on SSD and across a restart, including from SSD records of the format before
block ids (keyed by the 32-byte key alone), which a store migrates at start-up.
"""

from __future__ import annotations

from pathlib import Path

import lmdb

from kvstore.checksum import checksum
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import PutStatus
from kvstore.store import Store, StoreConfig
from kvstore.store.tiers.base import Record, RecordHeader
from kvstore.store.tiers.ssd import SsdTier

NS_A = Namespace("model-a", KVLayout("float16", 2, 1, 8, 4))  # 256-byte blocks
NS_B = Namespace("model-b", KVLayout("float16", 2, 1, 8, 4))
BLOCK = NS_A.block_bytes
KEYS = block_keys(NS_A, list(range(3 * NS_A.block_tokens)))  # put in both namespaces


def _make_store(ssd_path: Path | None = None, **kw) -> Store:
    ssd = {"ssd_path": str(ssd_path), "ssd_bytes": 64 * BLOCK} if ssd_path else {}
    config = StoreConfig(
        dram_bytes=16 * BLOCK, slab_bytes=4 * BLOCK, background_demotion=False, **ssd, **kw
    )
    store = Store(config)
    for ns in (NS_A, NS_B):
        store.register_namespace(ns)
    return store


def _payload(ns: Namespace, key: bytes) -> bytes:
    return ((ns.id[:4] + key) * BLOCK)[:BLOCK]


def _put(store: Store, ns: Namespace, keys: list[bytes]) -> tuple[PutStatus, ...]:
    res = store.reserve(ns.id, keys, [None, *keys[:-1]])
    for i, status in enumerate(res.statuses):
        if status is PutStatus.RESERVED:
            res.write(i, 0, _payload(ns, keys[i]))
    res.commit()
    store.check_integrity()
    return res.statuses


def test_a_key_put_in_one_namespace_is_new_in_another():
    with _make_store() as store:
        _put(store, NS_B, KEYS)
        assert _put(store, NS_A, KEYS) == (PutStatus.RESERVED,) * 3
        assert store.read(NS_A.id, KEYS) == [_payload(NS_A, k) for k in KEYS]
        assert store.read(NS_B.id, KEYS) == [_payload(NS_B, k) for k in KEYS]
        assert store.stats().num_blocks == 6


def test_reserve_tells_nothing_of_another_namespace():
    with _make_store() as store:
        _put(store, NS_B, KEYS[:1])
        in_flight = store.reserve(NS_B.id, KEYS[1:2], [KEYS[0]])
        res = store.reserve(NS_A.id, KEYS[:2])
        assert res.statuses == (PutStatus.RESERVED, PutStatus.RESERVED)
        res.abort()
        in_flight.abort()
        store.check_integrity()


def test_removing_a_key_in_one_namespace_leaves_the_other():
    with _make_store() as store:
        _put(store, NS_A, KEYS)
        _put(store, NS_B, KEYS)
        assert store.remove(NS_A.id, KEYS) == 3
        store.check_integrity()
        assert store.match(NS_A.id, KEYS).num_matched == 0
        assert store.read(NS_B.id, KEYS) == [_payload(NS_B, k) for k in KEYS]


def test_same_key_in_two_namespaces_demotes_and_recovers_as_two_blocks(tmp_path):
    # Every committed block is written out at once (watermarks near zero, LRU demotes all).
    kw = {"policy": "lru", "dram_high_watermark": 0.01, "dram_low_watermark": 0.01}
    with _make_store(tmp_path / "ssd", **kw) as store:
        _put(store, NS_A, KEYS)
        _put(store, NS_B, KEYS)
        for ns in (NS_A, NS_B):
            assert store.match(ns.id, KEYS).tiers == ("ssd",) * 3
        assert store.remove(NS_B.id, KEYS[2:]) == 1  # deletes NS_B's record only
    with _make_store(tmp_path / "ssd", **kw) as store:
        store.check_integrity()
        assert store.read(NS_A.id, KEYS) == [_payload(NS_A, k) for k in KEYS]
        assert store.read(NS_B.id, KEYS) == [_payload(NS_B, k) for k in KEYS[:2]] + [None]


def _write_old_format(path: Path, ns: Namespace, keys: list[bytes]) -> None:
    """SSD records as the format before block ids wrote them: LMDB key = the 32-byte key."""
    tier = SsdTier(str(path), 64 * BLOCK)
    tier.save_meta(ns.id, ns.encode())
    parents = [None, *keys[:-1]]
    records = [
        Record(key, RecordHeader(ns.id, parent, checksum(_payload(ns, key)), BLOCK, seq), b"")
        for seq, (key, parent) in enumerate(zip(keys, parents, strict=True), start=1)
    ]
    tier.write([r._replace(payload=_payload(ns, r.key)) for r in records])
    tier.close()


def _lmdb_keys(path: Path) -> list[bytes]:
    env = lmdb.open(str(path), max_dbs=2, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        keys = [bytes(k) for k, _ in txn.cursor()]
    env.close()
    return keys


def test_old_format_ssd_records_are_migrated_on_start_up(tmp_path):
    path = tmp_path / "ssd"
    _write_old_format(path, NS_A, KEYS)
    with _make_store(path) as store:
        store.check_integrity()
        assert store.match(NS_A.id, KEYS).tiers == ("ssd",) * 3
        assert store.match(NS_B.id, KEYS).num_matched == 0
        assert store.stats().checksum_failures == 0
        assert store.eviction_order("ssd") == [(NS_A.id, KEYS[2])]  # linked: its tail only
    assert sorted(_lmdb_keys(path)) == sorted(NS_A.id + k for k in KEYS)
    with _make_store(path) as store:  # the migrated records come back as they are
        assert store.read(NS_A.id, KEYS) == [_payload(NS_A, k) for k in KEYS]
        assert _put(store, NS_B, KEYS) == (PutStatus.RESERVED,) * 3
        store.check_integrity()
