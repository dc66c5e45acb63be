"""Writes one grpc.aio response stream with at most one message in flight, each send under
the stall deadline.

A send that its reader takes nothing of for `stall_timeout_s` raises `StreamStalledError`:
the handler ends the call (its leases and whatever produced the stream are freed) and the
stalled message stays below, in the transport, until the reader takes it or goes away. So
the stream's slot is given back when that pending send settles, never before: a reader that
stalls and opens another stream pays for both.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from kvstore import errors
from kvstore.bounds.stream_slots import StreamSlot, StreamSlots


class StreamWriter:
    """Sends `context`'s responses one at a time; `close` gives the slot back."""

    def __init__(
        self, context: grpc.aio.ServicerContext, slots: StreamSlots, slot: StreamSlot
    ) -> None:
        self._context = context
        self._slots = slots
        self._slot = slot
        self._pending: asyncio.Future[Any] | None = None  # a stalled send, still below

    async def write(self, message: Any) -> None:
        """Sends `message`; raises StreamStalledError past the stall deadline, and whatever
        the send raised where the call ended under it (the client went away)."""
        assert self._pending is None, "a stalled stream takes no more messages"
        send = asyncio.ensure_future(self._context.write(message))
        try:
            await asyncio.wait({send}, timeout=self._slots.limits.stall_timeout_s)
        finally:
            if not send.done():  # stalled, or this handler cancelled: it settles below
                self._pending = send
            elif not send.cancelled():
                send.exception()  # retrieved: raised below, or dropped with a cancellation
        if self._pending is not None:
            self._slots.stalled()
            raise errors.StreamStalledError(
                f"the reader took nothing for {self._slots.limits.stall_timeout_s:g} s "
                "(stream_stall_timeout_s); the stream is ended"
            )
        send.result()

    def close(self) -> None:
        """Gives the slot back now, or once a pending send settles."""
        if self._pending is None:
            self._slot.release()
            return
        self._pending.add_done_callback(self._settled)

    def _settled(self, send: asyncio.Future[Any]) -> None:
        if not send.cancelled():
            send.exception()  # retrieved: a send the call's end failed is expected here
        self._slot.release()
