"""Replications a policy plans are carried out live: the target engine prefetches the hot
blocks from the store into its prefix cache, and a request of that prefix then finds them
there. Real store and engine processes; the conductor in this process, with a policy that
pins where requests go so the test knows which engine lacks the prefix."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from gpu_engine.engine_client import EngineClient
from gpu_engine.sampling import SamplingParams
from kvstore.conductor.base import PolicyContext, Replication, SchedulingPolicy
from kvstore.conductor.decision import Accept, Decision
from kvstore.conductor.front.completion import CompletionRequest
from kvstore.conductor.front.conductor import Conductor
from kvstore.conductor.front.config import ConductorConfig
from kvstore.conductor.front.server import ConductorServer
from kvstore.conductor.request import SchedRequest
from kvstore.conductor.slo import SLO
from kvstore.conductor.view import ClusterView
from tests.conftest import wait_until

BLOCK = 8
NUM_BLOCKS = 6
ENGINE_FLAGS = ("--block-tokens", str(BLOCK), "--page-tokens", str(BLOCK), "--num-pages", "256")


class PinnedPolicy(SchedulingPolicy):
    """Every request to instance `target`; plans a copy there of what the pool holds of
    its prompt."""

    name = "pinned"

    def __init__(self, ctx: PolicyContext, target: int) -> None:
        super().__init__(ctx)
        self.target = target
        self._planned: list[Replication] = []

    def decide(self, request: SchedRequest, view: ClusterView) -> Decision:
        pooled = view.pool_prefix(request.hash_ids)
        if pooled:
            self._planned.append(Replication(self.target, tuple(request.hash_ids[:pooled])))
        return Accept(self.target, self.target)

    def replications(self, view: ClusterView) -> Sequence[Replication]:
        planned, self._planned = self._planned, []
        return planned


@pytest.fixture
def engines(store, engine_factory) -> list[str]:
    """Two "both" engine processes publishing to and loading from `store`."""
    return [engine_factory("--store", store.address, *ENGINE_FLAGS).address for _ in range(2)]


def _prompt() -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(7)
    return tuple(torch.randint(0, 512, (NUM_BLOCKS * BLOCK + 3,), generator=gen).tolist())


async def _complete(conductor: Conductor, request: CompletionRequest) -> list[int]:
    ticket = await conductor.admit(request)
    return [t for chunk in [c async for c in conductor.run(ticket)] for t in chunk.token_ids]


def test_a_planned_replication_prefetches_the_pooled_prefix_on_its_target(store, engines):
    prompt = _prompt()
    request = CompletionRequest(prompt, 4, 0.0, None, SLO(60.0, 10_000.0))
    first, second = (EngineClient(a, timeout_s=60.0) for a in engines)
    outcomes: list[tuple[str, int]] = []

    async def scenario() -> tuple[list[int], list[int]]:
        config = ConductorConfig(
            engines=",".join(engines), store=store.address, port=0, speed_window=0
        )
        server = await ConductorServer(config).start()
        conductor = server.conductor
        over = asyncio.Event()  # a replication ended, however

        def heard(outcome: str, num_blocks: int) -> None:
            outcomes.append((outcome, num_blocks))
            if outcome != "started":
                over.set()

        conductor.replication_listeners.append(heard)
        ctx = PolicyContext(conductor.cluster.cost, request.slo)
        try:
            conductor.policy = PinnedPolicy(ctx, target=0)
            computed = await _complete(conductor, request)  # engine 0 computes, publishes
            await asyncio.to_thread(
                wait_until,
                lambda: (lo := first.load()).num_pending_blocks == 0 and lo.num_published_blocks,
                30.0,
                "engine 0 published the prompt",
            )
            conductor.policy = PinnedPolicy(ctx, target=1)
            ticket = await conductor.admit(request)  # plans and starts the copy to engine 1
            assert outcomes == [("started", 0)]
            await asyncio.wait_for(over.wait(), timeout=60.0)
            served = [t for c in [c async for c in conductor.run(ticket)] for t in c.token_ids]
            scrape = server.metrics.text().decode()
            assert 'kvstore_conductor_replications_total{outcome="done"} 1.0' in scrape
            assert f"kvstore_conductor_replicated_blocks_total {NUM_BLOCKS}.0" in scrape
            return computed, served
        finally:
            await server.stop()

    computed, served = asyncio.run(scenario())
    assert outcomes == [("started", 0), ("done", NUM_BLOCKS)]
    assert served == computed
    # The prefetched blocks are in engine 1's prefix cache: a request finds them local.
    out = second.generate(list(prompt), SamplingParams(max_tokens=4))
    assert list(out.output_token_ids) == computed
    assert (out.usage.local_cached_tokens, out.usage.store_cached_tokens) == (NUM_BLOCKS * BLOCK, 0)
