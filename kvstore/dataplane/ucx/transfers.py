"""Tagged transfers of a whole batch on one endpoint: posted in one pass, awaited together.

ucxx's `Endpoint.send`/`recv` are coroutines: awaited through `asyncio.gather`, each block
costs a coroutine, a task and its checks (~15 us of Python per message, measured on 4 KiB
messages where the bytes are free). Here a batch posts every request straight on the
endpoint's `UCXEndpoint` in one loop, then waits on the requests' own futures: per block
that is one request and one future, no task. The endpoint's state is checked once per batch.

A UCX request does not keep its buffer alive: each `Posted` holds both, and callers keep
them until they complete. A batch that fails or is cancelled leaves requests posted; the
caller aborts the endpoint, which cancels them, before its buffers may be reused (the data
plane's rule).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvstore.checksum import checksum

REFILL_EVERY = 50  # posts between top-ups of ucxx's futures pool (`_post`)


class Posted(NamedTuple):
    """A posted UCX request and the buffer it reads or writes (kept alive with it)."""

    request: Any
    buffer: Any


def _api() -> tuple[Any, Any, Any]:
    # Imported on first use: this package imports without the `ucx` extra.
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    return Array, Tag, TagMaskFull


def _endpoint(ep: Any) -> Any:
    """The `UCXEndpoint` under an async `Endpoint`; raises if it has failed or closed."""
    ucx_ep = ep._ep  # ucxx keeps it private; `send`/`recv` use it exactly like this
    if ucx_ep is None or ep.closed:
        from ucxx._lib.libucxx import UCXCloseError

        raise UCXCloseError("Endpoint closed")
    ucx_ep.raise_on_error()
    return ucx_ep


def _same(buf: Any) -> Any:
    return buf


def _retrieved(future: asyncio.Future[Any]) -> None:
    # A batch stops waiting at its first failure; the others fail too (the endpoint is
    # aborted next): their errors are seen here, not logged as never retrieved.
    if not future.cancelled():
        future.exception()


def _posted(request: Any, buffer: Any) -> Posted:
    request.future.add_done_callback(_retrieved)
    return Posted(request, buffer)


def _post(ep: Any, post: Callable[[Any, int], Any], buffers: Sequence[Any]) -> list[Posted]:
    """`post(array, i)` per buffer. Each UCX request takes a future from the worker's pool,
    which holds 100 and refills only when under 50 (ucxx's `populateFuturesPool`); an empty
    pool fills itself with a warning per refill. A batch tops it up every REFILL_EVERY."""
    array, _, _ = _api()
    worker = ep._ctx.worker  # ucxx keeps it private; its notifier thread refills it alike
    posted = []
    for i, buf in enumerate(buffers):
        if i % REFILL_EVERY == 0:
            worker.populate_python_futures_pool()
        a = array(buf)
        posted.append(_posted(post(a, i), a))
    return posted


def post_sends(ep: Any, buffers: Sequence[Any], tags: Sequence[int]) -> list[Posted]:
    """Posts one tagged send per buffer (`buffers[i]` under `tags[i]`)."""
    assert len(buffers) == len(tags), f"{len(buffers)} buffers for {len(tags)} tags"
    _, tag, _ = _api()
    ucx_ep = _endpoint(ep)
    return _post(ep, lambda a, i: ucx_ep.tag_send(a, tag(tags[i])), buffers)


def post_receives(ep: Any, buffers: Sequence[Any], tags: Sequence[int]) -> list[Posted]:
    """Posts one tagged receive per buffer."""
    assert len(buffers) == len(tags), f"{len(buffers)} buffers for {len(tags)} tags"
    _, tag, mask = _api()
    ucx_ep = _endpoint(ep)
    return _post(ep, lambda a, i: ucx_ep.tag_recv(a, tag(tags[i]), mask), buffers)


async def wait_one(posted: Posted) -> None:
    """Waits for one request; raises its UCX error (cancelled, truncated, peer gone)."""
    if not posted.request.completed:
        await posted.request.future
    posted.request.check_error()


async def wait_all(posted: Sequence[Posted]) -> None:
    """Waits for every request; raises the first UCX error among them."""
    pending = [p.request.future for p in posted if not p.request.completed]
    if pending:
        await asyncio.gather(*pending)
    for p in posted:
        p.request.check_error()


async def summed(
    posted: Sequence[Posted],
    buffers: Sequence[Any],
    host_of: Callable[[Any], Any] = _same,
    crcs: Sequence[int] | None = None,
) -> list[int]:
    """Waits for posted receives and returns the CRC32C of each buffer, summed as it lands.

    Block i is summed (the checksum lets go of the GIL) while blocks i+1.. are still
    arriving, in posting order, which is nearly arrival order. `host_of(buffer)`: host
    memory holding the buffer's bytes (a copy, for device memory). `crcs`: the CRC32C of
    what came before each buffer (its block's earlier parts), which each sum continues.
    """
    sums = []
    for i, (one, buf) in enumerate(zip(posted, buffers, strict=True)):
        await wait_one(one)
        sums.append(checksum(host_of(buf), crcs[i] if crcs is not None else 0))
    return sums
