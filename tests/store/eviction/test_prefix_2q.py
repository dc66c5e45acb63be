"""Prefix 2Q: exact victim orders after each mutation."""

from __future__ import annotations

import itertools

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
    policy = Prefix2QPolicy(ghost_ages=(0.5,))  # plain 2Q: the paper's ghost list
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
    ("policy", "order"), [(Prefix2QPolicy(), b"bcda"), (Prefix2QPolicy(ghost_ages=()), b"bcad")]
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


_FILLERS = itertools.count()


def _evict_then_age(policy: Prefix2QPolicy, key: bytes, age: int) -> None:
    """Evicts `key`, then `age` more blocks (fillers inserted and evicted at once)."""
    policy.remove(key)
    for _ in range(age):
        filler = b"filler-%d" % next(_FILLERS)  # never seen before
        policy.insert(filler, None)
        policy.remove(filler)
        policy.check()


def test_the_ghost_list_remembers_up_to_its_last_age_class() -> None:
    policy = Prefix2QPolicy()  # ages up to 4x the tracked blocks
    _roots(policy, bytes(range(20)))
    for i in range(10):
        policy.remove(bytes([i]))  # 10 tracked: the ghost list holds up to 40 keys
    _evict_then_age(policy, bytes([10]), 40)
    policy.insert(bytes([0]), None)  # 50 evictions ago: forgotten
    policy.insert(bytes([10]), None)  # 40 ago: remembered, from the oldest age class
    assert policy.check() is None and len(policy) == 11


def test_a_block_back_from_long_ago_waits_on_probation_while_protected_blocks_earn_more() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"abcd")
    policy.touch(_keys(b"ab"))  # a and b protected
    for _ in range(3):
        policy.touch(_keys(b"ab"))  # protected blocks earn hits, and none has left
    _evict_then_age(policy, b"c", 3)  # 3 evictions with 3 tracked: the second age class
    policy.insert(b"c", None)
    assert policy.earnings() == (6.0, [0.0, 0.0, 0.0, 0.0])
    assert _candidates(policy)[:2] == [b"d", b"c"]  # on probation, oldest first
    # Back from within half the tracked blocks' worth of evictions: always protected.
    _evict_then_age(policy, b"d", 1)
    policy.insert(b"d", None)
    assert _candidates(policy)[0] == b"c" and _candidates(policy)[-1] == b"d"


def test_blocks_back_from_long_ago_are_protected_while_they_earn_and_one_in_four_anyway() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"abcdefgh")
    policy.touch([b"e"])
    policy.touch([b"e"])  # protected, then hit once
    for key in _keys(b"fgh"):
        policy.touch([key])  # protected
    for key in _keys(b"efg"):
        policy.remove(key)  # gone: protected blocks earn 1 hit in 4 (a prior counts as left)

    def is_protected(key: bytes) -> bool:  # candidates: probation, then protected (h first)
        order = _candidates(policy)
        return order.index(key) > order.index(b"h")

    # Returners from the third age class (6 evictions, 4 tracked): three wait on probation,
    # the fourth is protected.
    for n, key in enumerate(_keys(b"abcd"), start=1):
        _evict_then_age(policy, key, 6)
        policy.insert(key, None)
        assert is_protected(key) is (n == 4), n
    policy.touch([b"d"])  # the explored returner earns a hit while protected
    protected, per_class = policy.earnings()
    assert per_class[2] == 1 / 2 and protected == 2 / 4
    _evict_then_age(policy, b"a", 6)
    policy.insert(b"a", None)  # its class earns as much as protected blocks: protected
    assert is_protected(b"a")


def test_what_protection_earned_halves_as_blocks_are_touched() -> None:
    policy = Prefix2QPolicy()
    _roots(policy, b"ab")
    policy.touch([b"a"])
    policy.touch([b"a"])  # protected, then 1 hit
    for _ in range(7):
        policy.touch([b"b"])  # protected, then 6 hits: 9 keys touched, past 4 x 2 blocks
    policy.remove(b"a")  # one protected block leaves (and one counted as left before)
    assert policy.earnings()[0] == pytest.approx((7 / 2) / (1 / 2 + 1))  # not 7 / 2
