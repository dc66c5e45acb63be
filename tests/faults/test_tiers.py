"""The README's tier moves, seen from outside a real store: background demotion to the low
watermark, promotion that keeps the SSD copy, clean victims freed without a write, and a
full SSD that gives up copies of DRAM blocks before it drops anything, then chain tails.

DRAM holds 64 blocks: its high watermark (0.95) is 60.8 blocks, its low one (0.85) 54.4,
so one block over 60 makes the demoter free DRAM down to 54.
"""

from __future__ import annotations

import numpy as np

from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import StoreProcess, wait_until

NS = Namespace("tier-moves", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
BLOCK = NS.block_bytes
DRAM_BLOCKS = 64
LOW_BLOCKS = 54  # what demotion leaves in DRAM


def _chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(list(key)).integers(0, 256, BLOCK, dtype=np.uint8)


def _start(store_factory, tmp_path, ssd_blocks: int, *policies: str) -> StoreProcess:
    return store_factory(
        "--dram-bytes", str(DRAM_BLOCKS * BLOCK), "--slab-bytes", str(16 * BLOCK),
        "--ssd-path", str(tmp_path / "ssd"), "--ssd-bytes", str(ssd_blocks * BLOCK),
        "--dataplane", "none", *policies,
    )  # fmt: skip


def _put(client: Client, keys: list[bytes]) -> None:
    assert client.put_chain(NS.id, keys, [_payload(k) for k in keys]).num_stored == len(keys)


def _read_exact(client: Client, keys: list[bytes]) -> None:
    got = client.get(NS.id, keys).blocks
    for key, block in zip(keys, got, strict=True):
        assert block is not None and bytes(block) == _payload(key).tobytes()


def _usage(client: Client) -> dict[str, tuple[int, int]]:
    """(blocks, blocks written) per tier."""
    return {t.name: (t.num_blocks, t.bytes_written // BLOCK) for t in client.stats().tiers}


def _settle(client: Client) -> None:
    """Waits for the demoter: nothing calls it, the commit over the watermark woke it."""
    wait_until(
        lambda: _usage(client)["dram"][0] <= LOW_BLOCKS, 30.0, "DRAM demoted to its low mark"
    )


def _tiers(client: Client, keys: list[bytes]) -> list[str]:
    return [(client.match(NS.id, [k]).tiers or ("none",))[0] for k in keys]


def test_background_demotion_promotion_and_a_clean_victim(store_factory, tmp_path):
    store = _start(store_factory, tmp_path, 256, "--policy", "lru", "--ssd-policy", "lru")
    keys = _chain(61, seed=1)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        _put(client, keys[:60])  # at the high watermark, not past it
        assert _usage(client)["ssd"] == (0, 0)
        _put(client, keys[60:])
        _settle(client)
        assert _usage(client) == {"dram": (54, 61), "ssd": (7, 7)}
        assert _tiers(client, keys[:8]) == ["ssd"] * 7 + ["dram"]  # LRU's victims

        _read_exact(client, keys[:7])  # SSD hits: promoted, and their SSD copies kept
        assert _tiers(client, keys[:7]) == ["dram"] * 7
        ssd = next(t for t in client.stats().tiers if t.name == "ssd")
        assert (ssd.num_blocks, ssd.hits) == (7, 7)
        assert _usage(client)["dram"] == (61, 68)

        _read_exact(client, keys[7:])  # the promoted 7 are now the least recent
        _put(client, _chain(1, seed=2))  # 62 blocks: 8 victims, 7 of them clean
        _settle(client)
        assert _usage(client) == {"dram": (54, 69), "ssd": (8, 8)}  # one write, not eight
        assert _tiers(client, keys[:9]) == ["ssd"] * 8 + ["dram"]
        _read_exact(client, keys)


def test_a_full_ssd_gives_up_copies_of_dram_blocks_then_drops_chain_tails(store_factory, tmp_path):
    """DRAM evicts chain tails (prefix-lru); the SSD runs its default policy."""
    store = _start(store_factory, tmp_path, 14, "--policy", "prefix-lru")
    a, b = _chain(40, seed=1), _chain(21, seed=2)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        _put(client, a)
        _put(client, b)
        _settle(client)
        assert _tiers(client, a[-8:]) == ["dram"] + ["ssd"] * 7  # a's tail, demoted
        _read_exact(client, a)  # promoted: 7 blocks in both tiers
        _put(client, _chain(1, seed=3))  # b's tail goes down; the SSD must make room
        _settle(client)
        stats = client.stats()
        assert stats.num_blocks == 62, "a block was dropped while DRAM copies could go"
        assert _usage(client)["ssd"][0] == 13  # 7 + 8 written - 2 copies given up
        _read_exact(client, a)  # the blocks that lost their SSD copy still serve

        _put(client, _chain(8, seed=4))  # more than the copies left: now drops
        _settle(client)
        stats = client.stats()
        dram, ssd = _usage(client)["dram"][0], _usage(client)["ssd"][0]
        assert stats.num_blocks < 70
        assert dram + ssd == stats.num_blocks  # under pressure, distinct blocks only
        for keys in (a, b):  # what is left of each chain is a prefix of it: tails went
            found = client.get(NS.id, keys).found
            num_kept = sum(found)
            assert found == (True,) * num_kept + (False,) * (len(keys) - num_kept)
            _read_exact(client, keys[:num_kept])
