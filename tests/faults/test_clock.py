"""Clock jumps: leases and reservations expire by the store's own clock only (by default
time.monotonic, which a wall-clock jump does not move), and an injected clock that jumps
back or far ahead breaks nothing: each deadline is its creation time plus its timeout, on
that clock."""

from __future__ import annotations

import dataclasses
import time

from kvstore.keys import KVLayout, Namespace, block_keys
from kvstore.store import Store, StoreConfig

NS = Namespace("clock-model", KVLayout("float16", 2, 2, 16, 8))  # 1 KiB blocks
BLOCK = NS.block_bytes
RESERVATION_S, LEASE_S = 10.0, 20.0


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _make_store(clock=time.monotonic) -> Store:
    config = StoreConfig(
        dram_bytes=16 * BLOCK,
        slab_bytes=4 * BLOCK,
        reservation_timeout_s=RESERVATION_S,
        lease_timeout_s=LEASE_S,
    )
    store = Store(config, clock=clock)
    store.register_namespace(NS)
    return store


def _keys(n: int, seed: int) -> list[bytes]:
    return block_keys(NS, [seed * 100_000 + t for t in range(n * NS.block_tokens)])


def _put(store: Store, keys: list[bytes]) -> None:
    res = store.reserve(NS.id, keys)
    for i in range(len(keys)):
        res.write(i, 0, bytes([i]) * BLOCK)
    res.commit()


def _open(store: Store) -> tuple[int, int]:
    """Number of (leases, reservations) still open after an expiry sweep."""
    store.expire()
    store.check_integrity()
    stats = store.stats()
    return stats.num_leases, stats.num_reservations


def test_the_default_clock_is_monotonic():
    """So no wall-clock jump (NTP, an operator's `date -s`) reaches a deadline."""
    assert {f.name: f.default for f in dataclasses.fields(Store)}["clock"] is time.monotonic


def test_an_injected_clock_jumping_back_and_far_ahead():
    clock = FakeClock(1000.0)
    with _make_store(clock) as store:
        first = _keys(2, seed=1)
        _put(store, first)
        early_lease = store.acquire(NS.id, first)
        early = store.reserve(NS.id, _keys(2, seed=2))
        assert early_lease.expires_at == 1000.0 + LEASE_S

        clock.now = 0.0  # back by 1000 s: nothing expires, everything still works
        assert _open(store) == (1, 1)
        late_lease = store.acquire(NS.id, first)
        assert late_lease.expires_at == LEASE_S
        store.reserve(NS.id, _keys(2, seed=3))  # due at RESERVATION_S
        early.write(0, 0, bytes(BLOCK))
        early.write(1, 0, bytes(BLOCK))
        assert early.commit() == 2
        assert _open(store) == (2, 1)

        clock.now = RESERVATION_S - 0.001  # each deadline counts from when it was made
        assert _open(store) == (2, 1)
        clock.now = RESERVATION_S
        assert _open(store) == (2, 0)
        clock.now = LEASE_S
        assert _open(store) == (1, 0)  # the early lease is due at 1020 of this clock
        clock.now = 1000.0 + LEASE_S
        assert _open(store) == (0, 0)

        store.acquire(NS.id, first)
        store.reserve(NS.id, _keys(2, seed=4))
        clock.now = 1e18  # far ahead: everything expires, and the store keeps working
        assert _open(store) == (0, 0)
        stats = store.stats()
        assert (stats.expired_leases, stats.expired_reservations) == (3, 2)
        _put(store, _keys(8, seed=5))
        assert store.read(NS.id, first) == [bytes([0]) * BLOCK, bytes([1]) * BLOCK]
        assert store.acquire(NS.id, first).expires_at == 1e18 + LEASE_S
