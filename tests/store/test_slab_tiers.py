"""The slab tiers, DRAM and HBM, as one suite: allocator bookkeeping, slot placement, slab
reuse, a full tier, fit and misuse run on both (HBM on the host, `device="cpu"`: the same
code as on a GPU, its views torch tensors); capacity and the DRAM array on DRAM. HBM on a
GPU: `test_hbm.py`."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.store.tiers.base import Slot, TierStats
from kvstore.store.tiers.dram import DramTier
from kvstore.store.tiers.hbm import HbmTier
from kvstore.store.tiers.slab import SlabTier
from tests.conftest import require_extra

SLAB = 256
MakeTier = Callable[..., SlabTier]


@pytest.fixture(params=["dram", "hbm"])
def make_tier(request: pytest.FixtureRequest) -> MakeTier:
    """Makes a tier of the kind under test: `make_tier(num_slabs=4, slab_bytes=SLAB)`."""
    if request.param == "hbm":
        require_extra("torch")

    def make(num_slabs: int = 4, slab_bytes: int = SLAB) -> SlabTier:
        if request.param == "hbm":
            return HbmTier(num_slabs * slab_bytes, slab_bytes, device="cpu")
        return DramTier(num_slabs * slab_bytes, slab_bytes)

    return make


def _dram(num_slabs: int = 4, slab_bytes: int = SLAB) -> DramTier:
    return DramTier(num_slabs * slab_bytes, slab_bytes)


def _bytes(tier: SlabTier, slot: Slot) -> np.ndarray:
    """The slot's bytes as a writable uint8 array over the tier's own memory (a DRAM
    memoryview or a host torch tensor alike)."""
    return np.asarray(tier.view(slot))


def _pattern(seed: int, nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _check_integrity(tier: SlabTier, live: list[Slot]) -> None:
    """Stats match the live slots; slots are aligned, inside one slab each, and disjoint."""
    assert tier.stats() == TierStats(
        tier.num_slabs * tier.slab_bytes, sum(s.nbytes for s in live), len(live)
    )
    extents = sorted((s.offset, s.offset + tier.size_class(s.nbytes)) for s in live)
    for start, end in extents:
        assert start % 64 == 0
        assert 0 <= start < end <= tier.capacity_bytes
        assert start // tier.slab_bytes == (end - 1) // tier.slab_bytes  # never spans slabs
    for (_, end), (next_start, _) in itertools.pairwise(extents):
        assert end <= next_start


def _fill(tier: SlabTier, nbytes: int) -> list[Slot]:
    """Allocates `nbytes` slots until the tier refuses."""
    slots = []
    while (slot := tier.allocate(nbytes)) is not None:
        slots.append(slot)
    return slots


# --- bookkeeping --------------------------------------------------------------------------------


def test_new_tier_is_empty(make_tier: MakeTier) -> None:
    tier = make_tier()
    assert tier.stats() == TierStats(4 * SLAB, 0, 0)
    assert tier.has_free_slab()


def test_allocate_and_free_update_stats(make_tier: MakeTier) -> None:
    tier = make_tier()
    a = tier.allocate(10)
    assert a == Slot(0, 10)
    _check_integrity(tier, [a])
    b = tier.allocate(100)
    assert b == Slot(SLAB, 100)  # a new size class takes the next slab
    _check_integrity(tier, [a, b])
    assert tier.stats() == TierStats(4 * SLAB, 110, 2)
    tier.free(a)
    _check_integrity(tier, [b])
    tier.free(b)
    _check_integrity(tier, [])
    assert tier.stats() == TierStats(4 * SLAB, 0, 0)


def test_slots_are_handed_out_in_address_order(make_tier: MakeTier) -> None:
    tier = make_tier(num_slabs=2)
    slots = _fill(tier, 64)
    assert [s.offset for s in slots] == [i * 64 for i in range(8)]
    _check_integrity(tier, slots)


def test_freed_slot_is_reused(make_tier: MakeTier) -> None:
    tier = make_tier(num_slabs=1)
    a, b = tier.allocate(64), tier.allocate(64)
    assert (a, b) == (Slot(0, 64), Slot(64, 64))
    tier.free(a)
    _check_integrity(tier, [b])
    c = tier.allocate(30)  # same size class as a
    assert c == Slot(0, 30)
    _check_integrity(tier, [b, c])


# --- placement ----------------------------------------------------------------------------------


def test_mixed_sizes_never_overlap_and_keep_their_bytes(make_tier: MakeTier) -> None:
    tier = make_tier(num_slabs=16, slab_bytes=1024)
    sizes = [1, 63, 64, 65, 100, 128, 200, 256, 500, 1024]
    live: list[Slot] = []
    for i in range(1000):
        slot = tier.allocate(sizes[i % len(sizes)])
        if slot is None:
            continue
        view = _bytes(tier, slot)
        assert len(view) == slot.nbytes
        view[:] = np.frombuffer(_pattern(len(live), slot.nbytes), np.uint8)
        live.append(slot)
        _check_integrity(tier, live)
    # Slabs per class when the pool runs dry: 64B x2, 128B x3, 256B x3, 512B x3, 1024B x5.
    assert len(live) == 2 * 16 + 3 * 8 + 3 * 4 + 3 * 2 + 5 * 1
    for i, slot in enumerate(live):
        assert _bytes(tier, slot).tobytes() == _pattern(i, slot.nbytes)


def test_freeing_half_then_refilling_keeps_survivors_intact(make_tier: MakeTier) -> None:
    tier = make_tier(num_slabs=4)
    live = _fill(tier, 40)
    assert len(live) == 16
    for i, slot in enumerate(live):
        _bytes(tier, slot)[:] = np.frombuffer(_pattern(i, slot.nbytes), np.uint8)
    survivors = {i: s for i, s in enumerate(live) if i % 2}
    for i, slot in enumerate(live):
        if i % 2 == 0:
            tier.free(slot)
    _check_integrity(tier, list(survivors.values()))
    refill = _fill(tier, 50)
    assert len(refill) == 8
    for slot in refill:
        _bytes(tier, slot)[:] = 0xFF
    _check_integrity(tier, [*survivors.values(), *refill])
    for i, slot in survivors.items():
        assert _bytes(tier, slot).tobytes() == _pattern(i, slot.nbytes)


@pytest.mark.parametrize(
    ("nbytes", "slot_bytes"),
    [(0, 64), (1, 64), (63, 64), (64, 64), (65, 128), (128, 128), (129, 192), (256, 256)],
)
def test_size_class_rounds_up_to_64(make_tier: MakeTier, nbytes: int, slot_bytes: int) -> None:
    assert make_tier().size_class(nbytes) == slot_bytes


@pytest.mark.parametrize(("nbytes", "slot_bytes"), [(1, 64), (64, 64), (65, 128), (129, 192)])
def test_slots_are_spaced_by_size_class(make_tier: MakeTier, nbytes: int, slot_bytes: int) -> None:
    tier = make_tier(num_slabs=1)
    slots = _fill(tier, nbytes)
    assert slots == [Slot(i * slot_bytes, nbytes) for i in range(SLAB // slot_bytes)]
    _check_integrity(tier, slots)


# --- slabs --------------------------------------------------------------------------------------


def test_empty_slab_returns_and_serves_another_size_class(make_tier: MakeTier) -> None:
    tier = make_tier(num_slabs=1)
    small = _fill(tier, 64)
    assert len(small) == 4
    assert not tier.has_free_slab()
    assert tier.allocate(128) is None  # the only slab belongs to the 64-byte class
    for i, slot in enumerate(small[:-1]):
        tier.free(slot)
        _check_integrity(tier, small[i + 1 :])
        assert tier.allocate(128) is None  # slab still holds a 64-byte slot
    tier.free(small[-1])
    _check_integrity(tier, [])
    assert tier.has_free_slab()
    big = _fill(tier, 128)
    assert big == [Slot(0, 128), Slot(128, 128)]
    _check_integrity(tier, big)
    assert tier.allocate(64) is None  # and now the 64-byte class has no slab


def test_class_grows_into_a_second_slab_and_gives_it_back(make_tier: MakeTier) -> None:
    tier = make_tier(num_slabs=2)
    first = [tier.allocate(64) for _ in range(4)]
    extra = tier.allocate(64)
    assert extra == Slot(SLAB, 64)
    _check_integrity(tier, [*first, extra])
    tier.free(extra)
    _check_integrity(tier, first)
    assert tier.allocate(200) == Slot(SLAB, 200)


# --- full tier ----------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 64, 100, 256])
def test_allocate_when_full_returns_none_and_changes_nothing(
    make_tier: MakeTier, nbytes: int
) -> None:
    tier = make_tier(num_slabs=2)
    slots = _fill(tier, nbytes)
    assert len(slots) == 2 * (SLAB // tier.size_class(nbytes))
    before = tier.stats()
    assert tier.allocate(nbytes) is None
    assert tier.allocate(1) is None
    assert tier.stats() == before
    _check_integrity(tier, slots)
    tier.free(slots[0])
    assert tier.allocate(nbytes) == slots[0]  # the refusals left no hole or leak behind


@pytest.mark.parametrize(
    ("nbytes", "is_fit"),
    [
        (-1, False),
        (0, False),
        (1, True),
        (64, True),
        (SLAB - 1, True),
        (SLAB, True),
        (SLAB + 1, False),
    ],
)
def test_can_fit(make_tier: MakeTier, nbytes: int, is_fit: bool) -> None:
    tier = make_tier()
    assert tier.can_fit(nbytes) is is_fit


@pytest.mark.parametrize("nbytes", [0, SLAB + 1, 10 * SLAB])
def test_allocate_what_cannot_fit_returns_none(make_tier: MakeTier, nbytes: int) -> None:
    tier = make_tier()
    assert tier.allocate(nbytes) is None
    _check_integrity(tier, [])


# --- capacity -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "slab", "slab_bytes", "num_slabs"),
    [
        (1024, 256, 256, 4),
        (1000, 256, 256, 3),
        (1000, 300, 256, 3),  # slab size itself rounds down to 64
        (100, 256, 64, 1),  # slab clipped to the capacity, then to 64
        (64, 64, 64, 1),
        (256, 1 << 20, 256, 1),
    ],
)
def test_capacity_rounds_down_to_whole_slabs(
    capacity: int, slab: int, slab_bytes: int, num_slabs: int
) -> None:
    tier = DramTier(capacity, slab)
    assert (tier.slab_bytes, tier.num_slabs) == (slab_bytes, num_slabs)
    assert tier.capacity_bytes == slab_bytes * num_slabs
    assert tier.stats() == TierStats(slab_bytes * num_slabs, 0, 0)
    assert len(tier.array) == slab_bytes * num_slabs
    assert len(_fill(tier, 64)) == num_slabs * slab_bytes // 64


@pytest.mark.parametrize(("capacity", "slab"), [(0, 256), (63, 256), (1024, 63), (1024, 0)])
def test_too_small_capacity_or_slab_raises(capacity: int, slab: int) -> None:
    with pytest.raises(ValueError, match="at least 64"):
        DramTier(capacity, slab)


# --- misuse -------------------------------------------------------------------------------------


def test_double_free_of_last_slot_in_slab_asserts(make_tier: MakeTier) -> None:
    tier = make_tier()
    slot = tier.allocate(64)
    tier.free(slot)
    with pytest.raises(AssertionError, match="double free"):
        tier.free(slot)
    _check_integrity(tier, [])


def test_double_free_after_slab_moved_to_another_class_asserts(make_tier: MakeTier) -> None:
    tier = make_tier(num_slabs=1)
    slot = tier.allocate(64)
    tier.free(slot)
    other = tier.allocate(128)
    with pytest.raises(AssertionError, match="double free"):
        tier.free(slot)
    _check_integrity(tier, [other])


def test_double_free_with_live_neighbour_asserts(make_tier: MakeTier) -> None:
    tier = make_tier()
    slot, neighbour = tier.allocate(64), tier.allocate(64)
    tier.free(slot)
    with pytest.raises(AssertionError, match="double free"):
        tier.free(slot)
    _check_integrity(tier, [neighbour])


# --- views --------------------------------------------------------------------------------------


def test_array_views_the_same_memory_as_view() -> None:
    tier = _dram()
    a, b = tier.allocate(100), tier.allocate(300 - 100)
    arr = tier.array
    assert (arr.dtype, arr.shape) == (np.uint8, (4 * SLAB,))
    tier.view(a)[:] = _pattern(1, 100)
    assert arr[a.offset : a.offset + 100].tobytes() == _pattern(1, 100)
    arr[b.offset : b.offset + b.nbytes] = np.frombuffer(_pattern(2, b.nbytes), dtype=np.uint8)
    assert bytes(tier.view(b)) == _pattern(2, b.nbytes)
    assert bytes(tier.view(a)) == _pattern(1, 100)  # b's write stayed inside b
    _check_integrity(tier, [a, b])


def test_view_is_exactly_the_slot() -> None:
    tier = _dram(num_slabs=1)
    a, b = tier.allocate(10), tier.allocate(10)
    tier.view(b)[:] = b"\x00" * 10
    tier.view(a)[:] = b"\xaa" * 10
    assert len(tier.view(a)) == 10
    assert bytes(tier.view(b)) == b"\x00" * 10
    assert bytes(tier.array[10:64]) == b"\x00" * 54  # slot padding untouched
