"""SGLang's gateway (sgl-router, cache-aware policy).

Cache-aware by an approximate radix tree of what it sent to each worker (here: each
instance's local cache) unless the load, in running requests, is imbalanced
(max - min > `balance_abs_threshold` and max > `balance_rel_threshold` x min), then the
least-loaded worker. Cache-aware: the worker with the longest match when the match covers
more than `cache_threshold` of the prompt, else the one with the most free cache, which
here, with every cache full, is the least loaded. Decode: the fewest running requests.
Never rejects.
"""

from __future__ import annotations

from kvstore.conductor.base import SchedulingPolicy
from kvstore.conductor.decision import Accept, Decision
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.view import ClusterView

BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.0001
CACHE_THRESHOLD = 0.5


class SGLangCacheAwarePolicy(SchedulingPolicy):
    """sgl-router's cache-aware policy with its default thresholds."""

    name = "sglang-cache-aware"

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        loads = [p.num_queued() for p in view.prefill]
        least = min(range(len(loads)), key=lambda i: loads[i])
        hi, lo = max(loads), min(loads)
        if hi - lo > BALANCE_ABS_THRESHOLD and hi > BALANCE_REL_THRESHOLD * lo:
            prefill = least
        else:
            matches = [p.cached_prefix(request.hash_ids) for p in view.prefill]
            top = max(range(len(matches)), key=lambda i: (matches[i], -loads[i]))
            matched = view.cost.tokens(matches[top], request.input_len)
            prefill = top if matched > CACHE_THRESHOLD * request.input_len else least
        decode = min(
            range(len(view.decode)),
            key=lambda i: len(view.decode[i].running()) + len(view.decode[i].incoming()),
        )
        return Accept(prefill, decode)
