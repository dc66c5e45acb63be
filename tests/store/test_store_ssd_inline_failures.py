"""SSD writes that fail inside one store, when a put writes its DRAM victim inline (no
demotion pass: `INLINE_ONLY`). A failed write is one LMDB transaction that changed nothing,
so afterwards memory must describe the disk exactly (`check_integrity`): the victims it was
for are dropped from DRAM (a cache), and the SSD blocks, or SSD copies of DRAM blocks, it
was to delete to make room for them are back. `faults` makes `SsdTier.write` fail on
demand, for exact states.
"""

from __future__ import annotations

import logging

import pytest

from kvstore.store.eviction import POLICIES
from tests.store.ssd_fault_cases import (
    INLINE_ONLY,
    NS,
    Counts,
    chain,
    counts,
    fastest_tiers,
    make_store,
    payload,
    put,
)

# -- a put that writes its victim inline -----------------------------------------------


def test_a_put_whose_victim_fails_to_write_drops_it_and_lands(tmp_path, faults, caplog):
    caplog.set_level(logging.ERROR, logger="kvstore.store.tiering")
    with make_store(tmp_path / "ssd", dram_blocks=4, **INLINE_ONLY) as store:
        a, b, c = chain(4, seed=1), chain(1, seed=2), chain(1, seed=3)
        put(store, a)
        faults.fail_all()
        put(store, b)  # evicts a[0], whose write fails: it is dropped instead
        assert fastest_tiers(store, a + b) == (None, "dram", "dram", "dram", "dram")
        assert counts(store) == Counts(4, 0, evictions=1, drops=1, demotions=0, failures=1)
        assert "event=ssd_write_failed blocks=1 error=DiskError(" in caplog.text
        assert store.read(NS.id, a + b) == [None, *map(payload, a[1:] + b)]
        faults.heal()
        put(store, c)  # evicts a[1] (the read left it the oldest): written again
        assert fastest_tiers(store, a[1:2]) == ("ssd",)
        assert counts(store) == Counts(4, 1, evictions=2, drops=1, demotions=1, failures=1)
        assert store.read(NS.id, a[1:2]) == [payload(a[1])]
        store.check_integrity()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_reserve_whose_victims_all_fail_to_write_frees_them_all(tmp_path, faults, policy):
    with make_store(tmp_path / "ssd", 4, policy=policy, ssd_policy=policy, **INLINE_ONLY) as s:
        a, b = chain(4, seed=1), chain(3, seed=2)
        put(s, a)
        faults.fail_all()
        put(s, b)  # three victims from a, each dropped (written first where worth it)
        num_writes = faults.num_calls
        assert counts(s) == Counts(4, 0, evictions=3, drops=3, demotions=0, failures=num_writes)
        got = dict(zip(a + b, s.read(NS.id, a + b), strict=True))
        assert [got[k] for k in b] == list(map(payload, b))
        kept = [k for k in a if got[k] is not None]  # which one depends on the policy
        assert [got[k] for k in kept] == [payload(kept[0])]
        s.check_integrity()


def test_a_failed_write_keeps_the_ssd_blocks_it_was_to_delete(tmp_path, faults):
    with make_store(tmp_path / "ssd", dram_blocks=4, ssd_blocks=4, **INLINE_ONLY) as store:
        a, b, c = chain(4, seed=1), chain(4, seed=2), chain(1, seed=3)
        put(store, a)
        put(store, b)  # a goes to SSD, which it fills
        assert fastest_tiers(store, a + b) == ("ssd",) * 4 + ("dram",) * 4
        faults.fail_all()
        put(store, c)  # b[0]'s transaction was to delete a[0] and a[1] for room: none of it
        assert fastest_tiers(store, a + b + c) == ("ssd",) * 4 + (None,) + ("dram",) * 4
        assert counts(store) == Counts(4, 4, evictions=5, drops=1, demotions=4, failures=1)
        # Still failing: each SSD hit is promoted over a dropped victim, and reads exact.
        assert store.read(NS.id, a) == list(map(payload, a))
        store.check_integrity()
        assert counts(store).ssd == 4


def test_a_failed_write_gives_back_the_ssd_copies_of_dram_blocks(tmp_path, faults):
    with make_store(tmp_path / "ssd", dram_blocks=4, ssd_blocks=7, **INLINE_ONLY) as store:
        a, b, c, d = (chain(n, seed) for n, seed in ((4, 1), (4, 2), (1, 3), (1, 4)))
        put(store, a)
        put(store, b)  # a to SSD
        store.read(NS.id, a[:3])  # promoted over b[0:3], which go to SSD: it is full
        assert fastest_tiers(store, a + b) == ("dram",) * 3 + ("ssd",) * 4 + ("dram",)
        assert counts(store) == Counts(4, 7, evictions=7, drops=0, demotions=7, failures=0)
        faults.fail_all()
        put(store, c)  # b[3]'s write was to delete the SSD copies of a[0] and a[1]
        assert fastest_tiers(store, a + b + c) == ("dram",) * 3 + ("ssd",) * 4 + (None, "dram")
        assert counts(store) == Counts(4, 7, evictions=8, drops=1, demotions=7, failures=1)
        put(store, d)  # evicts a[0]: on SSD still, so freed without a write
        assert fastest_tiers(store, a[:1] + d) == ("ssd", "dram")
        assert counts(store) == Counts(4, 7, evictions=9, drops=1, demotions=7, failures=1)
        assert store.read(NS.id, a) == list(map(payload, a))
        store.check_integrity()
