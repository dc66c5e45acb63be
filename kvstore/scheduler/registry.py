"""The one registry of scheduling policies, by name."""

from __future__ import annotations

from types import MappingProxyType

from kvstore.scheduler.base import PolicyContext, SchedulingPolicy
from kvstore.scheduler.policies.conductor import (
    CacheAwarePolicy,
    CacheAwarePredictivePolicy,
    CacheAwareRejectPolicy,
)
from kvstore.scheduler.policies.dynamo import DynamoCostPolicy
from kvstore.scheduler.policies.llm_d import LlmDScorersPolicy
from kvstore.scheduler.policies.prefix_rr import PrefixRoundRobinPolicy
from kvstore.scheduler.policies.sglang import SGLangCacheAwarePolicy
from kvstore.scheduler.policies.simple import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy

_CLASSES: tuple[type[SchedulingPolicy], ...] = (
    RandomPolicy,
    RoundRobinPolicy,
    LeastLoadedPolicy,
    PrefixRoundRobinPolicy,
    SGLangCacheAwarePolicy,
    DynamoCostPolicy,
    LlmDScorersPolicy,
    CacheAwarePolicy,
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
