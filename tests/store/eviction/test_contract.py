"""What every eviction policy promises (`EvictionPolicy`), checked after each operation: the
shared contract, and random sequences of insert/touch/remove/candidates (hypothesis)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.store.eviction import POLICIES, EvictionPolicy

FACTORIES: dict[str, Callable[[], EvictionPolicy]] = dict(POLICIES)
NAMES = sorted(FACTORIES)
CHAIN_BLIND = {"lru"}  # offers every key, not only chain tails


def _check(policy: EvictionPolicy) -> list[bytes]:
    """Runs the policy's own check; candidates are distinct, tracked keys, and reading them
    (whole or in part) changes nothing. Returns them."""
    policy.check()
    candidates = list(policy.candidates())
    assert len(candidates) == len(set(candidates)) <= len(policy)
    next(policy.candidates(), None)
    assert list(policy.candidates()) == candidates
    policy.check()
    return candidates


def _make_policy(name: str, chains: list[list[bytes]] | None = None) -> EvictionPolicy:
    """A policy, with each chain inserted root first."""
    policy = FACTORIES[name]()
    for chain in chains or []:
        for parent, key in zip([None, *chain], chain, strict=False):
            policy.insert(key, parent)
            _check(policy)
    return policy


@pytest.mark.parametrize("name", NAMES)
def test_inserted_roots_are_candidates(name: str) -> None:
    keys = [bytes([i]) * 32 for i in range(10)]
    policy = _make_policy(name, [[k] for k in keys])
    assert len(policy) == 10
    assert sorted(_check(policy)) == sorted(keys)


@pytest.mark.parametrize("name", NAMES)
def test_removed_keys_are_not_candidates(name: str) -> None:
    keys = [bytes([i]) * 32 for i in range(10)]
    policy = _make_policy(name, [[k] for k in keys])
    for i, key in enumerate(keys[::2], start=1):
        policy.remove(key)
        assert len(policy) == 10 - i
        assert key not in set(_check(policy))
    assert sorted(policy.candidates()) == keys[1::2]


@pytest.mark.parametrize("name", NAMES)
def test_chain_tail_is_a_candidate_and_len_counts_all(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b", b"c"]])
    assert len(policy) == 3
    assert b"c" in set(_check(policy))


@pytest.mark.parametrize("name", NAMES)
def test_touch_changes_no_membership(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b"], [b"x"]])
    before = set(policy.candidates())
    policy.touch([b"a", b"b"])
    policy.touch([b"zz"])
    assert (set(_check(policy)), len(policy)) == (before, 3)


@pytest.mark.parametrize("name", NAMES)
def test_evicting_every_candidate_empties_the_policy(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b", b"c"], [b"x", b"y"], [b"p"]])
    evicted = set()
    while (victim := next(policy.candidates(), None)) is not None:
        policy.remove(victim)
        _check(policy)
        evicted.add(victim)
    assert len(policy) == 0
    assert evicted == {b"a", b"b", b"c", b"x", b"y", b"p"}


@pytest.mark.parametrize("name", NAMES)
def test_remove_unknown_key_is_a_no_op(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b"]])
    before = _check(policy)
    policy.remove(b"zz")
    assert (_check(policy), len(policy)) == (before, 2)


@pytest.mark.parametrize("name", NAMES)
def test_remove_twice_is_a_no_op(name: str) -> None:
    policy = _make_policy(name, [[b"a", b"b"], [b"x"]])
    policy.remove(b"b")
    after_first = _check(policy)
    policy.remove(b"b")
    assert (_check(policy), len(policy)) == (after_first, 2)


@pytest.mark.parametrize("name", NAMES)
def test_nothing_is_hinted_or_dropped_without_evidence(name: str) -> None:
    """Hints and demotion decisions read the policy and change nothing."""
    policy = _make_policy(name, [[b"a", b"b"]])
    before = _check(policy)
    assert [policy.should_demote(k) for k in (b"a", b"b")] == [True, True]
    assert policy.hint(b"b") is None
    assert _check(policy) == before


# --- random sequences -----------------------------------------------------------------------

NUM_KEYS = 12


def _key(i: int) -> bytes:
    return i.to_bytes(2)


# Key i's parent is a lower key or none, so chains are acyclic, as the store keeps them.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, NUM_KEYS - 1), st.integers(-1, NUM_KEYS)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, NUM_KEYS), max_size=4)),
        st.tuples(st.just("remove"), st.integers(0, NUM_KEYS)),
        st.tuples(st.just("evict"), st.integers(1, 3)),
    ),
    max_size=60,
)


class _Model:
    """What the store knows: the tracked keys and the parent each was inserted under."""

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes | None] = {}

    def tails(self) -> set[bytes]:
        parents = set(self.parent.values())
        return {k for k in self.parent if k not in parents}


def _apply(policy: EvictionPolicy, model: _Model, op: tuple) -> None:
    if op[0] == "insert":
        key = _key(op[1])
        parent = _key(op[2]) if 0 <= op[2] < op[1] else None
        if key not in model.parent:  # the store inserts a key once per stay
            policy.insert(key, parent)
            model.parent[key] = parent
    elif op[0] == "touch":
        policy.touch([_key(i) for i in sorted(set(op[1]))])
    elif op[0] == "remove":
        policy.remove(_key(op[1]))
        model.parent.pop(_key(op[1]), None)
    else:
        for _ in range(op[1]):
            victim = next(policy.candidates(), None)
            if victim is not None:
                policy.remove(victim)
                del model.parent[victim]


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_random_operations_keep_every_invariant(name: str, ops: list[tuple]) -> None:
    policy = FACTORIES[name]()
    model = _Model()
    for op in ops:
        _apply(policy, model, op)
        candidates = set(_check(policy))
        assert len(policy) == len(model.parent)
        assert candidates <= set(model.parent)
        assert model.tails() <= candidates  # every tail can be evicted
        if name not in CHAIN_BLIND:
            assert candidates == model.tails()
