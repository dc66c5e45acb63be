"""The scheduler without a model: prefill chunked by the token budget, decodes first,
admissions capped by `max_num_seqs` and the pool, the youngest request preempted and
requeued first, a store hit LOADING_REMOTE_KV until `schedule` collects its load,
requests finished on a stop token or max_tokens with their pages released, and the roles:
a prefill engine's request PUBLISHING_KV after its first token until its publish is
collected, a decode engine's loading the published count it was handed without a lookup."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest
import torch

from gpu_engine.block_manager import BlockManager
from gpu_engine.config import EngineConfig, EngineRole
from gpu_engine.connector_base import BlockPages, ConnectorRequest, KVConnector, NoopConnector
from gpu_engine.errors import PublishError
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
    scheduler.transfer.wait_for_transfer()
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


class PublishingConnector(HeldConnector):
    """Records its calls; the store holds `num_loaded` blocks, and a publish commits
    `num_committed` (all: None) once `gate` is set."""

    def __init__(self, num_loaded: int, num_committed: int | None = None) -> None:
        super().__init__(num_loaded)
        self.num_committed = num_committed
        self.calls: list[tuple[str, int]] = []

    def lookup(self, request: ConnectorRequest, keys: Sequence[bytes]) -> int:
        self.calls.append(("lookup", len(keys)))
        return min(self.num_loaded, len(keys))

    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        self.calls.append(("load", len(keys)))
        return super().load(request, keys, pages)

    def publish(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        self.calls.append(("publish", len(keys)))
        return len(keys) if self.num_committed is None else self.num_committed


@pytest.mark.parametrize("async_load", [True, False])
def test_a_prefill_request_finishes_at_its_first_token_once_published(async_load: bool) -> None:
    connector = PublishingConnector(0)
    scheduler = _make(connector, role="prefill", async_load=async_load)
    if not async_load:
        connector.gate.set()  # the publish runs inside the step that finished the prompt
    req = _add(scheduler, 0, 4 * BLOCK + 3, max_tokens=4)
    assert _step(scheduler) == [(0, 4 * BLOCK + 3, True)]
    assert req.token_ids[4 * BLOCK + 3 :] == [TOKEN] and req.finish_reason == "prefill"
    if async_load:
        assert req.status is RequestStatus.PUBLISHING_KV and len(req.pages) == 9
        assert scheduler.has_unfinished and scheduler.num_running == 1
        assert scheduler.schedule() == ScheduledBatch([], [], [], [])  # still publishing
        connector.gate.set()
        scheduler.transfer.wait_for_transfer()
    assert scheduler.schedule() == ScheduledBatch([], [], [], [req])
    assert req.status is RequestStatus.FINISHED and req.pages == []
    assert (req.num_published_tokens, req.error) == (4 * BLOCK, None)
    assert connector.calls == [("lookup", 4), ("publish", 4)]
    _assert_idle(scheduler)


def test_a_prefill_publish_that_falls_short_is_the_requests_error() -> None:
    connector = PublishingConnector(0, num_committed=1)
    connector.gate.set()
    scheduler = _make(connector, role="prefill", async_load=False)
    req = _add(scheduler, 0, 3 * BLOCK, max_tokens=4, stop_token_ids=(TOKEN,))
    _step(scheduler)
    assert scheduler.schedule().finished == [req]
    assert req.finish_reason == "stop" and req.num_published_tokens == BLOCK
    assert isinstance(req.error, PublishError) and req.error.num_published_tokens == BLOCK
    assert "1 of 3 prompt blocks" in str(req.error)
    _assert_idle(scheduler)


@pytest.mark.parametrize(
    ("num_published_tokens", "calls", "num_loaded"),
    [(3 * BLOCK, [("load", 3)], 3), (0, [("lookup", 4), ("load", 4)], 4)],
)
def test_a_decode_request_loads_the_published_count_without_a_lookup(
    num_published_tokens: int, calls: list[tuple[str, int]], num_loaded: int
) -> None:
    connector = PublishingConnector(num_loaded=4)
    connector.gate.set()
    scheduler = _make(connector, role="decode", async_load=False)
    req = _add(scheduler, 0, 4 * BLOCK + 3, max_tokens=3)
    req.num_published_tokens = num_published_tokens
    while scheduler.has_unfinished:
        _step(scheduler)
    assert connector.calls == calls
    assert req.store_cached_tokens == num_loaded * BLOCK
    assert req.finish_reason == "length" and req.num_output_tokens == 3
    _assert_idle(scheduler)


def test_each_role_has_its_policy_and_an_unknown_role_names_the_valid_ones() -> None:
    assert [_make(role=r.value).role for r in EngineRole] == list(EngineRole)
    with pytest.raises(InvalidArgumentError, match=r"\['both', 'prefill', 'decode'\]"):
        EngineConfig(role="nonsense")


def test_an_aborted_request_releases_its_pages_and_the_others_go_on() -> None:
    scheduler = _make(max_num_seqs=2)
    running, other = _add(scheduler, 0, 10, max_tokens=8), _add(scheduler, 1, 6, max_tokens=3)
    waiting = _add(scheduler, 2, 6, max_tokens=2)
    _step(scheduler)
    assert running.status is RequestStatus.RUNNING and running.pages
    assert waiting.status is RequestStatus.WAITING
    assert scheduler.abort(running.request_id) and scheduler.abort(waiting.request_id)
    for req in (running, waiting):
        assert req.status is RequestStatus.FINISHED and req.finish_reason == "abort"
        assert req.pages == []
    assert _step(scheduler) == [(1, 1, True)]  # neither is scheduled again
    assert not scheduler.abort(running.request_id)  # finished: nothing to abort
    assert not scheduler.abort(99)
    while scheduler.has_unfinished:
        _step(scheduler)
    assert other.finish_reason == "length" and other.token_ids[6:] == [TOKEN] * 3
    _assert_idle(scheduler)


def test_a_request_aborted_while_loading_keeps_its_pages_until_the_load_is_over() -> None:
    connector = HeldConnector(num_loaded=2)
    scheduler = _make(connector, async_load=True)
    hit = _add(scheduler, 0, 4 * BLOCK + 3)
    assert _step(scheduler) == []
    assert hit.status is RequestStatus.LOADING_REMOTE_KV
    assert scheduler.abort(hit.request_id)
    # The load still writes into its pages: they stay its own until the load is over.
    assert hit.status is RequestStatus.LOADING_REMOTE_KV and hit.pages
    assert scheduler.num_running == 1 and scheduler.has_unfinished
    connector.gate.set()
    scheduler.transfer.wait_for_transfer()
    assert _step(scheduler) == []  # collected, and not run
    assert hit.status is RequestStatus.FINISHED and hit.finish_reason == "abort"
    assert scheduler.block_manager.pool.num_cached_blocks == 2  # what arrived is kept
    _assert_idle(scheduler)


def test_a_prefetch_loads_into_the_prefix_cache_and_computes_nothing() -> None:
    connector = HeldConnector(num_loaded=3)
    scheduler = _make(connector, async_load=True)
    prefetch = _add(scheduler, 0, 4 * BLOCK + 1)
    prefetch.prefetch = True
    assert _step(scheduler) == []
    assert prefetch.status is RequestStatus.LOADING_REMOTE_KV
    connector.gate.set()
    scheduler.transfer.wait_for_transfer()
    batch = scheduler.schedule()  # collects the load: finished, handed back, never run
    assert (batch.requests, batch.finished) == ([], [prefetch])
    assert prefetch.status is RequestStatus.FINISHED and prefetch.finish_reason == "prefetch"
    assert (prefetch.store_cached_tokens, prefetch.num_output_tokens) == (3 * BLOCK, 0)
    assert scheduler.block_manager.pool.num_cached_blocks == 3
    _assert_idle(scheduler)
    # A request of the same prompt now finds those blocks in the prefix cache.
    same = _add(scheduler, 1, 4 * BLOCK + 3)
    same.token_ids[: 4 * BLOCK + 1] = prefetch.token_ids
    same.prefetch = False
    connector.num_loaded = 0
    assert _step(scheduler) == []  # asks the store for block 3 only, which sends none
    scheduler.transfer.wait_for_transfer()
    assert _step(scheduler) == [(1, BLOCK + 3, True)]
    assert (same.local_cached_tokens, same.store_cached_tokens) == (3 * BLOCK, 0)


def test_a_prefetch_the_store_cannot_serve_finishes_at_admission() -> None:
    scheduler = _make()  # a store that holds nothing
    prefetch = _add(scheduler, 0, 2 * BLOCK + 1)
    prefetch.prefetch = True
    batch = scheduler.schedule()
    assert (batch.requests, batch.finished, prefetch.finish_reason) == ([], [prefetch], "prefetch")
    _assert_idle(scheduler)
