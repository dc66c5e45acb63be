"""The store with an SSD tier: demotion, promotion, restart recovery, corruption."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore import errors
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.store import Store, StoreConfig
from kvstore.store.eviction import POLICIES

NS = Namespace("tiered-model", KVLayout("float16", 2, 2, 16, 8))  # 1 KiB blocks
BLOCK = NS.block_bytes


def _make_store(path: Path, dram_blocks: int = 8, ssd_blocks: int = 32, **kw) -> Store:
    config = StoreConfig(
        dram_bytes=dram_blocks * BLOCK,
        slab_bytes=4 * BLOCK,
        ssd_path=str(path),
        ssd_bytes=ssd_blocks * BLOCK,
        background_demotion=False,
        **kw,
    )
    store = Store(config)
    store.register_namespace(NS)
    return store


def _chain(n: int, seed: int = 0) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def _payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key)))[:BLOCK]


def _put(store: Store, keys: list[bytes]) -> None:
    res = store.reserve(NS.id, keys, [None, *keys[:-1]])
    for i, key in enumerate(keys):
        res.write(i, 0, _payload(key))
    res.commit()
    store.check_integrity()


def _prefix_2q_store(path: Path, **kw) -> Store:
    """4 DRAM and 8 SSD blocks, prefix-2q on both tiers."""
    return _make_store(path, 4, 8, policy="prefix-2q", ssd_policy="prefix-2q", **kw)


def _tier(store: Store, name: str):
    return next(t for t in store.stats().tiers if t.name == name)


@pytest.fixture
def store(tmp_path):
    with _make_store(tmp_path / "ssd") as s:
        yield s


def test_dram_over_high_watermark_demotes_to_low_watermark(store):
    _put(store, _chain(8))  # 8/8 blocks: over 0.95, demote down to 0.85 -> 6 left
    dram, ssd = _tier(store, "dram"), _tier(store, "ssd")
    assert (dram.num_blocks, ssd.num_blocks) == (6, 2)
    assert ssd.bytes_written == 2 * BLOCK
    assert store.match(NS.id, _chain(8)) == (8, ("dram",) * 6 + ("ssd", "ssd"))  # tails first


def test_ssd_hit_is_promoted_and_keeps_its_ssd_copy(store):
    keys = _chain(8)
    _put(store, keys)
    assert store.match(NS.id, keys).tiers[6:] == ("ssd", "ssd")
    assert store.read(NS.id, keys[6:]) == [_payload(k) for k in keys[6:]]
    store.check_integrity()
    assert store.match(NS.id, keys).tiers[6:] == ("dram", "dram")
    ssd = _tier(store, "ssd")
    assert (ssd.hits, ssd.bytes_read, ssd.num_blocks) == (2, 2 * BLOCK, 2)
    stats = store.stats()
    assert (stats.demotions, stats.promotions, stats.drops) == (2, 2, 0)


def test_reads_count_hit_tokens_per_tier_and_miss_tokens(store):
    keys = _chain(8)
    _put(store, keys)  # 6 in DRAM, the last 2 on SSD
    assert (
        store.read(NS.id, [*keys, *_chain(3, seed=7)]) == [_payload(k) for k in keys] + [None] * 3
    )
    dram, ssd = _tier(store, "dram"), _tier(store, "ssd")
    assert (dram.hit_tokens, ssd.hit_tokens) == (6 * NS.block_tokens, 2 * NS.block_tokens)
    assert (store.stats().misses, store.stats().miss_tokens) == (3, 3 * NS.block_tokens)


def test_store_holds_more_than_dram(store):
    chains = [_chain(8, seed=s) for s in range(4)]  # 32 blocks, DRAM holds 8
    for chain in chains:
        _put(store, chain)
    assert store.stats().num_blocks == 32
    for chain in chains:
        assert store.read(NS.id, chain) == [_payload(k) for k in chain]
        store.check_integrity()
    assert store.stats().checksum_failures == 0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_ssd_full_drops_blocks_and_keeps_serving(tmp_path, policy):
    with _make_store(tmp_path / "ssd", ssd_blocks=16, ssd_policy=policy) as store:
        chains = [_chain(8, seed=s) for s in range(6)]
        for chain in chains:
            _put(store, chain)
        stats = store.stats()
        assert _tier(store, "ssd").used_bytes <= 16 * BLOCK
        assert stats.num_blocks < 48
        for chain in chains:
            got = store.read(NS.id, chain)
            assert all(g is None or g == _payload(k) for g, k in zip(got, chain, strict=True))
        store.check_integrity()


def test_restart_serves_every_block_written_to_ssd(tmp_path):
    path = tmp_path / "ssd"
    chains = [_chain(8, seed=s) for s in range(3)]
    with _make_store(path) as store:
        for chain in chains:
            _put(store, chain)
        on_ssd = {k for c in chains for k, held in zip(c, store.tiers_of(NS.id, c), strict=True)
                  if "ssd" in held}  # fmt: skip
        assert len(on_ssd) >= 16
    with Store(
        StoreConfig(
            dram_bytes=8 * BLOCK,
            slab_bytes=4 * BLOCK,
            ssd_path=str(path),
            ssd_bytes=32 * BLOCK,
            background_demotion=False,
        )
    ) as store:
        assert store.stats().num_namespaces == 1  # the namespace came back too
        store.check_integrity()
        for key in on_ssd:
            assert store.read(NS.id, [key]) == [_payload(key)]
        assert store.stats().checksum_failures == 0


def test_flipped_bytes_on_disk_are_detected_and_never_returned(tmp_path):
    path = tmp_path / "ssd"
    keys = _chain(8)
    with _make_store(path, dram_blocks=4) as store:
        _put(store, keys[:4])
        _put(store, keys[4:])
        victims = [k for k, held in zip(keys, store.tiers_of(NS.id, keys), strict=True)
                   if "ssd" in held]  # fmt: skip
    target = victims[0]
    pattern = _payload(target)[:64]  # the key twice: only ever inside the block's bytes
    data = (path / "data.mdb").read_bytes()
    assert pattern in data
    damaged = bytes([pattern[0] ^ 0xFF]) + pattern[1:]
    (path / "data.mdb").write_bytes(data.replace(pattern, damaged))
    with _make_store(path, dram_blocks=4) as store:
        got = store.read(NS.id, victims)
        assert got[0] is None
        assert got[1:] == [_payload(k) for k in victims[1:]]
        stats = store.stats()
        assert stats.checksum_failures == 1
        assert store.match(NS.id, [target]).num_matched == 0
        store.check_integrity()


def test_remove_deletes_the_ssd_copy(tmp_path):
    path = tmp_path / "ssd"
    keys = _chain(8)
    with _make_store(path) as store:
        _put(store, keys)
        assert store.remove(NS.id, keys) == 8
        store.check_integrity()
        assert _tier(store, "ssd").num_blocks == 0
    with _make_store(path) as store:
        assert store.match(NS.id, keys).num_matched == 0


def test_watermarks_are_validated(tmp_path):
    with pytest.raises(errors.InvalidArgumentError, match="watermarks"):
        StoreConfig(dram_low_watermark=0.9, dram_high_watermark=0.8)
    with pytest.raises(errors.InvalidArgumentError, match="ssd_bytes"):
        StoreConfig(ssd_path=str(tmp_path))


def test_a_block_reused_in_dram_stays_protected_on_ssd(tmp_path):
    """Its DRAM hits follow a block to SSD: there it outlives blocks demoted unread."""
    with _prefix_2q_store(
        tmp_path / "ssd",
        dram_high_watermark=1.0,
        dram_low_watermark=1.0,
        ssd_high_watermark=1.0,
        ssd_low_watermark=1.0,
    ) as store:
        reused, kept = _chain(2, seed=1), _chain(2, seed=2)
        for keys in (reused, kept):  # DRAM full of protected blocks
            _put(store, keys)
            assert store.read(NS.id, keys) == [_payload(k) for k in keys]
        unread = _chain(2, seed=3)
        _put(store, unread)  # demotes `reused`, the least recent protected
        assert _tier(store, "ssd").num_blocks == 2
        for seed in range(4, 16):  # one-use chains push `unread` through DRAM, then SSD
            _put(store, _chain(2, seed=seed))
        assert store.match(NS.id, reused).num_matched == 2
        assert store.match(NS.id, unread).num_matched == 0
        assert store.read(NS.id, reused) == [_payload(k) for k in reused]
        store.check_integrity()


def test_a_chain_demoted_tail_first_keeps_its_links_on_ssd(tmp_path):
    """The SSD policy gets a chain's blocks tail first, and still sees one chain."""
    with _prefix_2q_store(
        tmp_path / "ssd", dram_high_watermark=1.0, dram_low_watermark=1.0
    ) as store:
        chain = _chain(4, seed=1)
        _put(store, chain)
        _put(store, _chain(4, seed=2))  # all 4 demoted, tail first
        assert store.match(NS.id, chain).tiers == ("ssd",) * 4
        assert store.eviction_order("ssd") == [(NS.id, chain[3])]  # its tail only: linked
