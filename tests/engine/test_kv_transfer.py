"""KVTransfer, the engine's one handler of its connector: a raise or a count outside
[0, len(keys)] from lookup, load or publish counts as 0 and is logged once, a failed save is
logged and dropped, every load, on the loader thread or inline, ends as one `LoadResult`,
and every publish as one `PublishResult`, never held up by a load."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import pytest
import torch

from gpu_engine.block_manager import Uncached
from gpu_engine.connector_base import BlockPages, ConnectorRequest, KVConnector
from gpu_engine.kv_transfer import KVTransfer, LoadResult, PublishResult
from gpu_engine.request import Request
from gpu_engine.sampling import SamplingParams

KEYS = [b"k0", b"k1", b"k2"]
BLOCKS: list[BlockPages] = [(0,), (1,), (2,)]


class ScriptedConnector(KVConnector):
    """Reports `count` (or raises it, when it is an exception) from every call; a load waits
    for `gate`."""

    def __init__(self, count: object) -> None:
        self.count = count
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[tuple[str, ConnectorRequest, list[bytes]]] = []

    def _answer(self, op: str, request: ConnectorRequest, keys: Sequence[bytes]) -> object:
        self.calls.append((op, request, list(keys)))
        if isinstance(self.count, Exception):
            raise self.count
        return self.count

    def lookup(self, request: ConnectorRequest, keys: Sequence[bytes]) -> int:
        return self._answer("lookup", request, keys)  # type: ignore[return-value]

    def load(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return self._answer("load", request, keys)  # type: ignore[return-value]

    def save(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> None:
        self._answer("save", request, keys)

    def publish(
        self, request: ConnectorRequest, keys: Sequence[bytes], pages: Sequence[BlockPages]
    ) -> int:
        return self._answer("publish", request, keys)  # type: ignore[return-value]


def _request(request_id: int = 7) -> Request:
    return Request(request_id, [1] * 40, 40, SamplingParams(), torch.Generator(), 0.0)


def _load_all(transfer: KVTransfer, req: Request) -> list[LoadResult]:
    transfer.start_load(req, Uncached(1, b"parent", KEYS), BLOCKS)
    transfer.wait_for_transfer()
    return transfer.finished_loads()


@pytest.mark.parametrize("count", [0, 2, 3])
@pytest.mark.parametrize("async_load", [True, False])
def test_a_valid_count_is_reported_as_is(count: int, async_load: bool) -> None:
    connector = ScriptedConnector(count)
    transfer = KVTransfer(connector, async_load)
    req = _request()
    assert transfer.lookup(req, Uncached(1, b"parent", KEYS)) == count
    assert _load_all(transfer, req) == [LoadResult(req, 1, KEYS, BLOCKS, count)]
    assert transfer.num_loading == 0 and transfer.finished_loads() == []
    info = ConnectorRequest(7, 40, b"parent")
    assert connector.calls == [("lookup", info, KEYS), ("load", info, KEYS)]
    transfer.close()


@pytest.mark.parametrize(
    "count", [ConnectionError("store unreachable"), 4, -1, "3", None, 2.0], ids=repr
)
@pytest.mark.parametrize("async_load", [True, False])
def test_a_raise_or_a_bad_count_is_zero_blocks_logged(
    count: object, async_load: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpu_engine.kv_transfer")
    transfer = KVTransfer(ScriptedConnector(count), async_load)
    req = _request()
    assert transfer.lookup(req, Uncached(1, b"parent", KEYS)) == 0
    assert [r.num_loaded for r in _load_all(transfer, req)] == [0]
    event = "connector_failed" if isinstance(count, Exception) else "connector_bad_count"
    assert caplog.text.count(f"event={event} op=lookup request_id=7") == 1
    assert caplog.text.count(f"event={event} op=load request_id=7") == 1
    transfer.close()


def test_a_failed_save_is_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpu_engine.kv_transfer")
    connector = ScriptedConnector(ConnectionError("store unreachable"))
    transfer = KVTransfer(connector, async_load=True)
    transfer.save(_request(), None, None, KEYS, BLOCKS)  # does not raise
    assert connector.calls == [("save", ConnectorRequest(7, 40, None), KEYS)]
    assert "event=connector_failed op=save request_id=7" in caplog.text
    transfer.close()


def test_loads_in_flight_are_collected_once_each_in_start_order() -> None:
    connector = ScriptedConnector(1)
    connector.gate.clear()
    transfer = KVTransfer(connector, async_load=True)
    first, second = _request(1), _request(2)
    transfer.start_load(first, Uncached(0, None, KEYS[:1]), BLOCKS[:1])
    transfer.start_load(second, Uncached(0, None, KEYS[1:]), BLOCKS[1:])
    assert transfer.num_loading == 2 and transfer.finished_loads() == []
    connector.gate.set()
    transfer.close()  # waits for both: the loader runs one load at a time
    done = transfer.finished_loads()
    assert [(r.request.request_id, r.keys, r.num_loaded) for r in done] == [
        (1, KEYS[:1], 1),
        (2, KEYS[1:], 1),
    ]
    assert transfer.num_loading == 0 and transfer.finished_loads() == []


def test_waiting_with_no_load_in_flight_returns_at_once() -> None:
    transfer = KVTransfer(ScriptedConnector(0), async_load=True)
    transfer.wait_for_transfer()
    assert transfer.finished_loads() == []
    transfer.close()


@pytest.mark.parametrize(
    ("count", "num_published"), [(2, 2), (3, 3), (ConnectionError("store gone"), 0), (4, 0)]
)
@pytest.mark.parametrize("async_load", [True, False])
def test_every_publish_ends_as_one_checked_result(
    count: object, num_published: int, async_load: bool
) -> None:
    connector = ScriptedConnector(count)
    transfer = KVTransfer(connector, async_load)
    req = _request()
    transfer.start_publish(req, KEYS, BLOCKS)
    transfer.wait_for_transfer()
    assert transfer.finished_publishes() == [PublishResult(req, KEYS, num_published)]
    assert transfer.num_publishing == 0 and transfer.finished_publishes() == []
    assert connector.calls == [("publish", ConnectorRequest(7, 40, None), KEYS)]
    transfer.close()


def test_a_publish_is_not_held_up_by_a_load_in_flight() -> None:
    connector = ScriptedConnector(3)
    connector.gate.clear()  # the load waits
    transfer = KVTransfer(connector, async_load=True)
    loading, publishing = _request(1), _request(2)
    transfer.start_load(loading, Uncached(0, None, KEYS), BLOCKS)
    transfer.start_publish(publishing, KEYS, BLOCKS)
    transfer.wait_for_transfer()  # the publish: the load cannot finish
    assert [p.request for p in transfer.finished_publishes()] == [publishing]
    assert transfer.num_loading == 1 and transfer.finished_loads() == []
    connector.gate.set()
    transfer.close()
    assert [r.request for r in transfer.finished_loads()] == [loading]
