"""Prefix 2Q: exact victim orders after each mutation."""

from __future__ import annotations

import pytest

from kvstore.store.eviction import Prefix2QPolicy


def _chain(policy: Prefix2QPolicy, keys: bytes) -> None:
    """Inserts the one-byte keys of `keys` as one chain, root first, none of them read."""
    for i, key in enumerate(keys):
        policy.insert(bytes([key]), bytes([keys[i - 1]]) if i else None)
        policy.check()


def _roots(policy: Prefix2QPolicy, keys: bytes) -> None:
    for key in keys:
        policy.insert(bytes([key]), None)
        policy.check()


def _keys(keys: bytes) -> list[bytes]:
    return [bytes([key]) for key in keys]


def _candidates(policy: Prefix2QPolicy) -> list[bytes]:
    policy.check()
    return list(policy.candidates())


def test_without_hits_probation_is_oldest_tail_first() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abc")
    _chain(policy, b"d")
    assert _candidates(policy) == [b"c", b"d"]  # a and b have a stored child
    assert all(policy.should_demote(k) for k in _keys(b"abcd"))


def test_a_hit_protects_and_a_tail_becomes_a_candidate_after_its_child_goes() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abc")
    _chain(policy, b"d")
    policy.touch(_keys(b"ab"))  # a and b used twice: protected; c, d stay on probation
    assert _candidates(policy) == [b"c", b"d"]
    policy.remove(b"c")
    # probation first (d), then protected: b (a has a child).
    assert _candidates(policy) == [b"d", b"b"]
    assert len(policy) == 3


def test_a_block_back_from_the_ghost_list_is_protected() -> None:
    policy = Prefix2QPolicy()
    _chain(policy, b"abc")
    _chain(policy, b"d")
    policy.touch(_keys(b"ab"))
    policy.remove(b"c")  # from probation: remembered in the ghost list
    policy.insert(b"c", b"b")  # used again: protected, least recent first a, c, b
    assert policy.should_demote(b"c")
    # protected holds 3 of 4 blocks, its share: probation (d) gives the first victim, then
    # protected's tail c (a and b have children).
    assert _candidates(policy) == [b"d", b"c"]
    policy.remove(b"d")
    assert _candidates(policy) == [b"c"]


def test_the_ghost_list_is_bounded_and_remove_is_idempotent() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, bytes(range(10)))
    for i in range(6):
        policy.remove(bytes([i]))
    policy.remove(b"unknown")
    assert len(policy) == 4
    # The ghost list keeps half as many keys as the policy tracks blocks (2): 4 and 5.
    policy.insert(bytes([5]), None)  # still remembered: protected
    policy.insert(bytes([0]), None)  # forgotten: probation
    policy.insert(bytes([3]), None)  # forgotten: probation
    policy.insert(bytes([4]), None)  # still remembered: protected
    assert _candidates(policy) == _keys(bytes([6, 7, 8, 9, 0, 3, 5, 4]))


@pytest.mark.parametrize(
    ("policy", "order"), [(Prefix2QPolicy(), b"bcda"), (Prefix2QPolicy(0.0), b"bcad")]
)
def test_a_policy_without_its_ghost_list_forgets_what_it_evicted(
    policy: Prefix2QPolicy, order: bytes
) -> None:
    _roots(policy, b"abc")
    policy.remove(b"a")
    policy.insert(b"a", None)  # back at once: protected if remembered, else on probation
    policy.insert(b"d", None)
    assert _candidates(policy) == _keys(order)


def test_protected_over_its_share_gives_the_first_victims() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"fabcd")
    for key in _keys(b"abc"):
        policy.touch([key])
    assert _candidates(policy) == _keys(b"fdabc")  # 3 of 5 protected: within 75%
    policy.touch([b"d"])  # 4 of 5 protected is over 75%: its least recent goes first
    assert _candidates(policy) == _keys(b"abcdf")
    policy.touch([b"a"])  # still over: the least recent is b now
    assert _candidates(policy) == _keys(b"bcdaf")
    policy.insert(b"g", None)  # 4 of 6 is within the share again: probation first
    assert _candidates(policy) == _keys(b"fgbcda")


def test_a_scan_of_blocks_used_once_does_not_flush_reused_blocks() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"ab")
    policy.touch([b"a"])
    policy.touch([b"b"])
    for key in range(100, 140):  # 40 new blocks through a cache of 4
        if len(policy) == 4:
            policy.remove(next(policy.candidates()))
        policy.insert(bytes([key]), None)
        policy.check()
    assert _candidates(policy)[-2:] == [b"a", b"b"]  # still there, the last to go


def test_a_parent_waits_from_its_childs_insert_so_the_tail_goes_first() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"a")
    _roots(policy, b"x")
    policy.insert(b"b", b"a")  # a is refreshed after b: x is now older than a
    policy.remove(b"b")
    assert _candidates(policy) == [b"x", b"a"]
