"""Prefix LRU: LRU over chain tails, exact candidate orders."""

from __future__ import annotations

from kvstore.store.eviction import PrefixLRUPolicy


def _make(chains: list[list[bytes]]) -> PrefixLRUPolicy:
    policy = PrefixLRUPolicy()
    for chain in chains:
        for parent, key in zip([None, *chain], chain, strict=False):
            policy.insert(key, parent)
            policy.check()
    return policy


def _candidates(policy: PrefixLRUPolicy) -> list[bytes]:
    policy.check()
    return list(policy.candidates())


def _drain(policy: PrefixLRUPolicy) -> list[bytes]:
    """Evicts every block, the first candidate each time; the victims in order."""
    evicted = []
    while len(policy):
        victim = next(policy.candidates())
        policy.remove(victim)
        policy.check()
        evicted.append(victim)
    return evicted


def test_offers_only_tails() -> None:
    policy = _make([[b"a", b"b", b"c"], [b"x", b"y"]])
    assert _candidates(policy) == [b"c", b"y"]
    assert len(policy) == 5


def test_evicts_a_chain_tail_first() -> None:
    policy = _make([[b"a", b"b", b"c"], [b"x", b"y"]])
    # Order is [a, c, b, y, x] (an insert touches only the parent): once c goes, b is older
    # than y and a leaf, so the first chain drains before the second starts.
    assert _drain(policy) == [b"c", b"b", b"a", b"y", b"x"]


def test_touch_leaves_root_most_recent() -> None:
    policy = _make([[b"a", b"b", b"c"], [b"x", b"y"]])
    policy.touch([b"a", b"b", b"c"])
    assert _candidates(policy) == [b"y", b"c"]
    # LRU order y, x, c, b, a: the touched chain goes tail first, after the other one.
    assert _drain(policy) == [b"y", b"x", b"c", b"b", b"a"]


def test_insert_of_child_touches_parent() -> None:
    policy = _make([[b"a", b"b"], [b"x"]])
    assert _candidates(policy) == [b"b", b"x"]
    policy.insert(b"c", b"b")  # extends the old chain: b is now more recent than x
    assert _candidates(policy) == [b"x", b"c"]


def test_child_before_parent_is_linked_when_the_parent_arrives() -> None:
    policy = PrefixLRUPolicy()
    policy.insert(b"c", b"b")  # a lower tier gets a chain's victims tail first
    policy.insert(b"b", b"a")
    assert _candidates(policy) == [b"c"]  # b adopted c: not a tail
    policy.insert(b"a", None)
    assert _candidates(policy) == [b"c"]
    for key, then in ((b"c", [b"b"]), (b"b", [b"a"]), (b"a", [])):
        policy.remove(key)
        assert _candidates(policy) == then
    policy.insert(b"b", None)  # nothing waits for a key that left: b has no child
    assert _candidates(policy) == [b"b"]


def test_branching_chain_offers_each_leaf() -> None:
    policy = _make([[b"a", b"b", b"c"]])
    policy.insert(b"d", b"b")  # a -> b -> {c, d}
    assert _candidates(policy) == [b"c", b"d"]
    policy.remove(b"c")
    assert _candidates(policy) == [b"d"]  # b still has d
    policy.remove(b"d")
    assert _candidates(policy) == [b"b"]


def test_remove_middle_makes_children_roots() -> None:
    policy = _make([[b"a", b"b", b"c"]])
    policy.remove(b"b")
    assert _candidates(policy) == [b"a", b"c"]
    assert len(policy) == 2
    policy.remove(b"a")
    assert _candidates(policy) == [b"c"]
    policy.remove(b"c")
    assert (len(policy), _candidates(policy)) == (0, [])


def test_remove_middle_then_children_first() -> None:
    policy = _make([[b"a", b"b", b"c", b"d"]])
    policy.remove(b"b")
    assert _candidates(policy) == [b"a", b"d"]
    for key in (b"d", b"c", b"a"):
        policy.remove(key)
        policy.check()
    assert len(policy) == 0


def test_reinsert_removed_middle_key() -> None:
    policy = _make([[b"a", b"b", b"c"]])
    policy.remove(b"b")
    policy.insert(b"b", b"a")
    assert len(policy) == 3
    assert _candidates(policy) == [b"c"]  # b is back, and c is reachable through it again
    policy.remove(b"c")
    assert _candidates(policy) == [b"b"]
