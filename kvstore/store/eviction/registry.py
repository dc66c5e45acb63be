"""The one registry of eviction policies, by name."""

from __future__ import annotations

from types import MappingProxyType

from kvstore.store.eviction.base import EvictionPolicy
from kvstore.store.eviction.lru import LRUPolicy
from kvstore.store.eviction.prefix_2q import Prefix2QPolicy
from kvstore.store.eviction.prefix_lru import PrefixLRUPolicy

POLICIES: MappingProxyType[str, type[EvictionPolicy]] = MappingProxyType(
    {"lru": LRUPolicy, "prefix-lru": PrefixLRUPolicy, "prefix-2q": Prefix2QPolicy}
)


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by registry name; raises KeyError listing the known names."""
    if name not in POLICIES:
        raise KeyError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]()
