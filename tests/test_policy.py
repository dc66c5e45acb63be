"""Eviction policies: exact candidate orders, chain handling, the registry, the shared contract."""

from __future__ import annotations

import pytest

from kvstore.policy import (
    POLICIES,
    EvictionPolicy,
    LRUPolicy,
    Prefix2QPolicy,
    PrefixLRUPolicy,
    make_policy,
)


def _make_policy(name: str, chains: list[list[bytes]] | None = None) -> EvictionPolicy:
    """A policy by registry name, with each chain inserted root first."""
    policy = make_policy(name)
    for chain in chains or []:
        for parent, key in zip([None, *chain], chain, strict=False):
            policy.insert(key, parent)
            _check_integrity(policy)
    return policy


def _check_integrity(policy: EvictionPolicy) -> None:
    """Candidates are distinct, tracked keys; PrefixLRU's links agree with each other."""
    candidates = list(policy.candidates())
    assert len(candidates) == len(set(candidates)) <= len(policy)
    if isinstance(policy, LRUPolicy):
        assert len(policy._order) == len(policy)
        assert set(candidates) <= set(policy._order)
    if isinstance(policy, PrefixLRUPolicy):
        chains = policy._chains
        assert set(chains._children) == set(policy._order)
        for child, parent in chains._parent.items():
            assert child in chains._children[parent]
        for parent, children in chains._children.items():
            assert all(chains._parent[c] == parent for c in children)
        for child, parent in chains._awaits.items():
            assert child in chains._awaited[parent] and child in chains._children
            assert parent not in chains._children and child not in chains._parent
        assert sum(map(len, chains._awaited.values())) == len(chains._awaits)
        assert candidates == [k for k in policy._order if not chains._children[k]]


def _candidates(policy: EvictionPolicy) -> list[bytes]:
    return list(policy.candidates())


# --- LRU ----------------------------------------------------------------------------------------


def test_lru_orders_by_insert() -> None:
    policy = _make_policy("lru", [[b"a"], [b"b"], [b"c"]])
    assert _candidates(policy) == [b"a", b"b", b"c"]
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
def test_lru_touch_moves_keys_to_most_recent(
    touches: list[list[bytes]], expected: list[bytes]
) -> None:
    policy = _make_policy("lru", [[b"a"], [b"b"], [b"c"], [b"d"]])
    for keys in touches:
        policy.touch(keys)
        _check_integrity(policy)
    assert _candidates(policy) == expected
    assert len(policy) == 4


def test_lru_reinsert_moves_to_most_recent() -> None:
    policy = _make_policy("lru", [[b"a"], [b"b"]])
    policy.insert(b"a", None)
    _check_integrity(policy)
    assert _candidates(policy) == [b"b", b"a"]
    assert len(policy) == 2


# --- chains -------------------------------------------------------------------------------------


def test_lru_evicts_chain_root_before_its_tail() -> None:
    policy = _make_policy("lru", [[b"a", b"b", b"c"], [b"x", b"y"]])
    assert _candidates(policy) == [b"a", b"b", b"c", b"x", b"y"]


def test_prefix_lru_offers_only_tails() -> None:
    policy = _make_policy("prefix-lru", [[b"a", b"b", b"c"], [b"x", b"y"]])
    assert _candidates(policy) == [b"c", b"y"]
    assert len(policy) == 5


def test_prefix_lru_evicts_a_chain_tail_first() -> None:
    policy = _make_policy("prefix-lru", [[b"a", b"b", b"c"], [b"x", b"y"]])
    evicted = []
    while len(policy):
        victim = next(policy.candidates())
        policy.remove(victim)
        _check_integrity(policy)
        evicted.append(victim)
    # Order is [a, c, b, y, x] (an insert touches only the parent): once c goes, b is older
    # than y and a leaf, so the first chain drains before the second starts.
    assert evicted == [b"c", b"b", b"a", b"y", b"x"]


def test_prefix_lru_touch_leaves_root_most_recent() -> None:
    policy = _make_policy("prefix-lru", [[b"a", b"b", b"c"], [b"x", b"y"]])
    policy.touch([b"a", b"b", b"c"])
    _check_integrity(policy)
    assert list(policy._order) == [b"y", b"x", b"c", b"b", b"a"]  # type: ignore[attr-defined]
    assert _candidates(policy) == [b"y", b"c"]


def test_prefix_lru_insert_of_child_touches_parent() -> None:
    policy = _make_policy("prefix-lru", [[b"a", b"b"], [b"x"]])
    assert _candidates(policy) == [b"b", b"x"]
    policy.insert(b"c", b"b")  # extends the old chain: b is now more recent than x
    _check_integrity(policy)
    assert _candidates(policy) == [b"x", b"c"]


def test_prefix_lru_child_before_parent_is_linked_when_the_parent_arrives() -> None:
    policy = _make_policy("prefix-lru")
    policy.insert(b"c", b"b")  # a lower tier gets a chain's victims tail first
    policy.insert(b"b", b"a")
    _check_integrity(policy)
    assert _candidates(policy) == [b"c"]  # b adopted c: not a tail
    policy.insert(b"a", None)
    _check_integrity(policy)
    assert _candidates(policy) == [b"c"]
    for key, then in ((b"c", [b"b"]), (b"b", [b"a"]), (b"a", [])):
        policy.remove(key)
        _check_integrity(policy)
        assert _candidates(policy) == then
    assert policy._chains._awaited == {}  # nothing waits for a key that left


def test_prefix_lru_branching_chain_offers_each_leaf() -> None:
    policy = _make_policy("prefix-lru", [[b"a", b"b", b"c"]])
    policy.insert(b"d", b"b")  # a -> b -> {c, d}
    _check_integrity(policy)
    assert _candidates(policy) == [b"c", b"d"]
    policy.remove(b"c")
    _check_integrity(policy)
    assert _candidates(policy) == [b"d"]  # b still has d
    policy.remove(b"d")
    _check_integrity(policy)
    assert _candidates(policy) == [b"b"]


# --- remove -------------------------------------------------------------------------------------


def test_prefix_lru_remove_middle_makes_children_roots() -> None:
    policy = _make_policy("prefix-lru", [[b"a", b"b", b"c"]])
    policy.remove(b"b")
    _check_integrity(policy)
    assert _candidates(policy) == [b"a", b"c"]
    assert len(policy) == 2
    policy.remove(b"a")
    _check_integrity(policy)
    assert _candidates(policy) == [b"c"]
    policy.remove(b"c")
    _check_integrity(policy)
    assert (len(policy), _candidates(policy)) == (0, [])


def test_prefix_lru_remove_middle_then_children_first() -> None:
    policy = _make_policy("prefix-lru", [[b"a", b"b", b"c", b"d"]])
    policy.remove(b"b")
    _check_integrity(policy)
    assert _candidates(policy) == [b"a", b"d"]
    for key in (b"d", b"c", b"a"):
        policy.remove(key)
        _check_integrity(policy)
    assert len(policy) == 0


def test_prefix_lru_reinsert_removed_middle_key() -> None:
    policy = _make_policy("prefix-lru", [[b"a", b"b", b"c"]])
    policy.remove(b"b")
    policy.insert(b"b", b"a")
    _check_integrity(policy)
    assert len(policy) == 3
    assert _candidates(policy) == [b"c"]  # b is back, and c is reachable through it again
    policy.remove(b"c")
    _check_integrity(policy)
    assert _candidates(policy) == [b"b"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_remove_unknown_key_is_a_no_op(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b"]])
    before = _candidates(policy)
    policy.remove(b"zz")
    _check_integrity(policy)
    assert (_candidates(policy), len(policy)) == (before, 2)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_remove_twice_is_a_no_op(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b"], [b"x"]])
    policy.remove(b"b")
    after_first = _candidates(policy)
    policy.remove(b"b")
    _check_integrity(policy)
    assert (_candidates(policy), len(policy)) == (after_first, 2)


# --- registry -----------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert dict(POLICIES) == {
        "lru": LRUPolicy,
        "prefix-lru": PrefixLRUPolicy,
        "prefix-2q": Prefix2QPolicy,
    }


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        POLICIES["mine"] = LRUPolicy  # type: ignore[index]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_make_policy_returns_a_fresh_instance(name: str) -> None:
    first, second = make_policy(name), make_policy(name)
    assert type(first) is POLICIES[name]
    assert first is not second
    first.insert(b"a", None)
    assert (len(first), len(second)) == (1, 0)


@pytest.mark.parametrize("name", ["nope", "", "LRU", "prefix_lru"])
def test_make_policy_unknown_name_lists_known(name: str) -> None:
    with pytest.raises(KeyError) as exc:
        make_policy(name)
    assert (
        exc.value.args[0] == f"unknown policy {name!r}; known: ['lru', 'prefix-2q', 'prefix-lru']"
    )


# --- shared contract ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_inserted_roots_are_candidates(name: str) -> None:
    keys = [bytes([i]) * 32 for i in range(10)]
    policy = _make_policy(name, [[k] for k in keys])
    assert len(policy) == 10
    assert sorted(policy.candidates()) == sorted(keys)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_removed_keys_are_not_candidates(name: str) -> None:
    keys = [bytes([i]) * 32 for i in range(10)]
    policy = _make_policy(name, [[k] for k in keys])
    for i, key in enumerate(keys[::2], start=1):
        policy.remove(key)
        _check_integrity(policy)
        assert len(policy) == 10 - i
        assert key not in set(policy.candidates())
    assert sorted(policy.candidates()) == keys[1::2]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_chain_tail_is_a_candidate_and_len_counts_all(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b", b"c"]])
    assert len(policy) == 3
    assert b"c" in set(policy.candidates())


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_touch_changes_no_membership(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b"], [b"x"]])
    before = set(policy.candidates())
    policy.touch([b"a", b"b"])
    policy.touch([b"zz"])
    _check_integrity(policy)
    assert (set(policy.candidates()), len(policy)) == (before, 3)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_evicting_every_candidate_empties_the_policy(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b", b"c"], [b"x", b"y"], [b"p"]])
    evicted = set()
    while (victim := next(policy.candidates(), None)) is not None:
        policy.remove(victim)
        _check_integrity(policy)
        evicted.add(victim)
    assert len(policy) == 0
    assert evicted == {b"a", b"b", b"c", b"x", b"y", b"p"}
