"""Fixtures of the store's tests."""

from __future__ import annotations

from collections.abc import Sequence

import lmdb
import pytest

from kvstore.store.tiers.base import Record
from kvstore.store.tiers.ssd import SsdTier
from tests.store.ssd_fault_cases import ENOSPC, Faults


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Faults:
    """`SsdTier.write` as `Faults` says, for this test (`tests.store.ssd_fault_cases`)."""
    faults = Faults()
    write = SsdTier.write

    def faulty_write(tier: SsdTier, records: Sequence[Record], delete: Sequence[bytes] = ()):
        faults.num_calls += 1
        faults.before(records, delete)
        if faults.should_fail(records, delete):
            raise lmdb.DiskError(ENOSPC)
        write(tier, records, delete)

    monkeypatch.setattr(SsdTier, "write", faulty_write)
    return faults
