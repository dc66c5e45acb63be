"""The policy registry: names, fresh instances, errors."""

from __future__ import annotations

import pytest

from kvstore.store.eviction import POLICIES, LRUPolicy, Prefix2QPolicy, PrefixLRUPolicy, make_policy


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
