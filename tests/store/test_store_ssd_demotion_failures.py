"""SSD writes that fail inside one store, in the demotion pass: run by `commit` here
(background demotion off), or by the background demoter. A failed write is one LMDB
transaction that changed nothing, so afterwards memory must describe the disk exactly
(`check_integrity`): its victims are dropped from DRAM (a cache) unless read meanwhile,
nothing stays pinned, a victim removed meanwhile is gone (its record too, or kept where
deleting it failed), and the demoter waits before it tries again. `faults` makes
`SsdTier.write` fail on demand, for exact states.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvstore.store.tiering import demoter
from kvstore.store.tiers.base import Record
from tests.conftest import wait_until
from tests.store.ssd_fault_cases import (
    NS,
    Counts,
    chain,
    counts,
    fastest_tiers,
    make_store,
    payload,
    put,
    put_unchecked,
    writes_record_of,
)

# -- the demotion pass -----------------------------------------------------------------


def test_a_failed_demotion_drops_its_victims_and_pins_nothing(tmp_path, faults):
    with make_store(tmp_path / "ssd") as store:
        a, b = chain(8, seed=1), chain(2, seed=2)
        faults.fail_all()
        put(store, a)  # 8 of 8 blocks: a[0] and a[1] are to go to SSD, and fail to
        assert fastest_tiers(store, a) == (None, None) + ("dram",) * 6
        assert counts(store) == Counts(6, 0, evictions=2, drops=2, demotions=0, failures=1)
        assert store.read(NS.id, a) == [None, None, *map(payload, a[2:])]
        faults.heal()
        put(store, b)  # over the high watermark again: a[2] and a[3] go to SSD
        assert fastest_tiers(store, a[2:4]) == ("ssd", "ssd")
        assert counts(store) == Counts(6, 2, evictions=4, drops=2, demotions=2, failures=1)
        assert store.demote_now() == 0  # at the low watermark: nothing left to do
        store.check_integrity()


def test_a_victim_read_during_a_failed_demotion_stays_in_dram(tmp_path, faults):
    with make_store(tmp_path / "ssd") as store:
        a = chain(8, seed=1)
        leases = []

        def read_a0(records: Sequence[Record], delete: Sequence[bytes]) -> None:
            leases.append(store.acquire(NS.id, a[:1]))
            faults.before = lambda records, delete: None

        faults.before = read_a0
        faults.fail_all()
        put(store, a)  # a[0] is leased while its write fails; a[1] is dropped
        assert fastest_tiers(store, a) == ("dram", None) + ("dram",) * 6
        assert counts(store) == Counts(7, 0, 1, drops=1, demotions=0, failures=1, leases=1)
        assert bytes(leases[0].views[0]) == payload(a[0])
        leases[0].release()
        store.check_integrity()
        faults.heal()
        assert store.demote_now() == 1  # down to the low watermark: a[2], the oldest now
        assert fastest_tiers(store, a[:3]) == ("dram", None, "ssd")
        store.check_integrity()


def test_a_victim_removed_during_a_failed_demotion_is_gone(tmp_path, faults):
    with make_store(tmp_path / "ssd") as store:
        a = chain(8, seed=1)
        faults.before = lambda records, delete: store.remove(NS.id, a[:1])
        faults.fail_all()
        put(store, a)
        assert fastest_tiers(store, a) == (None, None) + ("dram",) * 6
        assert counts(store) == Counts(6, 0, evictions=1, drops=1, demotions=0, failures=1)
        store.check_integrity()


def test_a_removed_victim_whose_record_fails_to_go_stays_on_ssd(tmp_path, faults):
    with make_store(tmp_path / "ssd") as store:
        a = chain(8, seed=1)
        removed = []

        def remove_a0(records: Sequence[Record], delete: Sequence[bytes]) -> None:
            if records:  # the demotion's write, not the delete of a[0]'s record after it
                removed.append(store.remove(NS.id, a[:1]))

        faults.before = remove_a0
        faults.should_fail = lambda records, delete: not records
        put(store, a)  # a[0] and a[1] written; a[0], removed meanwhile, keeps its record
        assert removed == [1]
        assert fastest_tiers(store, a) == ("ssd", "ssd") + ("dram",) * 6
        assert counts(store) == Counts(6, 2, evictions=1, drops=0, demotions=1, failures=1)
        assert store.read(NS.id, a[:1]) == [payload(a[0])]
        store.check_integrity()


def test_a_failed_demotion_deletes_the_record_of_a_copy_removed_meanwhile(tmp_path, faults):
    with make_store(tmp_path / "ssd", ssd_blocks=4) as store:
        a, b = chain(8, seed=1), chain(1, seed=2)
        put(store, a)  # a[0] and a[1] to SSD
        store.read(NS.id, a[:2])  # promoted into free slots: SSD copies of DRAM blocks
        removed = []

        def remove_a0(records: Sequence[Record], delete: Sequence[bytes]) -> None:
            if writes_record_of(a[3])(records, delete):
                removed.append(store.remove(NS.id, a[:1]))

        faults.before = remove_a0
        faults.should_fail = writes_record_of(a[3])
        # b[0] evicts a[2] (written); its commit demotes a[3] and a[4], whose transaction was
        # to delete the SSD copies of a[0] (removed meanwhile) and a[1]: it fails.
        put(store, b)
        assert removed == [1]
        assert fastest_tiers(store, a + b) == (None, "dram", "ssd", None, None) + ("dram",) * 4
        assert counts(store) == Counts(5, 2, evictions=5, drops=2, demotions=3, failures=1)
        assert store.read(NS.id, a[1:3]) == [payload(a[1]), payload(a[2])]
        store.check_integrity()


# -- the background demoter ------------------------------------------------------------


def test_the_demoter_waits_while_writes_fail_and_resumes_after_one_succeeds(
    tmp_path, faults, monkeypatch
):
    # Only a good write ends its wait.
    monkeypatch.setattr(demoter, "DEFAULT_BACKOFF", demoter.Backoff(3600.0, 3600.0))
    with make_store(tmp_path / "ssd", background_demotion=True) as store:
        a, b, c = chain(8, seed=1), chain(2, seed=2), chain(1, seed=3)
        faults.fail_all()
        put_unchecked(store, a)
        dropped = Counts(6, 0, evictions=2, drops=2, demotions=0, failures=1)
        wait_until(lambda: counts(store) == dropped, 10.0, "the demoter dropped a[0:2]")
        store.check_integrity()
        put(store, b)  # over the high watermark again, while the demoter waits
        time.sleep(0.3)  # a measurement window, not a wait for a condition
        assert (faults.num_calls, counts(store).dram) == (1, 8)
        faults.heal()
        put_unchecked(store, c)  # DRAM is full: c evicts a[2] inline, and that write succeeds
        written = Counts(6, 3, evictions=5, drops=2, demotions=3, failures=1)
        wait_until(lambda: counts(store) == written, 10.0, "the demoter wrote a[3:5]")
        assert fastest_tiers(store, a[2:5]) == ("ssd",) * 3
        store.check_integrity()


def test_the_demoter_tries_again_after_its_backoff(tmp_path, faults):
    with make_store(tmp_path / "ssd", background_demotion=True) as store:
        a, b = chain(8, seed=1), chain(2, seed=2)
        faults.fail_all()
        put_unchecked(store, a)
        dropped = Counts(6, 0, evictions=2, drops=2, demotions=0, failures=1)
        wait_until(lambda: counts(store) == dropped, 10.0, "the demoter dropped a[0:2]")
        faults.heal()
        put_unchecked(store, b)  # within its first backoff, or after it: written either way
        written = Counts(6, 2, evictions=4, drops=2, demotions=2, failures=1)
        wait_until(lambda: counts(store) == written, 10.0, "the demoter wrote a[2:4]")
        store.check_integrity()
