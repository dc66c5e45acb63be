"""A real store whose SSD directory is a filesystem far smaller than `--ssd-bytes`: its SSD
writes fail with ENOSPC, and the node must keep serving without returning a wrong byte.

SSD writes come from two places: the background demoter (DRAM past its high watermark)
and a put that finds DRAM full and writes its victim inline. Watermarks of 1.0 leave the
demoter idle, so only the inline path writes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from tests.conftest import StoreProcess, mounted_tmpfs, wait_until

NS = Namespace("full-disk-model", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
BLOCK = NS.block_bytes
DISK_BYTES = 1 << 20  # room for about 30 blocks
DRAM_BLOCKS = 64
INLINE_ONLY = ("--dram-high-watermark", "1.0", "--dram-low-watermark", "1.0")
FILL_LEN = {"inline": 16, "demoter": 7}  # 7: over the high watermark, never over DRAM
MAX_PUTS = 24  # 384 blocks: 6x DRAM, 12x what the disk holds


def _chain(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, np.arange(n * NS.block_tokens) + seed * 1_000_000)


def _payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(list(key)).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of DISK_BYTES; request it before `store_factory`, so it is unmounted after
    the store has stopped."""
    with mounted_tmpfs(tmp_path / "small-disk", DISK_BYTES) as path:
        yield path


def _start(store_factory, disk: Path, path: str) -> StoreProcess:
    return store_factory(
        "--dram-bytes", str(DRAM_BLOCKS * BLOCK), "--slab-bytes", str(16 * BLOCK),
        "--ssd-path", str(disk), "--ssd-bytes", str(256 * BLOCK), "--dataplane", "none",
        "--policy", "lru", "--ssd-policy", "lru",
        *(INLINE_ONLY if path == "inline" else ()),
    )  # fmt: skip


def _is_settled(client: Client, store: StoreProcess) -> bool:
    """The demoter is done: DRAM is back under its high watermark, or a write failed."""
    dram = next(t for t in client.stats().tiers if t.name == "dram")
    return dram.num_blocks <= 0.95 * DRAM_BLOCKS or "event=ssd_write_failed" in store.log()


def _fill(client: Client, store: StoreProcess, path: str) -> tuple[list[bytes], list[Exception]]:
    """Puts chains until SSD writes fail; returns every key tried and the put errors."""
    client.register_namespace(NS)
    tried: list[bytes] = []
    failures: list[Exception] = []
    if path == "demoter":  # DRAM just under its high watermark; each 7 more demote 7
        tried = _chain(54, seed=999)
        client.put_chain(NS.id, tried, [_payload(k) for k in tried])
    for seed in range(MAX_PUTS):
        keys = _chain(FILL_LEN[path], seed)
        tried += keys
        try:
            client.put_chain(NS.id, keys, [_payload(k) for k in keys])
        except errors.KVStoreError as exc:
            failures.append(exc)
        if path == "demoter":
            wait_until(lambda: _is_settled(client, store), 30.0, "the demoter settled")
        if failures or "event=ssd_write_failed" in store.log():
            return tried, failures
    pytest.fail("the disk never filled")


def _put_more(client: Client, tried: list[bytes]) -> list[Exception]:
    """After the disk filled: a DRAM's worth more of 4-block chains; returns the errors."""
    failures: list[Exception] = []
    for seed in range(100, 100 + DRAM_BLOCKS // 4):
        keys = _chain(4, seed)
        tried += keys
        try:
            client.put_chain(NS.id, keys, [_payload(k) for k in keys])
        except errors.KVStoreError as exc:
            failures.append(exc)
    return failures


def _assert_nothing_wrong(client: Client, keys: list[bytes]) -> None:
    got = client.get(NS.id, keys).blocks
    for key, block in zip(keys, got, strict=True):
        assert block is None or bytes(block) == _payload(key).tobytes(), "wrong bytes"
    assert sum(b is not None for b in got) >= DRAM_BLOCKS // 2


def _num_in_dram(client: Client, keys: list[bytes]) -> int:
    return sum(client.match(NS.id, [k]).tiers == ("dram",) for k in keys)


def _dram_blocks(client: Client) -> int:
    return next(t for t in client.stats().tiers if t.name == "dram").num_blocks


def _dram_blocks_and_keys(client: Client, keys: list[bytes]) -> tuple[int, int]:
    """DRAM's block count and how many of `keys` it holds, read while nothing changed.

    With puts over, only the demoter changes DRAM, and only by taking blocks out: on a
    full disk it retries with backoff and drops what it could not write. A count the
    block total did not move across is one snapshot; a pass in between is read again.
    """
    for _ in range(10):
        before = _dram_blocks(client)
        num_in_dram = _num_in_dram(client, keys)
        if _dram_blocks(client) == before:
            return before, num_in_dram
    pytest.fail("DRAM kept changing with no puts")


@pytest.mark.parametrize("path", ["inline", "demoter"])
def test_a_full_disk_never_crashes_the_node_or_returns_wrong_bytes(small_disk, store_factory, path):
    store = _start(store_factory, small_disk, path)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        tried, _ = _fill(client, store, path)
        _put_more(client, tried)  # whatever they answer
        assert store.proc.poll() is None, f"the node died:\n{store.log()}"
        assert client.health()
        _assert_nothing_wrong(client, tried)
        stats = client.stats()
        assert (stats.num_leases, stats.num_reservations, stats.checksum_failures) == (0, 0, 0)
    # Teardown: SIGTERM, and the node must exit 0.


@pytest.mark.parametrize("path", ["inline", "demoter"])
def test_puts_on_a_full_disk_land_or_fail_typed_and_leak_nothing(small_disk, store_factory, path):
    store = _start(store_factory, small_disk, path)
    with Client(store.address, timeout_s=30.0, transport="grpc") as client:
        tried, failures = _fill(client, store, path)
        failures += _put_more(client, tried)
        stats = client.stats()
        assert (stats.num_leases, stats.num_reservations) == (0, 0)
        for exc in failures:  # typed, and never "full" with nothing leased or reserved
            assert type(exc) is not errors.KVStoreError, exc
            assert not isinstance(exc, errors.StoreFullError), exc
        num_blocks, num_in_dram = _dram_blocks_and_keys(client, tried)
        assert num_blocks == num_in_dram, "DRAM slots of no block"
        busy_s = _cpu_seconds(store.proc.pid, over_s=2.0)
        assert busy_s < 1.0, f"an idle node used {busy_s:.1f} s of CPU in 2 s"


def _cpu_seconds(pid: int, over_s: float) -> float:
    """CPU time process `pid` uses over the next `over_s` seconds."""

    def ticks() -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    before = ticks()
    time.sleep(over_s)  # a measurement window, not a wait for a condition
    return (ticks() - before) / os.sysconf("SC_CLK_TCK")
