"""`EventStream`: one ``text/event-stream`` response of the HTTP API, held in a stream slot,
every write under the stall deadline.

aiohttp's `write` hands its bytes to the transport and, once its buffer passes the
high-water mark, waits for the transport to drain: a reader that takes nothing blocks it,
and the handler, its engine calls and the buffered bytes would stay for as long as that
reader likes. Here each write must finish within `stall_timeout_s`, and so must the end,
which waits until every byte is with the kernel (else a reader that took nothing of a
short answer would leave its bytes in the transport after the handler ended, uncounted).
Past the deadline the stall is counted and `StreamStalledError` raised; `close` then aborts
the connection, which drops what is buffered, and gives the slot back. So a stream's slot
is taken until nothing of it is left in the conductor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvstore.bounds import StreamSlot, StreamSlots
from kvstore.errors import StreamStalledError


class EventStream:
    """The response of one streamed request: `open`, `send`\\* and `end`; always `close`.

    Args:
        http: the request it answers.
        slots: the conductor's stream slots (their stall timeout, their stall count).
        slot: the slot this stream took in them.
    """

    def __init__(self, http: web.Request, slots: StreamSlots, slot: StreamSlot) -> None:
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        self.is_stalled = False
        self._http = http
        self._slots = slots
        self._slot = slot

    async def open(self) -> None:
        """Sends the status and headers (buffered: this never waits on the reader)."""
        await self.response.prepare(self._http)

    async def send(self, data: bytes) -> None:
        """Writes `data`; StreamStalledError where the reader takes too little for the write
        to finish within the stall deadline (the stream takes nothing more then)."""
        await self._bounded(lambda: self.response.write(data))

    async def end(self) -> None:
        """Ends the response once every byte of it is with the kernel; StreamStalledError
        where that takes longer than the stall deadline."""
        transport = self._http.transport
        if transport is None:  # the client is gone: write_eof raises as any write would
            await self.response.write_eof()
            return
        low, high = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=0)  # write_eof drains the buffer to empty
        try:
            await self._bounded(self.response.write_eof)
        finally:
            transport.set_write_buffer_limits(high=high, low=low)

    def close(self) -> None:
        """Aborts a stalled stream's connection (its buffered bytes are dropped), then gives
        the slot back; idempotent."""
        transport = self._http.transport
        if self.is_stalled and transport is not None:
            transport.abort()
        self._slot.release()

    async def _bounded(self, write: Callable[[], Awaitable[None]]) -> None:
        assert not self.is_stalled, "a stalled stream takes no more writes"
        timeout_s = self._slots.limits.stall_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await write()
        except TimeoutError:
            self.is_stalled = True
            self._slots.stalled()
            raise StreamStalledError(
                f"the reader took nothing for {timeout_s:g} s (stream_stall_timeout_s); "
                "the stream is ended"
            ) from None
