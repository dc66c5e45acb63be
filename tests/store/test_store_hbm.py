"""The HBM tier inside the store: device copies of blocks read by device readers.

These run the tier on torch's CPU device (`hbm_device="cpu"`), the same code as on CUDA;
the CUDA runs are marked `gpu`.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.results import PutStatus
from kvstore.store import Lease, Store, StoreConfig
from kvstore.store.tiers.hbm import is_cuda_available
from tests.conftest import require_extra

torch = require_extra("torch")

NS = Namespace("hbm-model", KVLayout("float16", 2, 2, 16, 8))  # 1 KiB blocks
BLOCK = NS.block_bytes


def _make_store(hbm_blocks: int = 4, dram_blocks: int = 8, device: str = "cpu") -> Store:
    config = StoreConfig(
        dram_bytes=dram_blocks * BLOCK,
        slab_bytes=BLOCK,
        hbm_bytes=hbm_blocks * BLOCK,
        hbm_device=device,
        policy="prefix-lru",
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
        if res.statuses[i] is PutStatus.RESERVED:  # the others are already stored
            res.write(i, 0, _payload(key))
    res.commit()


def _read(store: Store, keys: list[bytes], device: bool) -> list:
    """(kind, bytes) of each view: "host" for a memoryview, else the tensor's device type."""
    with store.acquire(NS.id, keys, device=device) as lease:
        out = []
        for view in lease.views:
            if isinstance(view, memoryview):
                out.append(("host", bytes(view)))
            else:
                out.append((view.device.type, view.cpu().numpy().tobytes()))
        return out


def _usage(store: Store, tier: str):
    return next(t for t in store.stats().tiers if t.name == tier)


def test_a_device_read_copies_up_and_the_next_one_is_served_from_hbm():
    with _make_store() as store:
        keys = _chain(3)
        _put(store, keys)
        payloads = [_payload(k) for k in keys]
        assert _read(store, keys, device=True) == [("host", p) for p in payloads]
        assert store.match(NS.id, keys).tiers == ("hbm",) * 3
        assert _read(store, keys, device=True) == [("cpu", p) for p in payloads]
        assert _read(store, keys, device=False) == [("host", p) for p in payloads]
        hbm, dram = _usage(store, "hbm"), _usage(store, "dram")
        assert (hbm.num_blocks, hbm.hits, hbm.bytes_written) == (3, 3, 3 * BLOCK)
        assert (dram.num_blocks, dram.hits) == (3, 6)
        store.check_integrity()


def test_host_reads_never_copy_up():
    with _make_store() as store:
        keys = _chain(2)
        _put(store, keys)
        _read(store, keys, device=False)
        assert store.match(NS.id, keys).tiers == ("dram", "dram")
        assert _usage(store, "hbm").num_blocks == 0
        store.check_integrity()


def test_a_full_hbm_evicts_by_policy_but_never_a_leased_copy():
    with _make_store(hbm_blocks=2) as store:
        a, b = _chain(2, seed=1), _chain(2, seed=2)
        _put(store, a)
        _put(store, b)
        _read(store, a, device=True)  # copies a up: HBM full
        held = store.acquire(NS.id, a, device=True)  # served from HBM, and leased
        assert not any(isinstance(v, memoryview) for v in held.views)
        _read(store, b, device=True)  # a's copies are leased: b gets none
        assert store.match(NS.id, b).tiers == ("dram", "dram")
        assert [v.numpy().tobytes() for v in held.views] == [_payload(k) for k in a]
        held.release()
        _read(store, b, device=True)  # now a's copies go, tail first
        assert store.match(NS.id, b).tiers == ("hbm", "hbm")
        assert store.match(NS.id, a).tiers == ("dram", "dram")
        store.check_integrity()


def test_a_block_leaving_dram_leaves_hbm_and_a_leased_copy_is_freed_at_release():
    with _make_store(hbm_blocks=4, dram_blocks=4) as store:
        keys = _chain(2, seed=1)
        _put(store, keys)
        _read(store, keys, device=True)
        held = store.acquire(NS.id, keys, device=True)
        assert store.remove(NS.id, keys) == 2
        store.check_integrity()
        assert _usage(store, "hbm").num_blocks == 2  # still read by `held`
        assert [v.numpy().tobytes() for v in held.views] == [_payload(k) for k in keys]
        held.release()
        assert _usage(store, "hbm").num_blocks == 0
        other = _chain(4, seed=2)  # DRAM evicts the earlier blocks: their copies go too
        _put(store, other[:2])
        _read(store, other[:2], device=True)
        _put(store, _chain(4, seed=3))
        assert _usage(store, "hbm").num_blocks == 0
        store.check_integrity()


@pytest.mark.skipif(is_cuda_available(), reason="CUDA is present here")
def test_an_hbm_tier_without_cuda_is_a_config_error():
    with pytest.raises(errors.InvalidArgumentError, match="CUDA"):
        StoreConfig(hbm_bytes=1 << 20)
    with pytest.raises(errors.InvalidArgumentError, match="hbm_bytes"):
        StoreConfig(hbm_bytes=-1, hbm_device="cpu")


def test_ucx_gets_are_served_from_hbm_with_identical_bytes(store_factory):
    require_extra("ucxx")
    store = store_factory("--hbm-bytes", "1MiB", "--hbm-device", "cpu")
    with Client(store.address, timeout_s=10.0, transport="ucx") as client:
        client.register_namespace(NS)
        keys = _chain(8, seed=4)
        rng = np.random.default_rng(4)
        blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in keys]
        assert client.put_chain(NS.id, keys, blocks).num_stored == 8
        for _ in range(2):  # the first read copies up, the second is served from HBM
            out = [np.zeros(BLOCK, np.uint8) for _ in keys]
            assert client.get_into(NS.id, keys, out) == (True,) * 8
            assert all(np.array_equal(o, b) for o, b in zip(out, blocks, strict=True))
        hbm = next(t for t in client.stats().tiers if t.name == "hbm")
        assert (hbm.num_blocks, hbm.hits) == (8, 8)
        assert client.match(NS.id, keys).tiers == ("hbm",) * 8


@pytest.mark.gpu
@pytest.mark.skipif(not is_cuda_available(), reason="needs torch with CUDA")
def test_cuda_hbm_serves_device_views():
    with _make_store(device="cuda") as store:
        keys = _chain(3)
        _put(store, keys)
        _read(store, keys, device=True)
        assert _read(store, keys, device=True) == [("cuda", _payload(k)) for k in keys]
        store.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not is_cuda_available(), reason="needs torch with CUDA")
def test_ucx_get_from_cuda_hbm_into_device_tensors(store_factory):
    require_extra("ucxx")
    store = store_factory("--hbm-bytes", "1MiB")
    with Client(store.address, timeout_s=10.0, transport="ucx") as client:
        client.register_namespace(NS)
        keys = _chain(4, seed=5)
        blocks = [torch.randint(0, 256, (BLOCK,), dtype=torch.uint8) for _ in keys]
        assert client.put_chain(NS.id, keys, [b.numpy() for b in blocks]).num_stored == 4
        for _ in range(2):
            out = [torch.zeros(BLOCK, dtype=torch.uint8, device="cuda") for _ in keys]
            assert client.get_into(NS.id, keys, out) == (True,) * 4
            assert all(torch.equal(o.cpu(), b) for o, b in zip(out, blocks, strict=True))
        assert client.match(NS.id, keys).tiers == ("hbm",) * 4


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_every_tier_consistent(tmp_path, seed):
    """Puts, device and host reads, held leases, removes, demotions and promotions in a
    random order, on HBM + DRAM + SSD all under pressure: the store's invariants hold after
    each step, and every read returns the bytes that were put."""
    rng = np.random.default_rng(seed)
    config = StoreConfig(
        dram_bytes=6 * BLOCK,
        slab_bytes=BLOCK,
        hbm_bytes=3 * BLOCK,
        hbm_device="cpu",
        ssd_path=str(tmp_path / "ssd"),
        ssd_bytes=12 * BLOCK,
        policy="prefix-2q",
        ssd_policy="prefix-2q",
        background_demotion=False,
    )
    chains = [_chain(3, seed=s) for s in range(8)]
    held: list[Lease] = []
    with Store(config) as store:
        store.register_namespace(NS)
        for _ in range(150):
            keys = chains[rng.integers(len(chains))]
            action = rng.choice(["put", "device", "host", "hold", "release", "remove"])
            if action == "put":
                with contextlib.suppress(errors.StoreFullError):
                    _put(store, keys)
            elif action in ("device", "host", "hold"):
                lease = store.acquire(NS.id, keys, device=action != "host")
                for key, view in zip(keys, lease.views, strict=True):
                    if view is not None:
                        got = bytes(view) if isinstance(view, memoryview) else view.numpy()
                        assert bytes(got) == _payload(key)
                if action == "hold" and len(held) < 2:
                    held.append(lease)
                else:
                    lease.release()
            elif action == "release" and held:
                held.pop().release()
            elif action == "remove":
                store.remove(NS.id, keys[int(rng.integers(3)) :])
            store.check_integrity()
        for lease in held:
            lease.release()
        store.check_integrity()
        assert _usage(store, "hbm").hits > 0
