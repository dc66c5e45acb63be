"""The one registry of scheduling policies, by name."""

from __future__ import annotations

from types import MappingProxyType

from kvstore.conductor.base import PolicyContext, SchedulingPolicy
from kvstore.conductor.policies.dynamo import DynamoCostPolicy
from kvstore.conductor.policies.kvcache_centric import (
    CacheAwarePolicy,
    CacheAwarePredictivePolicy,
    CacheAwareRejectPolicy,
    CacheAwareTTFTPolicy,
)
from kvstore.conductor.policies.llm_d import LlmDScorersPolicy
from kvstore.conductor.policies.prefix_rr import PrefixRoundRobinPolicy
from kvstore.conductor.policies.sglang import SGLangCacheAwarePolicy
from kvstore.conductor.policies.simple import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy

_CLASSES: tuple[type[SchedulingPolicy], ...] = (
    RandomPolicy,
    RoundRobinPolicy,
    LeastLoadedPolicy,
    PrefixRoundRobinPolicy,
    SGLangCacheAwarePolicy,
    DynamoCostPolicy,
    LlmDScorersPolicy,
    CacheAwarePolicy,
    CacheAwareTTFTPolicy,
    CacheAwareRejectPolicy,
    CacheAwarePredictivePolicy,
)
SCHEDULING_POLICIES: MappingProxyType[str, type[SchedulingPolicy]] = MappingProxyType(
    {cls.name: cls for cls in _CLASSES}
)


def make_scheduling_policy(name: str, ctx: PolicyContext) -> SchedulingPolicy:
    """A new policy by registry name; raises KeyError listing the known names."""
    if name not in SCHEDULING_POLICIES:
        raise KeyError(f"unknown scheduling policy {name!r}; known: {list(SCHEDULING_POLICIES)}")
    return SCHEDULING_POLICIES[name](ctx)
