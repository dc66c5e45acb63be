"""Eviction policies: which committed block a tier gives up first. One registry, `POLICIES`.

A policy sees keys and chain links only, never bytes, tiers or leases. The store offers it
every committed block, reports accesses, and asks for candidates in eviction order; the
store itself skips candidates it may not evict (leased, reserved, in another tier).

Modules: `base` (the contract, `EvictionPolicy`, and `BlockHint`), `lru`, `prefix_lru`,
`prefix_2q` and its parts (`chain_links`, `ghost_list`), `registry`.
"""

from __future__ import annotations

from kvstore.store.eviction.base import BlockHint, EvictionPolicy
from kvstore.store.eviction.lru import LRUPolicy
from kvstore.store.eviction.prefix_2q import Prefix2QPolicy
from kvstore.store.eviction.prefix_lru import PrefixLRUPolicy
from kvstore.store.eviction.registry import POLICIES, make_policy

__all__ = [
    "POLICIES",
    "BlockHint",
    "EvictionPolicy",
    "LRUPolicy",
    "Prefix2QPolicy",
    "PrefixLRUPolicy",
    "make_policy",
]
