"""A real store killed with SIGKILL exactly inside its SSD write transaction, then restarted.

The `ssd_write_in_txn` failpoint pauses the demoter after it has put its batch (and the
deletes that make room for it) into the LMDB transaction, before the commit; the test
waits for the failpoint's marker and kills the process there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import wait_until

NS = Namespace("crash-model", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
OTHER_NS = Namespace("crash-model-b", KVLayout("float16", 4, 2, 64, 16))
BLOCK = NS.block_bytes
DRAM_BLOCKS = 64  # high watermark 0.95: 60.8 blocks; low 0.85: 54.4
NUM_PUT = 61  # one block over the high watermark: the demoter writes 7
NUM_DEMOTED = 7
FAILPOINT = "ssd_write_in_txn"


def _chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(list(key)).integers(0, 256, BLOCK, dtype=np.uint8)


def _serve_args(ssd: Path, sync: str) -> tuple[str, ...]:
    # The SSD holds exactly one batch, so the second batch must delete the first to fit.
    return (
        "--dram-bytes", str(DRAM_BLOCKS * BLOCK), "--slab-bytes", str(16 * BLOCK),
        "--policy", "lru", "--ssd-policy", "lru", "--dataplane", "none",
        "--ssd-path", str(ssd), "--ssd-bytes", str(NUM_DEMOTED * BLOCK), "--ssd-sync", sync,
    )  # fmt: skip


def _tier(client: Client, name: str):
    return next(t for t in client.stats().tiers if t.name == name)


def _is_demoted(client: Client) -> bool:
    ssd, dram = _tier(client, "ssd"), _tier(client, "dram")
    return (ssd.num_blocks, dram.num_blocks) == (NUM_DEMOTED, NUM_PUT - NUM_DEMOTED)


def _assert_exact(got: bytearray | None, key: bytes) -> None:
    assert got is not None, f"block {key.hex()[:12]} is missing"
    assert bytes(got) == _payload(key).tobytes(), f"block {key.hex()[:12]} differs"


@pytest.mark.parametrize("sync", ["false", "true"])
def test_sigkill_inside_the_ssd_transaction_loses_that_batch_whole(tmp_path, store_factory, sync):
    ssd, markers = tmp_path / "ssd", tmp_path / "failpoints"
    markers.mkdir()
    args = _serve_args(ssd, sync)
    first = _chain(NUM_PUT, seed=1)

    # 1: a batch reaches SSD (the background demoter's transaction commits), then a crash.
    store = store_factory(*args)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, first, [_payload(k) for k in first])
        wait_until(lambda: _is_demoted(client), 30.0, "the first batch demoted to SSD")
        tiers = client.match(NS.id, first).tiers
    on_ssd = [k for k, t in zip(first, tiers, strict=False) if t == "ssd"]
    assert len(on_ssd) == NUM_DEMOTED
    store.kill()

    # 2: the next batch is in the transaction, with the deletes that make room for it.
    env = {"KVSTORE_FAILPOINTS": f"{FAILPOINT}=pause", "KVSTORE_FAILPOINT_DIR": str(markers)}
    store = store_factory(*args, env=env)
    second = _chain(NUM_PUT, seed=2)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        assert client.match(NS.id, on_ssd).tiers == ("ssd",) * NUM_DEMOTED  # recovered
        client.register_namespace(OTHER_NS)  # its own transaction, committed
        client.put_chain(NS.id, second, [_payload(k) for k in second])
        wait_until((markers / FAILPOINT).exists, 30.0, "the demoter paused inside its write")
        # The write is off the request path: the node serves while the demoter is stuck.
        assert client.health()
        assert client.match(NS.id, second).num_matched == NUM_PUT
        _assert_exact(client.get(NS.id, [second[0]]).blocks[0], second[0])
    store.kill()

    # 3: everything committed to SSD before that batch, and nothing of the batch.
    store = store_factory(*_serve_args(ssd, "false"))
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        stats = client.stats()
        assert (stats.num_namespaces, stats.num_blocks, stats.checksum_failures) == (2, 7, 0)
        got = client.get(NS.id, first).blocks  # no re-registration: recovered
        for key, block in zip(first, got, strict=True):
            if key in on_ssd:
                _assert_exact(block, key)
            else:  # only ever in DRAM: a miss after the crash, never an error
                assert block is None
        assert client.get(NS.id, second).blocks == (None,) * NUM_PUT  # lost whole
        third = _chain(4, seed=3)
        assert client.put_chain(NS.id, third, [_payload(k) for k in third]).num_stored == 4
        for key, block in zip(third, client.get(NS.id, third).blocks, strict=True):
            _assert_exact(block, key)
    health = [sys.executable, "-m", "kvstore.cli", "health", "--address", store.address]
    assert subprocess.run(health, capture_output=True, timeout=60).returncode == 0
