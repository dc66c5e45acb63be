"""The conductor's scheduling: cost model, routing and admission policies, simulator.

Modules: `profile` (the cost model's coefficients, saved as JSON; the `DATACENTER`
profile), `cost_model`, `slo`, `request`, `decision` (`Accept` / `Reject` with reason and
retry-after), `view` (the read-only cluster a policy decides on), `base` (the policy
contract), `ttft` (Algorithm 1's TTFT prediction), `output_len` and `decode_load`
(decode-load prediction), `replication` (hot blocks), `policies/` and `registry`, and
`sim/` (the discrete-event simulator).
"""

from __future__ import annotations

from kvstore.conductor.base import PolicyContext, Replication, SchedulingPolicy
from kvstore.conductor.cost_model import CostModel, PrefillPlan, plan_prefill
from kvstore.conductor.decision import Accept, Decision, Reject, RejectReason
from kvstore.conductor.profile import DATACENTER, PROFILES, CostProfile, resolve_profile
from kvstore.conductor.registry import SCHEDULING_POLICIES, make_scheduling_policy
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.slo import SLO

__all__ = [
    "DATACENTER",
    "PROFILES",
    "SCHEDULING_POLICIES",
    "SLO",
    "Accept",
    "CostModel",
    "CostProfile",
    "Decision",
    "PolicyContext",
    "PrefillPlan",
    "Reject",
    "RejectReason",
    "Replication",
    "SchedRequest",
    "SchedulingPolicy",
    "make_scheduling_policy",
    "plan_prefill",
    "resolve_profile",
]
