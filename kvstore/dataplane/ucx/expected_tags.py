"""The tags a node may still receive a message under, for the sweeper to tell the rest.

A node receives two kinds of message (`frames.Kind`): request frames, under a connection's
one request tag, and the blocks of a put, under tags derived from the put's request id
(`frames.Tags.base`). A block may arrive before the node reads its request (an eager put
sends it right behind the request frame) or while the request is being handled, never
after. So a block is expected only if its request id is one the node has not read yet or
one it is handling; every other tag is one no receive will ever match.

Request ids of a connection count up from 1 (`UcxClient`; threads sharing a client may
send them a little out of order). The ids tracked are a window of `WINDOW` ids on either
side of the highest one read, each id's tag base computed once; a block of an id outside
it is not expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.dataplane.frames import BASE_MASK, MAX_REQUEST_ID, Kind, Tags

WINDOW = 256  # request ids past the highest read whose blocks may already be arriving


@dataclass
class _Window:
    client_id: int
    tags: Tags
    handling: set[int]  # ids of requests being handled (the connection's own set)
    max_read: int = 0
    ids: range = range(1, 1)  # the request ids in the window: they only move up
    bases: dict[int, int] = field(default_factory=dict)  # request id -> tag base, in window
    read: set[int] = field(default_factory=set)  # ids in the window the node has read


class ExpectedTags:
    """Per live connection: its request tag, and the tag bases of its blocks that may still
    arrive. Not thread-safe: the node uses it from its data-plane loop only."""

    def __init__(self) -> None:
        self._requests: dict[int, _Window] = {}  # request tag -> its connection
        self._blocks: dict[int, tuple[_Window, int]] = {}  # block tag base -> request
        self._windows: dict[int, _Window] = {}  # client id -> window

    @property
    def num_block_bases(self) -> int:
        """How many block tag bases are tracked: at most 2 x WINDOW per connection."""
        return len(self._blocks)

    def add(self, client_id: int, tags: Tags, handling: set[int]) -> None:
        """Starts expecting the frames of a connection; `handling` is the set of request ids
        it is handling, kept current by the node."""
        window = _Window(client_id, tags, handling)
        self._windows[client_id] = window
        self._requests[tags.request] = window
        self._slide(window, 0)

    def remove(self, client_id: int) -> None:
        """Stops expecting anything of a connection (dropped): its late frames are swept."""
        window = self._windows.pop(client_id, None)
        if window is None:
            return
        self._requests.pop(window.tags.request, None)
        for base in window.bases.values():
            self._forget(window, base)

    def read(self, client_id: int, request_id: int) -> None:
        """The node read request `request_id` of the connection: the window moves past it."""
        window = self._windows.get(client_id)
        if window is None:
            return
        if request_id > window.max_read:
            self._slide(window, request_id)
        if request_id in window.ids:
            window.read.add(request_id)

    def expects(self, tag: int) -> bool:
        """Whether a receive of a live connection may still match a message under `tag`."""
        if tag >> 60 == Kind.REQUEST:
            return tag in self._requests
        if tag >> 60 != Kind.BLOCK:
            return False
        block = self._blocks.get(tag & BASE_MASK)
        if block is None:
            return False
        window, request_id = block
        return request_id not in window.read or request_id in window.handling

    def owner(self, tag: int) -> int | None:
        """The client id of the connection `tag` belongs to, if it is live."""
        window = self._requests.get(tag) or self._blocks.get(tag & BASE_MASK, (None,))[0]
        return None if window is None else window.client_id

    def _slide(self, window: _Window, max_read: int) -> None:
        """Moves the window to ids (max_read - WINDOW, max_read + WINDOW]: behind the highest
        read, ids being handled or sent out of order; ahead, ids not read yet."""
        ids = range(max(1, max_read - WINDOW + 1), min(max_read + WINDOW, MAX_REQUEST_ID) + 1)
        for request_id in range(window.ids.start, min(window.ids.stop, ids.start)):
            self._forget(window, window.bases.pop(request_id))
            window.read.discard(request_id)
        for request_id in range(max(ids.start, window.ids.stop), ids.stop):
            base = window.tags.base(request_id)
            window.bases[request_id] = base
            self._blocks[base] = (window, request_id)
        window.ids, window.max_read = ids, max_read

    def _forget(self, window: _Window, base: int) -> None:
        if self._blocks.get(base, (None,))[0] is window:
            del self._blocks[base]
