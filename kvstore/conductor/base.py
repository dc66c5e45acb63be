"""The scheduling policy contract: one `decide` per request over a read-only view.

A policy owns its own state only (counters, a seeded random generator, statistics it
learns from finished requests); it never mutates the view. The same object drives a live
front and the simulator, so it reads the clock from the view, never from the machine.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.decision import Decision
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.slo import SLO
from kvstore.conductor.view import ClusterView


@dataclass(frozen=True)
class PolicyContext:
    """What every policy is built with.

    Attributes:
        cost: the cost model predictions are made with.
        slo: the objectives requests are served under.
        seed: seeds the policy's random choices, so a run is reproducible.
    """

    cost: CostModel
    slo: SLO
    seed: int = 0


class Replication(NamedTuple):
    """Copy `hash_ids` (a chain prefix, first block first) from the pool to prefill
    instance `target`'s local cache, in the background."""

    target: int
    hash_ids: tuple[int, ...]


class SchedulingPolicy(ABC):
    """Routes and admits requests.

    Contract: `decide` is called once per request, in arrival order, with a view at the
    request's arrival; it returns `Accept` (instances that exist in the view) or `Reject`,
    and changes only the policy's own state. `observe_output` is called once per request
    that finished decoding. `replications` is called after each `decide` and returns copies
    the caller should start; it may be empty.
    """

    name: ClassVar[str]

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.rng = random.Random(ctx.seed)

    @abstractmethod
    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        """Where `request` runs, or why it is refused."""

    def observe_output(  # noqa: B027 - most policies learn nothing
        self, output_len: int, input_len: int | None = None, ended: bool = True
    ) -> None:
        """A request finished with `output_len` output tokens; `input_len` is its prompt's
        length where the caller knows it; `ended` False: its output was cut there by its
        `max_tokens`, and would have run longer."""

    def replications(self, view: ClusterView) -> Sequence[Replication]:
        """Hot blocks to copy now; none unless the policy replicates."""
        return ()

    def counts(self) -> Mapping[str, int]:
        """What the policy counted about its own decisions so far (reported with a run's
        figures); nothing unless it counts."""
        return {}
