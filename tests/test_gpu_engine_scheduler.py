"""The scheduler without a model: prefill chunked by the token budget, decodes first,
admissions capped by `max_num_seqs` and the pool, the youngest request preempted and
requeued first, a store hit LOADING_REMOTE_KV until `schedule` collects its load, and
requests finished on a stop token or max_tokens with their pages released."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest
import torch

from gpu_engine.block_manager import BlockManager
from gpu_engine.config import EngineConfig, EngineRole
from gpu_engine.connector_base import BlockPages, ConnectorRequest, KVConnector, NoopConnector
from gpu_engine.kv_transfer import KVTransfer
from gpu_engine.page_pool import PagePool
from gpu_engine.request import Request, RequestStatus
from gpu_engine.sampling import SamplingParams
from gpu_engine.scheduler import ScheduledBatch, Scheduler
from kvstore.errors import InvalidArgumentError

BLOCK, PAGE = 8, 4
TOKEN = 5  # what the stand-in sampler always picks


class HeldConnector(KVConnector):
    """The store holds every block; a load reports `num_loaded` once `gate` is set."""

    def __init__(self, num_loaded: int) -> None:
        self.num_loaded = num_loaded
        self.gate = threading.Event()

    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return min(self.num_loaded, len(keys))

    def save(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> None:
        return None


def _make(connector: KVConnector | None = None, **overrides: object) -> Scheduler:
    fields: dict = {"block_tokens": BLOCK, "page_tokens": PAGE, "num_pages": 64}
    config = EngineConfig(**(fields | overrides))
    pool = PagePool(config.num_pages, config.pages_per_block)
    manager = BlockManager(pool, config.namespace, BLOCK, PAGE, config.enable_prefix_cache)
    transfer = KVTransfer(connector or NoopConnector(), config.async_load)
    return Scheduler(config, manager, transfer)


def _add(scheduler: Scheduler, request_id: int, prompt_len: int, **params: object) -> Request:
    tokens = [(request_id * 31 + i) % 512 for i in range(prompt_len)]
    sp = SamplingParams(**({"max_tokens": 4} | params))
    req = Request(request_id, tokens, prompt_len, sp, torch.Generator(), 0.0)
    scheduler.add(req)
    return req


def _step(scheduler: Scheduler, now: float = 1.0) -> list[tuple[int, int, bool]]:
    """schedule, a stand-in forward pass, postprocess; (request id, tokens, sampled) each."""
    batch = scheduler.schedule()
    tokens = [TOKEN] * len(batch.sample_rows)
    scheduler.postprocess(batch, tokens, torch.zeros(len(tokens), 8), now)
    return _plan(batch)


def _plan(batch: ScheduledBatch) -> list[tuple[int, int, bool]]:
    return [
        (r.request_id, n, i in batch.sample_rows)
        for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens, strict=True))
    ]


def _assert_idle(scheduler: Scheduler) -> None:
    pool = scheduler.block_manager.pool
    pool.check()
    assert not scheduler.has_unfinished
    assert pool.num_available == pool.num_pages


def test_prefill_is_chunked_by_the_budget_and_decode_tokens_do_not_count() -> None:
    scheduler = _make(max_prefill_tokens=16)
    a, b = _add(scheduler, 0, 20, max_tokens=3), _add(scheduler, 1, 20, max_tokens=3)
    assert _step(scheduler) == [(0, 16, False)]
    assert _step(scheduler) == [(0, 4, True), (1, 12, False)]
    assert _step(scheduler) == [(0, 1, True), (1, 8, True)]
    assert _step(scheduler) == [(0, 1, True), (1, 1, True)]
    assert a.status is RequestStatus.FINISHED and a.finish_reason == "length"
    assert _step(scheduler) == [(1, 1, True)]
    assert b.finish_reason == "length" and b.token_ids[20:] == [TOKEN] * 3
    _assert_idle(scheduler)


def test_admissions_stop_at_max_num_seqs() -> None:
    scheduler = _make(max_num_seqs=2)
    reqs = [_add(scheduler, i, 6, max_tokens=2) for i in range(3)]
    assert _step(scheduler) == [(0, 6, True), (1, 6, True)]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1
    assert reqs[2].status is RequestStatus.WAITING
    assert _step(scheduler) == [(0, 1, True), (1, 1, True)]  # both finish
    assert _step(scheduler) == [(2, 6, True)]
    assert _step(scheduler) == [(2, 1, True)]
    _assert_idle(scheduler)


def test_the_youngest_running_request_is_preempted_and_requeued_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gpu_engine.scheduler")
    scheduler = _make(num_pages=6)  # two 8-token prompts growing to 20 tokens: 10 pages
    old, young = _add(scheduler, 0, 8, max_tokens=12), _add(scheduler, 1, 8, max_tokens=12)
    plan = _step(scheduler)
    while young.status is RequestStatus.RUNNING:
        plan = _step(scheduler)
    assert plan == [(0, 1, True)]  # the step that preempted `young` still ran `old`
    assert young.status is RequestStatus.WAITING and young.pages == []
    assert young.num_computed == 0 and len(young.token_ids) == 13  # its tokens are kept
    assert "event=preempt request_id=1 tokens=13" in caplog.text
    _add(scheduler, 2, 4, max_tokens=1)
    while old.status is RequestStatus.RUNNING:
        _step(scheduler)
    assert _step(scheduler) == [(1, 13, True), (2, 4, True)]  # the preempted one first
    while scheduler.has_unfinished:
        _step(scheduler)
    assert young.token_ids[8:] == [TOKEN] * 12
    _assert_idle(scheduler)


@pytest.mark.parametrize("async_load", [True, False])
@pytest.mark.parametrize("num_loaded", [4, 2, 0])
def test_a_store_hit_loads_while_others_run_and_joins_at_the_next_schedule(
    num_loaded: int, async_load: bool
) -> None:
    connector = HeldConnector(num_loaded)
    scheduler = _make(connector, async_load=async_load)
    if not async_load:
        connector.gate.set()  # the load runs inside the admission
    hit = _add(scheduler, 0, 4 * BLOCK + 3)
    other = _add(scheduler, 1, 5, max_tokens=3)
    assert _step(scheduler) == [(1, 5, True)]  # the hit's load is in flight meanwhile
    assert hit.status is RequestStatus.LOADING_REMOTE_KV
    assert scheduler.num_running == 2 and scheduler.num_waiting == 0
    connector.gate.set()
    scheduler.transfer.wait_for_load()
    rest = 4 * BLOCK + 3 - num_loaded * BLOCK
    assert _step(scheduler) == [(1, 1, True), (0, rest, True)]
    assert hit.status is RequestStatus.RUNNING and other.status is RequestStatus.RUNNING
    assert (hit.local_cached_tokens, hit.store_cached_tokens) == (0, num_loaded * BLOCK)
    assert scheduler.block_manager.pool.num_cached_blocks == 4  # loaded, then computed
    while scheduler.has_unfinished:
        _step(scheduler)
    _assert_idle(scheduler)


def test_a_stop_token_finishes_a_request_and_releases_its_pages() -> None:
    scheduler = _make()
    stopped = _add(scheduler, 0, 10, max_tokens=8, stop_token_ids=(TOKEN,))
    _step(scheduler, now=3.0)
    assert stopped.status is RequestStatus.FINISHED and stopped.finish_reason == "stop"
    assert stopped.token_ids[10:] == [TOKEN] and stopped.pages == []
    assert stopped.first_token_s == stopped.last_token_s == 3.0
    assert scheduler.block_manager.pool.num_cached_blocks == 1  # its one full block
    _assert_idle(scheduler)


def test_only_the_both_role_runs_today() -> None:
    assert _make().role is EngineRole.BOTH
    for role in ("prefill", "decode", "nonsense"):
        with pytest.raises(InvalidArgumentError, match="role"):
            EngineConfig(role=role)
