"""`OfferTracker`: which requests still have blocks on their way to the store.

The block publisher puts each staged offer on its own thread and reports only totals, so a
prefill engine that must not finish a request before its blocks are in the store counts,
per request, the offers it staged and not yet settled. An offer settles when its put
returns or raises, or when the publisher never puts it: nothing staged (all dropped), or
cut because a parent's put failed. The last case is never seen by the offer itself, so any
failed put settles every offer staged before it (the waiter then checks the store, which
is the truth in any case).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.client.publishing.publisher import PutChain


class OfferTracker:
    """Counts staged, unsettled offers per request id; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, list[int]] = {}  # request id -> [offers, failures at first]
        self._num_failures = 0

    def track(self, request_id: int, put_chain: PutChain) -> PutChain:
        """Counts one offer of `request_id` as pending; the returned put settles it (call
        `settle` instead if it is never handed to the publisher)."""
        with self._cond:
            entry = self._pending.setdefault(request_id, [0, self._num_failures])
            entry[0] += 1

        def tracked(
            keys: Sequence[bytes], blocks: Sequence[object], parent: bytes | None
        ) -> object:
            try:
                result = put_chain(keys, blocks, parent)  # type: ignore[arg-type]
            except BaseException:
                self.settle(request_id, failed=True)
                raise
            self.settle(request_id)
            return result

        return tracked  # type: ignore[return-value]

    def settle(self, request_id: int, failed: bool = False) -> None:
        """One offer of `request_id` is over (its put `failed`, or it was never put)."""
        with self._cond:
            entry = self._pending.get(request_id)  # None: settled by a failure, or forgotten
            if entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    del self._pending[request_id]
            if failed:  # settles every offer staged before it: forget them
                self._num_failures += 1
                self._pending = {
                    r: e for r, e in self._pending.items() if e[1] >= self._num_failures
                }
            self._cond.notify_all()

    def wait(self, request_id: int, timeout_s: float) -> bool:
        """Blocks until every offer of `request_id` settled (or a put failed since the first
        of them was staged), then forgets the request; False on timeout."""
        with self._cond:
            is_settled = self._cond.wait_for(lambda: request_id not in self._pending, timeout_s)
            self._pending.pop(request_id, None)
            return is_settled

    def num_pending(self, request_id: int) -> int:
        """Offers of `request_id` staged and not settled."""
        with self._cond:
            entry = self._pending.get(request_id)
            return entry[0] if entry is not None else 0
