"""The HBM tier: a CUDA pool, device-to-device copies. Skipped without CUDA."""

from __future__ import annotations

import pytest

from kvstore.store.tiers.hbm import HbmTier, is_cuda_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not is_cuda_available(), reason="needs torch with CUDA"),
]


def test_blocks_round_trip_on_device_without_host_copies():
    import torch

    tier = HbmTier(4 << 20, slab_bytes=1 << 20)
    pages = torch.randn(4, 2, 16, 64, device="cuda", dtype=torch.float16)  # (blocks, kv, T, D)
    slots = [tier.allocate(pages[i].numel() * 2) for i in range(4)]
    for i, slot in enumerate(slots):
        tier.write_from(slot, pages[i])
    out = torch.empty_like(pages)
    for i, slot in enumerate(slots):
        tier.read_into(slot, out[i])
    tier.synchronize()
    assert tier.view(slots[0]).device.type == "cuda"
    assert torch.equal(out, pages)
    assert tier.stats().num_slots == 4
    for slot in slots:
        tier.free(slot)
    assert tier.stats().used_bytes == 0


def test_full_tier_refuses_and_views_do_not_overlap():
    import torch

    tier = HbmTier(1 << 20, slab_bytes=256 << 10)
    slots = [tier.allocate(256 << 10) for _ in range(4)]
    assert tier.allocate(64) is None
    for i, slot in enumerate(slots):
        tier.view(slot).fill_(i)
    for i, slot in enumerate(slots):
        assert torch.all(tier.view(slot) == i)
