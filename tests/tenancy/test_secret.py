"""The tenant secret: read from a file, or kept beside the SSD tier so that a restarted
node maps every tenant to the same internal ids (and serves what they stored), on a real
`kvstore serve`."""

from __future__ import annotations

import stat

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.tenancy.secret import SSD_SECRET_NAME, load_secret, read_secret

NS = Namespace("secret-model", KVLayout("float16", 2, 2, 16, 16))  # 4 KiB blocks
BLOCK = NS.block_bytes
TOKENS = {"team-a": "token-of-team-a-0123456789", "team-b": "token-of-team-b-9876543210"}


def test_a_secret_file_holds_hex_of_32_bytes_or_more(tmp_path):
    path = tmp_path / "secret"
    path.write_text("ab" * 32 + "\n")
    assert read_secret(path) == bytes([0xAB]) * 32
    for bad in ("ab" * 31, "not hex at all", ""):
        path.write_text(bad)
        with pytest.raises(errors.InvalidArgumentError):
            read_secret(path)
    with pytest.raises(errors.InvalidArgumentError):
        read_secret(tmp_path / "missing")
    assert load_secret("", "") != load_secret("", "")  # no file, no SSD: one per start
    kept = load_secret("", str(tmp_path / "ssd"))
    assert load_secret("", str(tmp_path / "ssd")) == kept
    mode = (tmp_path / "ssd" / SSD_SECRET_NAME).stat().st_mode
    assert stat.S_IMODE(mode) == 0o600


def _expected(key: bytes) -> np.ndarray:
    return np.tile(np.frombuffer(key, dtype=np.uint8), BLOCK // len(key))


def test_a_restarted_node_serves_each_tenant_its_own(tmp_path, store_factory):
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} {token}\n" for t, token in TOKENS.items()))
    flags = (
        *("--dram-bytes", str(64 * BLOCK), "--slab-bytes", str(16 * BLOCK)),
        *("--ssd-path", str(tmp_path / "ssd"), "--ssd-bytes", str(4096 * BLOCK)),
        *("--auth-token-file", str(tokens)),
    )
    chains = [block_keys(NS, np.arange(16 * 16) + seed * 1_000_000) for seed in range(12)]
    store = store_factory(*flags)
    with Client(store.address, timeout_s=30.0, auth_token=TOKENS["team-a"]) as a:
        a.register_namespace(NS)
        for keys in chains:
            a.put_chain(NS.id, keys, [_expected(k) for k in keys])
        on_ssd = {
            k
            for keys in chains
            for k, t in zip(keys, a.match(NS.id, keys).tiers, strict=False)
            if t == "ssd"
        }
    assert store.stop() == 0 and on_ssd
    assert (tmp_path / "ssd" / SSD_SECRET_NAME).exists()
    again = store_factory(*flags)
    with Client(again.address, timeout_s=30.0, auth_token=TOKENS["team-a"]) as a:
        got = [a.get(NS.id, keys) for keys in chains]  # no re-registration: recovered
    found = {
        k: b
        for keys, g in zip(chains, got, strict=True)
        for k, b in zip(keys, g.blocks, strict=True)
    }
    assert all(found[k] is not None for k in on_ssd)
    assert all(np.array_equal(np.frombuffer(found[k], np.uint8), _expected(k)) for k in on_ssd)
    with Client(again.address, timeout_s=30.0, auth_token=TOKENS["team-b"]) as b:
        b.register_namespace(NS)
        assert all(b.get(NS.id, keys).num_found == 0 for keys in chains)
    assert again.stop() == 0
    other = tmp_path / "other-secret"
    other.write_text("cd" * 32 + "\n")
    renamed = store_factory(*flags, "--tenant-secret-file", str(other))
    with Client(renamed.address, timeout_s=30.0, auth_token=TOKENS["team-a"]) as a:
        unknown = pytest.raises(errors.UnknownNamespaceError)  # another secret, other ids
        with unknown:
            a.match(NS.id, chains[0])
