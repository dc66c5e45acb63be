"""The node's inventory as it changes: the block ids whose presence or tier changed since a
consumer last looked, for a consumer that mirrors the node's blocks elsewhere (the cluster's
global index, `kvstore.cluster`). A consumer reads each id's state now, not the events that
led there, so what it publishes is always the node's latest truth, whatever order the
changes came in.

Bounded: past `max_ids` changed ids the inventory forgets them and says so (`take`'s
`overflowed`); the consumer then republishes everything the node holds. Used under the
store's lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Noted(Protocol):
    """What the inventory notes: a block's index entry (`kvstore.store.index.Entry`)."""

    @property
    def block_id(self) -> bytes: ...


E = TypeVar("E", bound=Noted)

DEFAULT_MAX_IDS = 1 << 20  # entries held at most while the consumer cannot keep up


@dataclass(frozen=True)
class Holding:
    """What the node holds of one block now."""

    namespace_id: bytes  # the store's own (internal) namespace id
    key: bytes
    group: bytes | None  # first key of its chain group (`index.CHAIN_GROUP_BLOCKS`); None: unknown
    tier: str | None  # "dram" (with or without an HBM copy) or "ssd"; None: not held


class Inventory(Generic[E]):
    """The entries changed since the last `take`, by block id."""

    def __init__(self, max_ids: int = DEFAULT_MAX_IDS) -> None:
        assert max_ids >= 1
        self.max_ids = max_ids
        self._changed: dict[bytes, E] = {}  # block id -> its latest entry
        self._overflowed = False

    def __len__(self) -> int:
        return len(self._changed)

    def note(self, entry: E) -> None:
        """`entry` was committed, dropped, or moved between DRAM and SSD (a dropped entry is
        kept here: what its mirror must delete is named by it)."""
        if self._overflowed:
            return
        self._changed[entry.block_id] = entry
        if len(self._changed) > self.max_ids:
            self._changed.clear()
            self._overflowed = True

    def take(self) -> tuple[list[E], bool]:
        """The entries changed since the last call, and whether some were forgotten (then
        the consumer must look at every block); starts over."""
        changed, overflowed = list(self._changed.values()), self._overflowed
        self._changed, self._overflowed = {}, False
        return changed, overflowed
