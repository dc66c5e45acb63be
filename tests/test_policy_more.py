"""The frequency-aware policies: exact victim orders after each mutation."""

from __future__ import annotations

from kvstore.policy import POLICIES, Prefix2QPolicy, make_policy


def _chain(policy: Prefix2QPolicy) -> None:
    """a -> b -> c, and a lone root d."""
    policy.insert(b"a", None)
    policy.insert(b"b", b"a")
    policy.insert(b"c", b"b")
    policy.insert(b"d", None)


def test_prefix_2q_is_registered() -> None:
    assert POLICIES["prefix-2q"] is Prefix2QPolicy
    assert isinstance(make_policy("prefix-2q"), Prefix2QPolicy)


def test_dead_ends_go_first_and_are_not_demoted() -> None:
    policy = Prefix2QPolicy()
    _chain(policy)
    assert list(policy.candidates()) == [b"c", b"d"]  # a and b have a stored child
    assert [policy.should_demote(k) for k in (b"a", b"b", b"c", b"d")] == [True, True, False, False]


def test_a_hit_protects_and_a_tail_becomes_a_candidate_after_its_child_goes() -> None:
    policy = Prefix2QPolicy()
    _chain(policy)
    policy.touch([b"a", b"b"])  # a and b used twice: protected; c, d stay on probation
    assert list(policy.candidates()) == [b"c", b"d"]
    policy.remove(b"c")
    # d (dead end) first; probation holds 1 of 3 blocks (> 25%), then protected: b, not a.
    assert list(policy.candidates()) == [b"d", b"b"]
    assert len(policy) == 3


def test_a_block_back_from_the_ghost_list_is_protected() -> None:
    policy = Prefix2QPolicy()
    _chain(policy)
    policy.touch([b"a", b"b"])
    policy.remove(b"c")  # from probation: remembered in the ghost list
    policy.insert(b"c", b"b")  # used again: protected, tail-first order a, c, b
    assert policy.should_demote(b"c")
    # probation (d) is 1 of 4 blocks (<= 25%): protected gives victims first; a and b have
    # children, d went first as a dead end.
    assert list(policy.candidates()) == [b"d", b"c"]
    policy.remove(b"d")
    assert list(policy.candidates()) == [b"c"]


def test_new_blocks_stay_on_probation_and_go_oldest_first() -> None:
    policy = Prefix2QPolicy()
    for key in (b"x", b"y", b"z"):
        policy.insert(key, None)
    policy.touch([b"x"])  # x: protected; y and z: dead ends
    policy.insert(b"w", b"y")  # y is extended: no longer a dead end, and not a tail
    assert list(policy.candidates()) == [b"z", b"w", b"x"]


def test_ghost_list_is_bounded_and_remove_is_idempotent() -> None:
    policy = Prefix2QPolicy()
    for i in range(10):
        policy.insert(bytes([i]), None)
    for i in range(9):
        policy.remove(bytes([i]))
    policy.remove(b"unknown")
    assert len(policy) == 1
    assert len(policy._ghost) == 2  # GHOST_FACTOR * one tracked block
    policy.insert(bytes([8]), None)  # still remembered: protected
    policy.insert(bytes([0]), None)  # forgotten: probation, a dead end
    assert list(policy.candidates()) == [bytes([9]), bytes([0]), bytes([8])]


def test_protected_overflow_gets_a_second_chance_on_probation() -> None:
    policy = Prefix2QPolicy()
    policy.insert(b"f", None)
    policy.insert(b"g", b"f")
    policy.remove(b"g")  # f: on probation, a tail, not a dead end (it was extended)
    for key in (b"a", b"b", b"c", b"d"):
        policy.insert(key, None)
    policy.touch([b"a"])
    policy.touch([b"b"])
    policy.touch([b"c"])
    assert list(policy.candidates()) == [b"d", b"f", b"a", b"b", b"c"]  # 3 of 5 protected
    policy.touch([b"d"])  # 4 of 5 protected is over 75%
    assert list(policy._probation) == [b"f"]  # moves wait until victims are wanted
    # The least recent, a, goes back to probation's young end, where victims come from,
    # oldest first: a outlives f, used once before it.
    assert list(policy.candidates()) == [b"f", b"a", b"b", b"c", b"d"]
    assert list(policy._probation) == [b"f", b"a"]
    policy.touch([b"a"])  # a hit on probation protects again; b overflows in turn
    assert list(policy.candidates()) == [b"f", b"b", b"c", b"d", b"a"]


def test_a_demoted_block_is_never_a_near_end() -> None:
    policy = Prefix2QPolicy()
    policy.insert(b"c", b"b", demoted=True)  # chain victims arrive tail first
    policy.insert(b"b", b"a", demoted=True)
    policy.insert(b"x", None)  # born here, never extended: a dead end
    assert policy._distance == {b"x": 0}
    assert list(policy.candidates()) == [b"x", b"c"]  # then probation, oldest tail first


def _unread_chain(policy: Prefix2QPolicy, keys: bytes) -> None:
    for i, key in enumerate(keys):
        policy.insert(bytes([key]), bytes([keys[i - 1]]) if i else None)


def test_near_ends_go_first_the_closest_to_the_end_first() -> None:
    policy = Prefix2QPolicy()
    _unread_chain(policy, b"abcde")  # e, d, c: 0, 1 and 2 from the end; b and a are not near
    _unread_chain(policy, b"xy")  # y, x: 0 and 1
    assert policy._distance == {b"e": 0, b"d": 1, b"c": 2, b"y": 0, b"x": 1}
    assert list(policy.candidates()) == [b"e", b"y"]
    assert [policy.should_demote(bytes([k])) for k in b"abcde"] == [True, True, True, True, False]
    policy.remove(b"e")
    policy.remove(b"y")
    assert list(policy.candidates()) == [b"d", b"x"]  # both 1 from the end: oldest first
    policy.remove(b"x")
    policy.remove(b"d")
    assert list(policy.candidates()) == [b"c"]  # 2 from the end, before probation's b
    policy.remove(b"c")
    assert list(policy.candidates()) == [b"b"]
    assert policy._distance == {}


def test_a_read_ends_near_ends_and_distances_never_shrink() -> None:
    policy = Prefix2QPolicy()
    _unread_chain(policy, b"abc")
    policy.touch([b"a", b"b"])  # read: protected, no longer near ends
    assert policy._distance == {b"c": 0}
    policy.remove(b"c")  # b is a tail again, but it was read: no dead end
    policy.insert(b"c", b"b")  # back from the ghost list: protected
    _unread_chain(policy, b"pq")
    policy.remove(b"q")
    assert policy._distance == {b"p": 1}  # still one from the end it had
    policy.insert(b"r", b"p")  # a new unread child: p stays at 1
    assert policy._distance == {b"p": 1, b"r": 0}
    policy.remove(b"r")
    policy.insert(b"r", b"p")  # back from the ghost list, as if read: p is no near end
    assert policy._distance == {}
