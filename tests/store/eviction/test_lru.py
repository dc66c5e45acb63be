"""LRU: least recently used first, blind to chains."""

from __future__ import annotations

import pytest

from kvstore.store.eviction import BlockHint, LRUPolicy


def _lru(keys: list[bytes]) -> LRUPolicy:
    policy = LRUPolicy()
    for key in keys:
        policy.insert(key, None)
        policy.check()
    return policy


def test_orders_by_insert() -> None:
    policy = _lru([b"a", b"b", b"c"])
    assert list(policy.candidates()) == [b"a", b"b", b"c"]
    assert len(policy) == 3


@pytest.mark.parametrize(
    ("touches", "expected"),
    [
        ([], [b"a", b"b", b"c", b"d"]),
        ([[b"a"]], [b"b", b"c", b"d", b"a"]),
        ([[b"b", b"a"]], [b"c", b"d", b"b", b"a"]),
        ([[b"c"], [b"a"], [b"c"]], [b"b", b"d", b"a", b"c"]),
        ([[b"d"]], [b"a", b"b", b"c", b"d"]),
        ([[b"zz", b"a"]], [b"b", b"c", b"d", b"a"]),  # unknown keys are ignored
    ],
)
def test_touch_moves_keys_to_most_recent(touches: list[list[bytes]], expected: list[bytes]) -> None:
    policy = _lru([b"a", b"b", b"c", b"d"])
    for keys in touches:
        policy.touch(keys)
        policy.check()
    assert list(policy.candidates()) == expected
    assert len(policy) == 4


def test_reinsert_moves_to_most_recent() -> None:
    policy = _lru([b"a", b"b"])
    policy.insert(b"a", None)
    policy.check()
    assert list(policy.candidates()) == [b"b", b"a"]
    assert len(policy) == 2


def test_evicts_chain_root_before_its_tail() -> None:
    policy = LRUPolicy()
    for parent, key in [(None, b"a"), (b"a", b"b"), (b"b", b"c"), (None, b"x"), (b"x", b"y")]:
        policy.insert(key, parent)
    assert list(policy.candidates()) == [b"a", b"b", b"c", b"x", b"y"]


def test_ignores_hints_and_demotes_everything() -> None:
    policy = LRUPolicy()
    policy.insert(b"d", b"c", moved=True, hint=BlockHint())
    assert policy.hint(b"d") is None and policy.should_demote(b"d")
    assert list(policy.candidates()) == [b"d"]
