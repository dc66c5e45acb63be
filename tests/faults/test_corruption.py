"""Damaged bytes under a real store: an SSD record's header or payload altered in the LMDB
file of a stopped node, and a DRAM slot altered in a running node's memory.

Records are found by scanning for the payload bytes a test wrote (random, so they occur
once), never by the file's key layout.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.store.tiers.base import RecordHeader
from kvstore.store.tiers.ssd import encode_header

NS = Namespace("corrupt-model", KVLayout("float16", 4, 2, 64, 16))  # 32 KiB blocks
BLOCK = NS.block_bytes
HEADER_BYTES = len(encode_header(RecordHeader(bytes(32), None, 0, 0, 0)))
KEYS = block_keys(NS, np.arange(8 * NS.block_tokens))


def _payload(key: bytes) -> np.ndarray:
    return np.random.default_rng(list(key)).integers(0, 256, BLOCK, dtype=np.uint8)


def _ssd_args(ssd: Path) -> tuple[str, ...]:
    # Watermarks near zero and inline demotion: every committed block is on SSD at once.
    return (
        "--dram-bytes", str(64 * BLOCK), "--slab-bytes", str(16 * BLOCK),
        "--ssd-path", str(ssd), "--ssd-bytes", str(64 * BLOCK), "--dataplane", "none",
        "--dram-high-watermark", "0.01", "--dram-low-watermark", "0.01",
        "--background-demotion", "false",
    )  # fmt: skip


def _client(store) -> Client:
    return Client(store.address, timeout_s=30.0, transport="grpc")


def _tier(client: Client, name: str):
    return next(t for t in client.stats().tiers if t.name == name)


def _stored_on_ssd(store_factory, ssd: Path) -> None:
    """Puts KEYS through a node that demotes them all, then stops it."""
    store = store_factory(*_ssd_args(ssd))
    with _client(store) as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, KEYS, [_payload(k) for k in KEYS])
        assert client.match(NS.id, KEYS).tiers == ("ssd",) * len(KEYS)
    assert store.stop() == 0


def _damage_file(path: Path, key: bytes, start: int, nbytes: int) -> None:
    """Flips `nbytes` bytes at `start` relative to the first byte of `key`'s payload."""
    data = bytearray(path.read_bytes())
    found = [m.start() for m in re.finditer(re.escape(_payload(key)[:256].tobytes()), data)]
    assert len(found) == 1, f"payload of {key.hex()[:12]} found {len(found)} times"
    at = found[0] + start
    data[at : at + nbytes] = bytes(b ^ 0xFF for b in data[at : at + nbytes])
    path.write_bytes(data)


def _assert_served_except(client: Client, damaged: bytes) -> None:
    got = client.get(NS.id, KEYS).blocks
    for key, block in zip(KEYS, got, strict=True):
        if key == damaged:
            assert block is None, "damaged bytes were returned"
        else:
            assert block is not None and bytes(block) == _payload(key).tobytes()


def test_a_damaged_record_header_is_dropped_at_start_up(tmp_path, store_factory):
    ssd = tmp_path / "ssd"
    _stored_on_ssd(store_factory, ssd)
    damaged = KEYS[5]
    _damage_file(ssd / "data.mdb", damaged, -HEADER_BYTES, HEADER_BYTES)

    store = store_factory(*_ssd_args(ssd))
    with _client(store) as client:
        stats = client.stats()  # before any read: counted while recovering
        assert (stats.checksum_failures, stats.num_blocks) == (1, 7)
        assert _tier(client, "ssd").num_blocks == 7
        assert client.match(NS.id, KEYS).num_matched == 5
        _assert_served_except(client, damaged)
        assert client.stats().checksum_failures == 1
    assert store.stop() == 0

    store = store_factory(*_ssd_args(ssd))  # the record was deleted, not kept for later
    with _client(store) as client:
        assert (client.stats().checksum_failures, client.stats().num_blocks) == (0, 7)


def test_damaged_ssd_bytes_are_counted_removed_and_never_returned(tmp_path, store_factory):
    ssd = tmp_path / "ssd"
    _stored_on_ssd(store_factory, ssd)
    damaged = KEYS[2]
    _damage_file(ssd / "data.mdb", damaged, BLOCK // 2, 1)

    store = store_factory(*_ssd_args(ssd))
    with _client(store) as client:
        assert client.stats().checksum_failures == 0  # the header is intact
        _assert_served_except(client, damaged)
        stats = client.stats()
        assert (stats.checksum_failures, stats.num_blocks) == (1, 7)
        assert client.match(NS.id, [damaged]).num_matched == 0  # removed
        assert client.get(NS.id, [damaged]).blocks == (None,)
        assert client.stats().checksum_failures == 1  # not found again, not counted again
    assert store.stop() == 0

    store = store_factory(*_ssd_args(ssd))
    with _client(store) as client:
        assert client.stats().num_blocks == 7
        assert client.match(NS.id, [damaged]).num_matched == 0


def _damage_memory(pid: int, pattern: bytes, min_region_bytes: int) -> int:
    """Flips the first byte of every copy of `pattern` in the writable mappings of process
    `pid` of at least `min_region_bytes`; returns how many it altered."""
    regions = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if perms.startswith("rw") and end - start >= min_region_bytes:
            regions.append((start, end))
    num_altered = 0
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for start, end in regions:
            mem.seek(start)
            data = mem.read(end - start)
            for match in re.finditer(re.escape(pattern), data):
                mem.seek(start + match.start())
                mem.write(bytes([pattern[0] ^ 0xFF]))
                num_altered += 1
    return num_altered


def test_damaged_dram_bytes_fail_their_checksum_with_verify_reads(store_factory):
    dram_bytes = 64 * BLOCK
    store = store_factory(
        "--dram-bytes", str(dram_bytes), "--slab-bytes", str(16 * BLOCK),
        "--verify-reads", "true", "--dataplane", "none",
    )  # fmt: skip
    with _client(store) as client:
        client.register_namespace(NS)
        client.put_chain(NS.id, KEYS, [_payload(k) for k in KEYS])
        damaged = KEYS[3]
        try:
            num_altered = _damage_memory(
                store.proc.pid, _payload(damaged)[:256].tobytes(), dram_bytes
            )
        except PermissionError as exc:
            pytest.skip(f"cannot write another process's memory here: {exc}")
        assert num_altered >= 1
        _assert_served_except(client, damaged)
        stats = client.stats()
        assert (stats.checksum_failures, stats.num_blocks) == (1, 7)
        assert client.match(NS.id, [damaged]).num_matched == 0
        assert _tier(client, "dram").num_blocks == 7  # its slot was freed
