"""A real store process with an SSD tier, killed with SIGKILL mid-demotion and restarted."""

from __future__ import annotations

import numpy as np

from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import start_store

NS = Namespace("recovery-model", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
BLOCK = NS.block_bytes
CHAIN_LEN = 16


def _chain(seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(CHAIN_LEN * NS.block_tokens) + seed * 1_000_000)


def _expected(key: bytes) -> np.ndarray:
    return np.tile(np.frombuffer(key, dtype=np.uint8), BLOCK // len(key))


def _serve_args(tmp_path) -> tuple[str, ...]:
    return (
        "--dram-bytes",
        str(64 * BLOCK),
        "--slab-bytes",
        str(16 * BLOCK),
        "--ssd-path",
        str(tmp_path / "ssd"),
        "--ssd-bytes",
        str(4096 * BLOCK),
    )


def test_sigkill_during_demotion_loses_no_block_written_to_ssd(tmp_path, store_factory):
    store = start_store(tmp_path, *_serve_args(tmp_path))
    chains = [_chain(seed) for seed in range(30)]
    on_ssd: set[bytes] = set()
    with Client(store.address, timeout_s=30.0) as client:
        client.register_namespace(NS)
        for keys in chains:
            client.put_chain(NS.id, keys, [_expected(k) for k in keys])
        for keys in chains:
            tiers = client.match(NS.id, keys).tiers
            on_ssd |= {k for k, t in zip(keys, tiers, strict=False) if t == "ssd"}
        extra = _chain(999)
        client.put_chain(NS.id, extra, [_expected(k) for k in extra])  # starts a demotion
    store.proc.kill()  # SIGKILL, likely while the demoter writes
    store.proc.wait(timeout=30)
    assert len(on_ssd) > 300

    restarted = store_factory(*_serve_args(tmp_path))
    with Client(restarted.address, timeout_s=30.0) as client:
        num_found = 0
        for keys in [*chains, extra]:  # no re-registration: the namespace was recovered
            got = client.get(NS.id, keys)
            for key, block in zip(keys, got.blocks, strict=True):
                if key in on_ssd:
                    assert block is not None, "a block written to SSD was lost"
                if block is not None:
                    assert np.array_equal(np.frombuffer(block, np.uint8), _expected(key))
                    num_found += 1
        stats = client.stats()
    assert num_found >= len(on_ssd)
    assert stats.checksum_failures == 0
