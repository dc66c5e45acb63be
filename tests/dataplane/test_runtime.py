"""A UCX runtime's stop ends what runs on its loop (kvstore.dataplane.ucx.runtime): a task
left pending is destroyed pending whenever the loop is collected, in some later test, and
asyncio logs it there."""

from __future__ import annotations

import asyncio
import gc
import logging

from tests.conftest import require_extra


def _runtime(name: str):
    require_extra("ucxx")
    from kvstore.dataplane.ucx.runtime import UcxRuntime

    return UcxRuntime(name, {"NET_DEVICES": "lo"})


def test_stop_cancels_the_loops_tasks_and_none_is_destroyed_pending(caplog):
    rt = _runtime("runtime-stop")
    started: list[asyncio.Task] = []

    async def forever() -> None:
        started.append(asyncio.current_task())
        await asyncio.sleep(3600)

    pending = rt.submit(forever())
    rt.call(asyncio.sleep(0), 5.0)  # its task is created and run first: it has started
    rt.stop()
    assert pending.cancelled()
    assert started[0].cancelled()
    del rt, pending
    started.clear()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()
    assert not [r for r in caplog.records if "destroyed" in r.getMessage()]


def test_a_second_stop_is_harmless():
    rt = _runtime("runtime-stop-twice")
    rt.stop()
    rt.stop()
    assert rt.ctx is None
